"""Server-wide settings: where to serve, which pair to offer, and the limits that protect a public server."""
from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from engine.sources import BUILTIN

AUTO, NONE = "auto", "none"

ALLOW_CUSTOM_ENV = "SPECPLAY_ALLOW_CUSTOM_MODELS"
LIVE_ENGINE_ENV = "SPECPLAY_LIVE_ENGINE"
PICK_DEFAULT_ENV = "SPECPLAY_PICK_DEFAULT"
TRUE_WORDS, FALSE_WORDS = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


@dataclass(frozen=True, slots=True)
class AppSettings:
    host: str = "127.0.0.1"
    port: int = 7860
    draft: str = AUTO    # AUTO: the built-in draft for the built-in target, none for SmolLM2; "none": no draft
    target: str = AUTO   # AUTO: SmolLM2 when its wheel is installed, else the built-in pair
    draft_device: str | None = None      # None: engine.models.default_devices decides
    target_device: str | None = None
    share: bool = False
    allow_custom_models: bool = True
    allow_local_paths: bool = False      # custom models may be local folders (else Hub ids only: see the registry)
    config_timeout_s: float = 20.0       # a custom model's config read (a Hub request) is refused after this
    load_timeout_s: float = 900.0        # a model's load (tokenizer and weights, maybe a download) likewise
    max_sessions: int = 8                # concurrent sessions holding engine state
    session_ttl_s: float = 1800.0        # a session a connection holds but does not use is dropped after this
    session_lease_s: float = 60.0        # a session no heartbeat holds is dropped this long after its last event
    max_sessions_per_client: int = 4     # sessions one client address may hold at once
    proxy_hops: int = 0                  # trusted proxies in front that append to X-Forwarded-For (a Space: 1)
    kv_budget_mib: int = 2048            # KV pool memory all sessions together may reserve
    max_new_tokens: int = 256            # the largest max_new_tokens a visitor may ask for
    max_prompt_chars: int = 8000
    concurrency: int = 1                 # decoding events run at once (the rest queue)
    live_engine: bool = True             # the Live engine page, which makes the server fetch a metrics URL
    watch_hosts: tuple[str, ...] = ()    # hosts beyond loopback that page may fetch from
    pick_default: bool = False           # start visitors with the drafter and K measured fastest on this CPU
    #                                      (engine.pick; `python app.py` turns it on, see pick_default_on)
    compute_threads: int | None = None   # OpenMP threads of the one thread that computes (engine.clock.ComputeGate);
    #                                      None: the process's count (`python app.py` gives every other thread one)

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        for name in ("max_sessions", "kv_budget_mib", "max_new_tokens", "max_prompt_chars", "concurrency",
                     "max_sessions_per_client"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("session_ttl_s", "session_lease_s", "config_timeout_s", "load_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.proxy_hops < 0:
            raise ValueError(f"proxy_hops must be >= 0, got {self.proxy_hops}")

    @property
    def browsers_here(self) -> bool:
        """Whether every visitor's browser runs on this machine: the server listens on loopback only, with no
        public link and no proxy in front (a Space has one), so its pages draw on the cores its rounds are timed on."""
        from engine.watch import is_loopback  # here: this module is read before torch loads (see one_team)

        return is_loopback(self.host) and not self.share and self.proxy_hops == 0


def running_on_space(env: Mapping[str, str]) -> bool:
    """Hugging Face Spaces set SPACE_ID in every Space's environment."""
    return bool(env.get("SPACE_ID"))


def proxy_hops_default(env: Mapping[str, str]) -> int:
    """A Space is reached through one proxy that appends the visitor's address to X-Forwarded-For."""
    return 1 if running_on_space(env) else 0


def allow_custom_default(env: Mapping[str, str]) -> bool:
    """SPECPLAY_ALLOW_CUSTOM_MODELS decides if set; otherwise custom ids are allowed locally and
    refused on a Space, where any visitor could otherwise make the server download anything."""
    return _switch(env, ALLOW_CUSTOM_ENV)


def live_engine_default(env: Mapping[str, str]) -> bool:
    """SPECPLAY_LIVE_ENGINE decides if set; otherwise the Live engine page is on locally and off on a Space,
    where any visitor could otherwise make the server fetch an address."""
    return _switch(env, LIVE_ENGINE_ENV)


def pick_default_on(env: Mapping[str, str]) -> bool:
    """SPECPLAY_PICK_DEFAULT decides if set; otherwise the server measures its default drafter and K on its own
    CPU (once per CPU model, kept under the cache), locally and on a Space alike."""
    value = env.get(PICK_DEFAULT_ENV)
    return True if value is None else _switch(env, PICK_DEFAULT_ENV)


def _switch(env: Mapping[str, str], name: str) -> bool:
    """An on/off environment variable; unset: on locally, off on a Space. ValueError for another word."""
    value = env.get(name)
    if value is None:
        return not running_on_space(env)
    word = value.strip().lower()
    if word not in TRUE_WORDS + FALSE_WORDS:
        raise ValueError(f"{name} must be one of {', '.join(TRUE_WORDS + FALSE_WORDS[:-1])}, got {value!r}")
    return word in TRUE_WORDS


def default_pair(draft: str, target: str) -> tuple[str | None, str]:
    """(draft or None, target) of the server's default pair, resolving AUTO and NONE."""
    from playground.registry import default_target

    target = default_target() if target == AUTO else target
    if draft == AUTO:
        return (BUILTIN if target == BUILTIN else None), target
    return (None if draft == NONE else draft), target


def one_team(env: MutableMapping[str, str]) -> int:
    """Before torch loads (`python app.py`): every thread computes with one OpenMP thread except the compute
    thread, which gets the count the environment asked for (OMP_NUM_THREADS, else every core this process may
    use); returns that count. OpenMP keeps a team for each thread that computed in parallel, and with more such
    threads than cores it stops letting them spin between parallel regions: a server whose worker threads each
    computed decoded SmolLM2 at 38-41 tokens/s where one thread did 65 (engine.clock.ComputeGate)."""
    wanted = env.get("OMP_NUM_THREADS", "").strip()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = int(wanted) if wanted.isdigit() and int(wanted) > 0 else cores
    env["OMP_NUM_THREADS"] = "1"
    return threads

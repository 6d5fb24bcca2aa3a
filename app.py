"""`python app.py`: serve the specplay playground (127.0.0.1:7860 by default)."""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

from engine.sources import SMOLLM2
from playground.settings import (
    ALLOW_CUSTOM_ENV,
    AUTO,
    LIVE_ENGINE_ENV,
    PICK_DEFAULT_ENV,
    AppSettings,
    allow_custom_default,
    live_engine_default,
    one_team,
    pick_default_on,
    proxy_hops_default,
    running_on_space,
)


def parse_args(argv: list[str], env: dict[str, str]) -> AppSettings:
    d = AppSettings()
    ap = argparse.ArgumentParser(description="Serve the speculative-decoding playground.")
    ap.add_argument("--host", default=d.host)
    ap.add_argument("--port", type=int, default=d.port)
    ap.add_argument("--draft", default=d.draft,
                    help="draft model of the default pair: 'builtin', a Hub id or a path, or 'none' (default: auto, the "
                         "built-in draft for the built-in target, none for SmolLM2, which drafts by prompt lookup or "
                         "its EAGLE head)")
    ap.add_argument("--target", default=d.target,
                    help="target of the default pair: 'smollm2', 'builtin', a Hub id or a path (default: auto, SmolLM2 "
                         "when its offline wheel is installed, else the built-in pair)")
    ap.add_argument("--draft-device", default=None, help="e.g. cpu, cuda:0 (default: auto)")
    ap.add_argument("--target-device", default=None, help="e.g. cpu, cuda:1 (default: auto)")
    ap.add_argument("--share", action="store_true", help="open a public Gradio share link (off by default)")
    ap.add_argument("--allow-custom-models", action=argparse.BooleanOptionalAction, default=None,
                    help=f"let visitors load any model id or path (default: ${ALLOW_CUSTOM_ENV}, else on "
                         "locally and off on a Hugging Face Space)")
    ap.add_argument("--allow-local-paths", action="store_true",
                    help="let custom model ids be folders on this machine (off: Hub ids only, and a visitor learns "
                         "nothing of this machine's files)")
    ap.add_argument("--hub-timeout", type=float, default=d.config_timeout_s, metavar="SECONDS",
                    help="refuse a custom model whose config the Hub has not sent within this long")
    ap.add_argument("--load-timeout", type=float, default=d.load_timeout_s, metavar="SECONDS",
                    help="refuse a model whose tokenizer and weights have not loaded (downloaded) within this long")
    ap.add_argument("--max-sessions", type=int, default=d.max_sessions,
                    help="sessions (browser tabs, API clients) holding a run at once")
    ap.add_argument("--max-sessions-per-client", type=int, default=d.max_sessions_per_client,
                    help="sessions one client address may hold (raise it for a classroom behind one NAT address)")
    ap.add_argument("--idle-timeout", type=float, default=d.session_ttl_s, metavar="SECONDS",
                    help="drop a session its tab keeps open but does not use for this long")
    ap.add_argument("--session-lease", type=float, default=d.session_lease_s, metavar="SECONDS",
                    help="drop a session no heartbeat keeps open (an API caller gone) this long after its last use")
    ap.add_argument("--proxy-hops", type=int, default=None,
                    help="trusted proxies in front that append to X-Forwarded-For, to find each visitor's address "
                         "(default: 1 on a Hugging Face Space, else 0)")
    ap.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="the most a visitor may ask for")
    ap.add_argument("--kv-budget-mib", type=int, default=d.kv_budget_mib, help="KV memory all sessions may reserve")
    ap.add_argument("--live-engine", action=argparse.BooleanOptionalAction, default=None,
                    help=f"the Live engine page, which fetches a vLLM, llama.cpp or SGLang server's metrics (default: "
                         f"${LIVE_ENGINE_ENV}, else on locally and off on a Hugging Face Space)")
    ap.add_argument("--watch-host", action="append", default=[], metavar="HOST",
                    help="a host beyond loopback whose metrics the Live engine page may fetch (repeat for more)")
    ap.add_argument("--pick-default", action=argparse.BooleanOptionalAction, default=None,
                    help=f"measure the default drafter and K on this CPU at start-up, once per CPU model (default: "
                         f"${PICK_DEFAULT_ENV}, else on)")
    a = ap.parse_args(argv)
    live = a.live_engine if a.live_engine is not None else live_engine_default(env)
    allow = a.allow_custom_models if a.allow_custom_models is not None else allow_custom_default(env)
    # A Space installs requirements.txt only, so SmolLM2's wheel is absent there; it has internet access, so
    # its default is SmolLM2 from the Hub (engine.sources resolves "smollm2" to the Hub id without the wheel)
    target = SMOLLM2 if a.target == AUTO and running_on_space(env) else a.target
    hops = a.proxy_hops if a.proxy_hops is not None else proxy_hops_default(env)
    return AppSettings(host=a.host, port=a.port, draft=a.draft, target=target, draft_device=a.draft_device,
                       target_device=a.target_device, share=a.share, allow_custom_models=allow,
                       allow_local_paths=a.allow_local_paths, config_timeout_s=a.hub_timeout,
                       load_timeout_s=a.load_timeout,
                       max_sessions=a.max_sessions, max_sessions_per_client=a.max_sessions_per_client,
                       session_ttl_s=a.idle_timeout, session_lease_s=a.session_lease, proxy_hops=hops,
                       max_new_tokens=a.max_new_tokens, kv_budget_mib=a.kv_budget_mib, live_engine=live,
                       watch_hosts=tuple(a.watch_host),
                       pick_default=a.pick_default if a.pick_default is not None else pick_default_on(env))


def main(argv: list[str]) -> None:
    settings = replace(parse_args(argv, dict(os.environ)), compute_threads=one_team(os.environ))   # torch not loaded
    from playground.serve import serve_forever

    serve_forever(settings)


if __name__ == "__main__":
    main(sys.argv[1:])

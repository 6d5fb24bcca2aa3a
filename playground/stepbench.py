"""`python -m playground.stepbench --tokens 64 256`: what one Step click costs the server.

Builds the app on the server's default pair (SmolLM2 and its EAGLE head where the wheel is installed, else
the built-in pair), presses Reset, then Step until the run ends, each time through
Gradio's own `Blocks.process_api`: preprocessing, the handler, and postprocessing of every output,
which is what the server does for a click before it sends the reply (the transport and the
browser's drawing are left out). Prints the first Step (the prefill round), the median and 95th
percentile per Step, and splits each
Step into the engine's share (the decode time the run's own clocks add: the speculative round and
the target-only rounds measured beside it) and the rest (rendering, the trace, Gradio).

--tab selects a tab of the playground first, by its select event as a click would, so that the
Steps render what that tab shows. An app without such events renders every tab on every Step.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import platform
import statistics
import sys
import time
from dataclasses import dataclass

import torch
from gradio.blocks import BlockFunction, Blocks
from gradio.state_holder import SessionState

from engine.clock import machine_name
from playground.sessions import Session, SessionPool

TABS = ("detail", "kv", "charts")


@dataclass(frozen=True, slots=True)
class StepTimes:
    """Seconds per Step over one run, in the order they were pressed, and the engine's share of each."""

    tokens: int
    tab: str
    seconds: tuple[float, ...]
    engine: tuple[float, ...]

    def line(self) -> str:
        rest = [s - e for s, e in zip(self.seconds, self.engine)]
        return (f"{self.tokens:4d} tokens · tab {self.tab:7s} · {len(self.seconds):3d} steps · "
                f"first {_ms(self.seconds[0])} · per Step: median "
                f"{_ms(statistics.median(self.seconds))}, p95 {_ms(p95(self.seconds))} · engine: median "
                f"{_ms(statistics.median(self.engine))} · the rest: median {_ms(statistics.median(rest))}, "
                f"p95 {_ms(p95(rest))}")


def p95(xs: tuple[float, ...] | list[float]) -> float:
    """Nearest-rank 95th percentile."""
    ordered = sorted(xs)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:6.1f} ms"


def _fn(demo: Blocks, api_name: str) -> BlockFunction | None:
    return next((f for f in demo.fns.values() if f.api_name == api_name), None)


def _inputs(fn: BlockFunction, tokens: int) -> list:
    """The inputs' values as a fresh page sends them, with Max new tokens set to `tokens`."""
    values = []
    for block in fn.inputs:
        if block.stateful:
            values.append(None)  # process_api reads gr.State from the session state
        elif getattr(block, "label", None) == "Max new tokens":
            values.append(tokens)
        else:
            values.append(block.value)
    return values


async def _press(demo: Blocks, fn: BlockFunction, state: SessionState, tokens: int) -> None:
    await demo.process_api(fn, _inputs(fn, tokens), state=state)


def _engine_s(session: Session) -> float:
    """Decode seconds the run's clocks have counted so far, speculative and target-only together."""
    run = session.run
    streams = [run.spec.rounds] + ([run.baseline.rounds] if run.baseline is not None else [])
    return sum(rounds[-1].elapsed_s for rounds in streams if rounds)


async def measure(demo: Blocks, pool: SessionPool, tokens: int, tab: str) -> StepTimes:
    """Reset, select `tab` (when the app has a select event for it), then Step to the end of the run."""
    state = SessionState(demo)
    await _press(demo, _fn(demo, "reset"), state, tokens)
    if (select := _fn(demo, f"show_{tab}")) is not None:
        await _press(demo, select, state, tokens)
    [session] = pool.sessions()
    step, seconds, engine = _fn(demo, "step"), [], []
    while not (session.run.finished and session.cursor.shown == len(session.run.spec.rounds)):
        clock, start = _engine_s(session), time.perf_counter()
        await _press(demo, step, state, tokens)
        seconds.append(time.perf_counter() - start)
        engine.append(_engine_s(session) - clock)
    return StepTimes(tokens, tab, tuple(seconds), tuple(engine))


def main(argv: list[str]) -> None:
    from playground.settings import AppSettings
    from playground.ui import build_app, make_context

    ap = argparse.ArgumentParser(description="Server-side time per Step click on the default pair.")
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 256], help="Max new tokens of each run")
    ap.add_argument("--tab", choices=TABS, nargs="+", default=list(TABS), help="the tab shown while stepping")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own)")
    a = ap.parse_args(argv)
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    ctx = make_context(AppSettings(max_new_tokens=max(a.tokens), max_sessions=1))
    demo = build_app(ctx)
    print(f"{machine_name()} · python {platform.python_version()} · "
          f"torch {torch.__version__}", flush=True)
    asyncio.run(measure(demo, ctx.pool, min(a.tokens), a.tab[0]))  # warm-up: loads the pair
    try:
        for tokens in a.tokens:
            for tab in a.tab:
                print(asyncio.run(measure(demo, ctx.pool, tokens, tab)).line(), flush=True)
    finally:
        ctx.pool.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])

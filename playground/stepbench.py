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

`--speedup N`: the speed-up a visitor reads against the engine's own sampled bench, on the same N held-out
chat prompts, settings and seeds, in one process. Per prompt, the app's path (Reset, then Run to end through
`process_api`, recorded and traced, with whatever the app runs beside it) gives the measured speed-up and
the predicted one the Charts show; then `engine.bench.sampled.measure` runs the same configuration on the
same prompt. Speed-ups are pooled over the prompts (tokens over busy seconds, as the sampled bench pools).
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass

# Run as a command, the threads are laid out as `python app.py` lays them out before torch loads: every thread
# computes with one OpenMP thread but the compute thread (playground.settings.one_team).
COMPUTE_THREADS: int | None = None
if __name__ == "__main__":
    from playground.settings import one_team

    COMPUTE_THREADS = one_team(os.environ)

import torch
from gradio.blocks import BlockFunction, Blocks
from gradio.state_holder import SessionState

from engine.clock import ComputeGate, machine_name, settle_heap
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


def _inputs(fn: BlockFunction, tokens: int, typed: dict[str, object] | None = None) -> list:
    """The inputs' values as a fresh page sends them, with Max new tokens set to `tokens` and each control
    labelled in `typed` set to its value there."""
    typed = {"Max new tokens": tokens, **(typed or {})}
    values = []
    for block in fn.inputs:
        if block.stateful:
            values.append(None)  # process_api reads gr.State from the session state
        else:
            values.append(typed.get(getattr(block, "label", None), block.value))
    return values


async def _press(demo: Blocks, fn: BlockFunction, state: SessionState, tokens: int,
                 typed: dict[str, object] | None = None) -> None:
    await demo.process_api(fn, _inputs(fn, tokens, typed), state=state)


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


@dataclass(frozen=True, slots=True)
class Speedups:
    """One prompt's speed-up as the app shows it (measured, and predicted from its α, c and r(n)) and as the
    engine's sampled bench measures it; tokens and busy seconds, so that prompts pool."""

    app_tokens: int
    app_s: float
    app_base_tokens: int
    app_base_s: float
    app_decode: float | None       # the page's speed-up after the prefill, which the prediction speaks of
    predicted: float | None
    bench_tokens: int
    bench_s: float
    bench_base_tokens: int
    bench_base_s: float


def pooled(rows: list[Speedups]) -> tuple[float, float, float | None, float | None]:
    """(app speed-up, bench speed-up, the predictions' mean, the app's speed-ups after the prefill, their mean) over
    `rows`, the first two tokens over seconds summed."""
    def rate(tokens: str, seconds: str) -> float:
        return sum(getattr(r, tokens) for r in rows) / sum(getattr(r, seconds) for r in rows)
    app = rate("app_tokens", "app_s") / rate("app_base_tokens", "app_base_s")
    bench = rate("bench_tokens", "bench_s") / rate("bench_base_tokens", "bench_base_s")
    def mean(xs: list[float | None]) -> float | None:
        xs = [x for x in xs if x is not None]
        return statistics.fmean(xs) if xs else None
    return app, bench, mean([r.predicted for r in rows]), mean([r.app_decode for r in rows])


async def speedups(demo: Blocks, pool: SessionPool, state: SessionState, gate: ComputeGate, prompt: str, seed: int,
                   tokens: int) -> Speedups:
    """Reset and Run to end on `prompt` through the app (one visitor's `state`), then the sampled bench on the
    same run's settings, holding the app's `gate` as the app's rounds do."""
    from engine import metrics
    from engine.bench.sampled import measure as bench_measure
    from engine.metrics import NotMeasured
    from engine.prompts import encode_chat

    typed = {"Prompt": prompt, "Seed": seed}
    await _press(demo, _fn(demo, "reset"), state, tokens, typed)
    await _press(demo, _fn(demo, "run_to_end"), state, tokens, typed)
    [session] = pool.sessions()
    view, run = session.view(), session.run
    spec, base = run.summaries()
    prediction = view.prediction()
    ids = encode_chat(run.pair.target.tokenizer, run.chat)
    bench = gate.run(lambda: bench_measure(run.pair, [ids], run.config))   # on the app's compute thread
    return Speedups(spec.tokens, spec.elapsed_s, base.tokens, base.elapsed_s,
                    metrics.decode_speedup(view.rounds, view.baseline),
                    None if isinstance(prediction, NotMeasured) else prediction.speedup_iid,
                    bench.tokens, bench.tokens / bench.tokens_per_s,
                    bench.tokens, bench.tokens / bench.baseline_tokens_per_s)


def speedup_main(count: int, tokens: int, threads: int | None = None) -> None:
    from engine.train.chat_prompts import chat_prompts
    from playground.settings import AppSettings
    from playground.ui import build_app, make_context

    ctx = make_context(AppSettings(max_new_tokens=tokens, max_sessions=1, compute_threads=threads))
    demo = build_app(ctx)
    state = SessionState(demo)
    print(f"{ctx.registry.gate.run(machine_name)} · python {platform.python_version()} · torch {torch.__version__}",
          flush=True)
    start, target = time.perf_counter(), ctx.registry.pair("default").target
    ctx.registry.gate.run(settle_heap)     # as a server's warm-up does (playground.serve._warm)
    while (curve := ctx.registry.calibration(target)) is None:   # as on a server up for a minute (serve._warm)
        time.sleep(0.2)
    print(f"r(n) of {target.name} measured in {time.perf_counter() - start:.1f} s: r(3) {curve.at(3):.2f}, "
          f"r(5) {curve.at(5):.2f}", flush=True)
    rows = []
    try:
        for i, prompt in enumerate(chat_prompts("heldout")[:count]):
            row = asyncio.run(speedups(demo, ctx.pool, state, ctx.registry.gate, prompt, i, tokens))
            rows.append(row)
            app, bench, predicted, decode = pooled([row])
            print(f"prompt {i + 1}/{count}: app {app:.2f}× (after the prefill {_x(decode)}, predicted "
                  f"{_x(predicted)}), bench {bench:.2f}×, "
                  f"app / bench {app / bench:.2f}; target-only {row.app_base_tokens / row.app_base_s:.1f} tok/s in "
                  f"the app, {row.bench_base_tokens / row.bench_base_s:.1f} in the bench", flush=True)
        app, bench, predicted, decode = pooled(rows)
        print(f"pooled over {len(rows)} prompts: app {app:.2f}×, after the prefill {_x(decode)} against predicted "
              f"{_x(predicted)} (measured / predicted {_ratio(decode, predicted)}), bench {bench:.2f}×, app / bench "
              f"{app / bench:.2f}", flush=True)
    finally:
        ctx.pool.shutdown()
        ctx.registry.close()


# In the page: each Step click's time (a listener on the button, before Gradio's own), and when the status line
# first shows each round and the round detail's plot first names it.
WATCH_STEPS = """() => {
  window.specplayClicks = []; window.specplayStatus = {}; window.specplayPlot = {};
  document.querySelector('#step-btn').addEventListener('click', () => window.specplayClicks.push(performance.now()),
                                                       true);
  const seen = () => {
    const now = performance.now(), status = document.querySelector('#status').innerText.match(/Round (\\d+) of/),
          plot = (document.querySelector('#detail-plot') || {innerText: ''}).innerText.match(/round (\\d+),/);
    if (status && !(status[1] in window.specplayStatus)) window.specplayStatus[status[1]] = now;
    if (plot && !(plot[1] in window.specplayPlot)) window.specplayPlot[plot[1]] = now;
  };
  new MutationObserver(seen).observe(document.body, {subtree: true, childList: true, characterData: true});
}"""


PAGE_WAIT_S = 300   # the longest the page may take to show a round (a first Step on a cold, slow machine)


def browser_main(steps: int, tokens: int, chromium: str, target: str = "auto", pause: float = 1.0,
                 threads: int | None = None, to_end: bool = False) -> int:
    """`--browser N`: the app served in this process on a free loopback port, as `python app.py` serves it, and
    headless Chromium on the same machine pressing Reset, then Step N times, `pause` seconds apart (a second: as
    a reader would);
    each Step timed in the page from the click to the status line showing the new round, and to the round
    detail's plot naming it. What a local visitor waits for, the browser's drawing included. `to_end`: Step until
    the run finishes, then also print the speed-up the page measured and predicted for it (`run_figures`)."""
    import socket
    from pathlib import Path

    from playground.serve import start
    from playground.settings import AppSettings
    from playground.ui import make_context

    try:
        from playwright.sync_api import TimeoutError as PlaywrightTimeout
        from playwright.sync_api import sync_playwright
    except ImportError:
        print("error: --browser needs Playwright: pip install -r requirements-dev.txt", file=sys.stderr)
        return 2
    if not Path(chromium).exists():
        print(f"error: --browser drives Chromium at {chromium}, which is missing (Debian: apt-get install chromium; "
              "or name another with --chromium)", file=sys.stderr)
        return 2
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    served = start(make_context(AppSettings(port=port, max_new_tokens=tokens, max_sessions=2, target=target,
                                            compute_threads=threads)), quiet=True)
    print(f"{served.ctx.registry.gate.run(machine_name)} · python {platform.python_version()} · "
          f"torch {torch.__version__} · {chromium}", flush=True)
    try:
        begun = time.perf_counter()
        if served.warming is not None:   # as on a server up for a minute: the pair loaded, r(n) and the pick done
            served.warming.join()
        served.ctx.registry.settle()
        print(f"the server's warm-up took {time.perf_counter() - begun:.1f} s", flush=True)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--headless", "--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            page.set_default_timeout(PAGE_WAIT_S * 1000)
            page.goto(served.url)
            page.wait_for_selector("#step-btn")
            page.click("#reset-btn")   # the page opens on a recorded example run: wait for this visitor's own
            page.wait_for_function("(s => s.includes('Round 0 of') && !s.includes('recorded in advance'))"
                                   "(document.querySelector('#status').innerText)")
            page.evaluate(WATCH_STEPS)
            done = 0
            for n in range(1, (MAX_STEPS if to_end else steps) + 1):
                time.sleep(pause)
                page.click("#step-btn")
                page.wait_for_function(f"(s => (s.match(/Round (\\d+) of/) || [0, 0])[1] >= {n} || "
                                       f"s.includes('finished') || s.includes('refused'))"
                                       f"(document.querySelector('#status').innerText)")
                if f"Round {n} of" not in page.locator("#status").inner_text():
                    break
                done = n
            time.sleep(0.5)
            clicks, status, plot = page.evaluate("[window.specplayClicks, window.specplayStatus, window.specplayPlot]")
            said = page.locator("#status").inner_text()
            figures = run_figures(served.ctx.pool.sessions()) if to_end and "finished" in said else None
            browser.close()
    except PlaywrightTimeout:
        print(f"error: the page did not show the next round within {PAGE_WAIT_S} s", file=sys.stderr)
        return 1
    finally:
        served.close()
    if done < steps and "finished" not in said:
        print(f"error: Step {done + 1} did not show its round; the status line reads: {said[:300]}", file=sys.stderr)
        return 1
    if to_end and figures is None:
        print(f"error: the run has no measured and predicted speed-up to read (not finished, nothing drafted, or "
              f"r(n) not measured); the status line reads: {said[:300]}", file=sys.stderr)
        return 1
    shown = [(status[str(n)] - clicks[n - 1]) / 1000 for n in range(1, done + 1) if str(n) in status]
    drawn = [(plot[str(n)] - clicks[n - 1]) / 1000 for n in range(1, done + 1) if str(n) in plot]
    if not shown:
        print("no Step showed its round", file=sys.stderr)
        return 1
    for what, xs in (("status line shows the round", shown), ("round detail plot names it", drawn)):
        if xs:
            later = xs[1:] or xs
            print(f"{len(xs)} Steps, click to {what}: first {_ms(xs[0])} · after it: median "
                  f"{_ms(statistics.median(later))}, p95 {_ms(p95(later))}, max {_ms(max(later))}", flush=True)
    if figures:
        print(figures, flush=True)
    return 0


MAX_STEPS = 1000          # --to-end's bound on Steps (a run of max_new_tokens rounds at most)
CATCH_UP_WAIT_S = 60      # how long --to-end waits for the page to ask for the last target-only rounds


def run_figures(sessions: list[Session]) -> str | None:
    """The finished live run's speed-up as its page reads it, once the page has had its target-only rounds caught
    up: measured, predicted (Leviathan's, from the run's α, c and the calibrated r(n)) and measured / predicted
    taken apart (metrics.PredictionGap); with the target step and the verify forward's median, ms. None without
    such a run."""
    from engine import metrics

    runs = [s for s in sessions if s.live and s.run.finished]
    if not runs:
        return None
    run = runs[0].run
    end = time.monotonic() + CATCH_UP_WAIT_S
    while run.behind and time.monotonic() < end:
        time.sleep(0.1)
    view = runs[0].view()
    curve = view.calibration.at if view.calibration else None
    measured = metrics.decode_speedup(view.rounds, view.baseline)
    predicted = metrics.Tally.of(view.rounds, view.baseline).speedup_iid(curve)
    gap = metrics.prediction_gap(view.rounds, view.baseline, curve)
    if measured is None or predicted is None or gap is None:
        return None
    verify = statistics.median(r.timings.target_forward_ms for r in metrics.decode_rounds(view.rounds) if r.k)
    return (f"the run in the page: {len(view.rounds)} rounds, measured after the prefill {measured:.2f}× · "
            f"predicted {predicted:.2f}× · measured / predicted {measured / predicted:.2f} = {gap.tokens:.2f} "
            f"tokens × {gap.verify:.2f} verify × {gap.rest:.2f} the rest · target step "
            f"{metrics.target_step_ms(view.baseline):.1f} ms, verify forward {verify:.1f} ms (medians)")


def _x(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}×"


def _ratio(a: float | None, b: float | None) -> str:
    return "—" if a is None or b is None else f"{a / b:.2f}"


def main(argv: list[str]) -> None:
    from playground.settings import AppSettings
    from playground.ui import build_app, make_context

    ap = argparse.ArgumentParser(description="Server-side time per Step click on the default pair.")
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 256], help="Max new tokens of each run")
    ap.add_argument("--tab", choices=TABS, nargs="+", default=list(TABS), help="the tab shown while stepping")
    ap.add_argument("--threads", type=int, default=None,
                    help="the compute thread's CPU threads (default: every core, as `python app.py`)")
    ap.add_argument("--speedup", type=int, default=0, metavar="N",
                    help="instead: the app's measured speed-up against the engine's sampled bench on N held-out "
                         "chat prompts (default settings, --tokens' first value)")
    ap.add_argument("--browser", type=int, default=0, metavar="N",
                    help="instead: N Steps in headless Chromium on this machine, each timed in the page from the "
                         "click to the new round on screen (--tokens' first value)")
    ap.add_argument("--chromium", default="/usr/bin/chromium", help="the Chromium --browser drives")
    ap.add_argument("--pause", type=float, default=1.0, help="seconds between Steps with --browser (default 1)")
    ap.add_argument("--to-end", action="store_true",
                    help="with --browser: Step until the run finishes, then print the speed-up the page measured "
                         "and predicted for it, taken apart")
    ap.add_argument("--target", default="auto", help="the default pair's target, e.g. builtin (default: the app's, "
                                                     "SmolLM2 where its wheel is installed; --speedup runs SmolLM2's)")
    a = ap.parse_args(argv)
    threads = a.threads or COMPUTE_THREADS   # the compute thread's; torch's own count where imported
    if a.browser:
        sys.exit(browser_main(a.browser, a.tokens[0], a.chromium, a.target, a.pause, threads, a.to_end))
    if a.speedup:
        speedup_main(a.speedup, a.tokens[0], threads)
        return
    ctx = make_context(AppSettings(max_new_tokens=max(a.tokens), max_sessions=1, target=a.target,
                                   compute_threads=threads))
    demo = build_app(ctx)
    print(f"{ctx.registry.gate.run(machine_name)} · python {platform.python_version()} · "
          f"torch {torch.__version__}", flush=True)
    asyncio.run(measure(demo, ctx.pool, min(a.tokens), a.tab[0]))  # warm-up: loads the pair
    ctx.registry.settle()   # r(n), measured in the background from the load on, takes turns with Steps until done
    try:
        for tokens in a.tokens:
            for tab in a.tab:
                print(asyncio.run(measure(demo, ctx.pool, tokens, tab)).line(), flush=True)
    finally:
        ctx.pool.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])

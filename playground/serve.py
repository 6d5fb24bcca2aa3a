"""Running the playground as a server: start-up, the session sweeper, and a shutdown that leaves nothing behind.

At start-up the session folders of servers that were killed (kill -9, a crash) are swept, the
default pair starts loading in the background, the app is launched with the heartbeat watch, and
a sweeper reclaims sessions that no connection renews. A clean stop (SIGTERM, Ctrl-C, or
`Served.close`) closes the app, every session and their folders.
"""
from __future__ import annotations

import gc
import logging
import os
import signal
import threading
from dataclasses import dataclass, field

import gradio as gr

from engine.clock import settle_heap
from engine.compared import ComparedRun
from engine.config import DrafterKind, SpecConfig
from engine.pick import PickStopped
from engine.prompts import ChatPrompt
from engine.sampling import SamplingParams
from engine.sources import bound_hub_requests
from playground.controller import Context
from playground.controls import default_drafter
from playground.sessions import Sweeper
from playground.settings import AppSettings
from playground.ui import build_app, launch_kwargs, make_context

log = logging.getLogger("specplay")
WARM_TOKENS = 16   # the start-up decode that builds the default drafter's kernels before a visitor's first run


@dataclass
class Served:
    """A running playground: its app, its shared objects and its sweeper. `close()` is safe to call twice."""

    demo: gr.Blocks
    ctx: Context
    sweeper: Sweeper
    url: str
    warming: threading.Thread | None = None
    stop_warming: threading.Event = field(default_factory=threading.Event)

    def close(self) -> None:
        """Stop serving, then wake every request still waiting for a model load (a hung Hub read), so
        that its session can be closed, then close the sessions. Bounded even with a hung load; the start-up
        decode stops before its next round (no thread may be inside torch when the interpreter exits)."""
        self.stop_warming.set()
        self.demo.close()
        self.sweeper.stop()
        self.ctx.registry.close(timeout=2.0)
        if self.warming is not None:
            self.warming.join(timeout=30.0)
        self.ctx.pool.shutdown()


def start(ctx: Context, *, quiet: bool = False, warm: bool = True) -> Served:
    """Launch the playground for `ctx` on its settings' host and port without blocking; see the module.
    With `warm`, the default pair starts loading at once, so the first visitor's Step does not wait."""
    swept = ctx.pool.sweep_abandoned()
    if swept:
        log.warning("removed %d session folder(s) left by a server that did not shut down: %s", len(swept),
                    ", ".join(str(p) for p in swept))
    s = ctx.settings
    if s.pick_default:   # a pick kept for this CPU is in the page from the start (measuring one waits for the model)
        ctx.registry.kept_pick(ctx.registry.presets[0].key)
    stop_warming, warming = threading.Event(), None
    if warm:
        warming = threading.Thread(target=_warm, args=(ctx, stop_warming), name="specplay-warm-up", daemon=True)
        warming.start()
    demo = build_app(ctx)
    demo.launch(server_name=s.host, server_port=s.port, share=s.share, prevent_thread_lock=True, quiet=quiet,
                **launch_kwargs(ctx))
    sweeper = Sweeper(ctx.pool, interval=min(10.0, s.session_lease_s / 4)).start()
    return Served(demo, ctx, sweeper, demo.local_url or f"http://{s.host}:{s.port}/", warming, stop_warming)


def _warm(ctx: Context, stop: threading.Event) -> None:
    """Load the default pair, start measuring its target's r(n), pick its drafter and K on this CPU (with
    `pick_default`: engine.pick, kept per CPU model, so measured once), and decode a few rounds of its recommended
    settings, so that the first visitor's run is timed like every later one: a process's first rounds of a
    drafter build their kernels (on SmolLM2 the first run after start-up measured 0.98x where the next measured
    1.20x). The measurement and the warm-up take turns with visitors' rounds (ModelRegistry.gate); `stop` ends
    the warm-up before its next round."""
    try:
        pair = ctx.registry.pair("default")
    except Exception as exc:  # the first Reset will say the same to the visitor
        log.warning("could not load the default pair at start-up: %s", exc)
        return
    # The app and its default pair live as long as the server: kept out of every later full collection, which
    # would otherwise scan them inside some visitor's timed round (custom models are not: they may be evicted)
    ctx.registry.gate.run(settle_heap)
    ctx.registry.calibration(pair.target)
    preset = ctx.registry.presets[0]
    if ctx.settings.pick_default:
        try:
            pick = ctx.registry.measure_pick(preset.key, pair, stop)
            log.info("default drafter and K for this CPU: %s", pick.explain())
        except PickStopped:
            return
        except Exception as exc:  # the presets' own defaults stay
            log.warning("measuring the default drafter on this CPU failed: %s", exc)
    rec, text = ctx.registry.recommended(preset), (preset.examples or ("Hello",))[0]
    try:
        config = SpecConfig(drafter=DrafterKind(default_drafter(preset, rec)), k=rec.k, max_new_tokens=WARM_TOKENS,
                            sampling=SamplingParams(rec.temperature, 0, rec.top_p))
        gate = ctx.registry.gate
        run = gate.run(lambda: ComparedRun(pair, ChatPrompt(text) if preset.chat else text, config))
        try:
            while not run.finished and not stop.is_set():
                gate.run(lambda: None if stop.is_set() else run.step())
        finally:
            run.close()
    except Exception as exc:  # a warm-up that fails leaves the first run slower, nothing else
        log.warning("the warm-up decode failed: %s", exc)


def serve_forever(settings: AppSettings) -> None:
    """`python app.py`: serve until SIGTERM or SIGINT, then shut down cleanly. The playground's own log (one
    line per refused input, sessions reclaimed, shutdown) goes to stderr."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s specplay %(levelname)s: %(message)s", "%H:%M:%S"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    bound_hub_requests(settings.config_timeout_s)   # a hung Hub read ends, and its load thread with it
    ctx = make_context(settings)
    # Gradio keeps uploads (and its multipart scratch files) in GRADIO_TEMP_DIR, read when the app is made:
    # inside the pool's folder they go with it at shutdown, and a killed server's are swept with its sessions
    os.environ["GRADIO_TEMP_DIR"] = str(ctx.pool.root / "uploads")
    served = start(ctx)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda signum, frame: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not stop.wait(1.0):   # a timed wait lets the signal handler run promptly
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        log.info("shutting down: closing %d session(s)", len(served.ctx.pool))
        served.close()
        # Everything is closed: what the interpreter still collects on its way out (torch's, transformers' and
        # Gradio's object graphs) it need not scan, which took it 1.5-2 s after every stop
        gc.freeze()

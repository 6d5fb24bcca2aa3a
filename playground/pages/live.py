"""The Live engine tab: a real vLLM, llama.cpp or SGLang server's speculative-decoding metrics, polled and drawn over
time next to Leviathan's prediction, a specplay run of the same K beside them, and an audit of the server's
sampling (engine.audit): is it lossless?

The server fetches the URL, so only the addresses the operator allows are fetched (engine.watch: loopback
unless `--watch-host` names more), each fetch bounded in time and size, in its own queue so that a slow
endpoint never holds up anybody's Step; on a Space the page is off unless the operator turns it on. The
visitor's watch (a `engine.watch.Watcher`) lives in the page's gr.State: nothing is shared.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import gradio as gr

from engine import metrics
from engine.audit.client import AuditError, Endpoint, Stop
from engine.audit.exact import ExactError, exact_joint, floor_for
from engine.audit.run import DEFAULT_PROMPT as AUDIT_PROMPT
from engine.audit.run import AuditPlan, audit_exact, audit_reference
from engine.compared import ComparedRun
from engine.config import DrafterKind, SpecConfig
from engine.models import ModelLoadError
from engine.prompts import ChatPrompt, PromptError, encode_prompt
from engine.sampling import SamplingParams
from engine.watch import Watcher, WatchError
from playground.controller import Context
from playground.inputs import as_optional_number
from playground.render import audit as render_audit
from playground.render import live as render

DEFAULT_URL = "http://127.0.0.1:8000/metrics"
AUDIT_MAX_SAMPLES = 5000
AUDIT_TIME_LIMIT_S = 300.0
REFERENCE = "reference"
SIDE_TOKENS = 64
DRAFTERS = (("prompt lookup (as vLLM's ngram)", DrafterKind.NGRAM.value), ("EAGLE head", DrafterKind.EAGLE.value),
            ("EAGLE + prompt lookup", DrafterKind.EAGLE_HYBRID.value), ("draft model", DrafterKind.MODEL.value))


@dataclass
class LiveState:
    """One visitor's watch and specplay's run beside it."""

    watcher: Watcher | None = None
    side: render.SideRun | None = None
    error: str | None = None     # the last reading's failure, shown until a reading succeeds


@dataclass(frozen=True)
class LivePage:
    url: gr.Textbox
    interval: gr.Number
    watch: gr.Button
    stop: gr.Button
    model: gr.Dropdown
    c: gr.Textbox
    r: gr.Textbox
    summary: gr.Markdown
    acceptance: gr.Plot
    per_position: gr.Plot
    throughput: gr.Plot
    prediction: gr.Plot
    prompt: gr.Textbox
    drafter: gr.Dropdown
    run: gr.Button
    timer: gr.Timer
    state: gr.State
    audit: "AuditControls"

    def figures(self) -> list:
        return [self.summary, self.model, self.acceptance, self.per_position, self.throughput, self.prediction]


@dataclass(frozen=True)
class AuditControls:
    url: gr.Textbox
    against: gr.Dropdown
    reference: gr.Textbox
    prompt: gr.Textbox
    temperature: gr.Number
    top_k: gr.Number
    top_p: gr.Number
    tokens: gr.Number
    samples: gr.Number
    start: gr.Button
    stop: gr.Button
    verdict: gr.Markdown
    counts: gr.Plot

    def inputs(self) -> list:
        return [self.url, self.against, self.reference, self.prompt, self.temperature, self.top_k, self.top_p,
                self.tokens, self.samples]


NOT_MEASURED = "not measured: run beside it below"


def render_all(live: LiveState, model: str | None, c: object, r: object) -> tuple:
    """(summary, model picker, four figures) for the visitor's watch; `c` and `r` as their boxes hold them."""
    w = live.watcher
    models = w.models if w is not None else []
    model = model if model in models else (models[0] if models else None)
    points = w.points.get(model, []) if w is not None and model else []
    total = w.total(model) if w is not None and model else None
    summary = render.summary_markdown(w, model, live.side)
    if live.error:
        summary = f"**The last reading failed:** {live.error}\n\n{summary}"
    return (summary, gr.Dropdown(choices=models, value=model), render.acceptance_over_time(points),
            render.per_position(total, live.side), render.throughput_over_time(points),
            render.prediction(total, as_optional_number(c), as_optional_number(r)))


class LiveHandlers:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self._audits: dict[str, Stop] = {}    # a running audit's stop flag, by the visitor's session

    @property
    def allowed(self) -> tuple[str, ...]:
        return tuple(self.ctx.settings.watch_hosts)

    def start(self, live: LiveState | None, url: str, seconds: float, model, c, r) -> tuple:
        live = live or LiveState()
        try:
            seconds = float(seconds)
            if not 0.5 <= seconds <= 600:
                raise WatchError("the interval must be from 0.5 to 600 seconds")
            watcher = Watcher((url or "").strip(), self.allowed, flag="python app.py --watch-host")
            watcher.poll()
        except WatchError as exc:
            gr.Warning(str(exc))
            live = replace(live, error=str(exc))
            return (live, gr.Timer(active=False), *render_all(live, model, c, r))
        live = replace(live, watcher=watcher, error=None)
        return (live, gr.Timer(value=seconds, active=True), *render_all(live, model, c, r))

    def tick(self, live: LiveState | None, model, c, r) -> tuple:
        if live is None or live.watcher is None:
            return (live, gr.Timer(active=False), *render_all(live or LiveState(), model, c, r))
        try:
            live.watcher.poll()
            live.error = None
        except WatchError as exc:   # a server restarting or busy: keep watching, say so
            live.error = str(exc)
        return (live, gr.skip(), *render_all(live, model, c, r))

    def stop(self, live: LiveState | None, model, c, r) -> tuple:
        return (live, gr.Timer(active=False), *render_all(live or LiveState(), model, c, r))

    def redraw(self, live: LiveState | None, model, c, r) -> tuple:
        return render_all(live or LiveState(), model, c, r)

    def run_beside(self, live: LiveState | None, prompt: str, drafter: str, model, c, r) -> tuple:
        """specplay on the server's default pair with the watched model's K, greedy, SIDE_TOKENS tokens;
        its measured c and r fill the prediction's inputs."""
        live = live or LiveState()
        w = live.watcher
        total = w.total(model if model in (w.models if w else []) else (w.models[0] if w and w.models else ""))\
            if w is not None else None
        if total is None or not total.position_rates:
            gr.Warning("Watch a server first: the run takes its K from the server's per-position counters.")
            return (live, gr.skip(), gr.skip(), *render_all(live, model, c, r))
        k = len(total.position_rates)
        preset = self.ctx.registry.presets[0]
        try:
            pair = self.ctx.registry.pair(preset.key)
            kind = DrafterKind(drafter)
            if kind.uses_model and pair.draft is None or kind.uses_eagle and pair.eagle is None:
                raise ValueError(f"{preset.label} has no {'draft model' if kind.uses_model else 'EAGLE head'}: "
                                 "pick another drafter")
            config = SpecConfig(drafter=kind, k=k, sampling=SamplingParams(temperature=0.0), seed=0,
                                max_new_tokens=SIDE_TOKENS)
            text = ChatPrompt(prompt) if preset.chat else prompt
            def side_run() -> tuple[list, list]:
                run = ComparedRun(pair, text, config)
                try:
                    done = run.run_to_end()
                    return done, run.baseline.rounds if run.baseline is not None else []
                finally:
                    run.close()
            rounds, baseline = self.ctx.registry.gate.run(side_run)   # on the compute thread, in turn
        except (ModelLoadError, PromptError, ValueError) as exc:
            gr.Warning(str(exc))
            return (live, gr.skip(), gr.skip(), *render_all(live, model, c, r))
        side = render.SideRun(f"specplay ({preset.target}, {kind.value})", k,
                              tuple(metrics.accepted_at_positions(rounds, k)), metrics.tokens_per_round(rounds),
                              metrics.cost_ratio(rounds, baseline), metrics.verify_ratio(rounds, baseline))
        live = replace(live, side=side)
        c = f"{side.c:.4f}" if side.c is not None else c
        r = f"{side.r:.3f}" if side.r is not None else r
        return (live, c, r, *render_all(live, model, c, r))


    # -- the audit ------------------------------------------------------------------------------------------
    def audit(self, url: str, against: str, reference: str, prompt: str, temperature, top_k, top_p, tokens,
              samples, request: gr.Request, progress=gr.Progress()) -> tuple:
        """Audit the server at `url` against the exact distribution of a target loaded here, or against a
        reference server; one audit per visitor at a time, stopped by `stop_audit`."""
        key = request.session_hash if request is not None else ""
        if key in self._audits:
            gr.Warning("An audit is already running on this page: stop it first.")
            return gr.skip(), gr.skip()
        stop = self._audits[key] = Stop()
        try:
            report = self._audit(url, against, reference, prompt, temperature, top_k, top_p, tokens, samples, stop,
                                 progress)
        except (AuditError, ExactError, ModelLoadError, PromptError, ValueError) as exc:
            gr.Warning(str(exc))
            return f"**The audit could not run:** {exc}", gr.skip()
        finally:
            self._audits.pop(key, None)
        return render_audit.verdict_markdown(report), render_audit.counts_figure(report)

    def _audit(self, url, against, reference, prompt, temperature, top_k, top_p, tokens, samples, stop, progress):
        samples = int(samples or 0)
        if not 50 <= samples <= AUDIT_MAX_SAMPLES:
            raise ValueError(f"samples must be from 50 to {AUDIT_MAX_SAMPLES} here (the command line takes more)")
        params = SamplingParams(float(temperature or 0), int(top_k or 0), float(top_p or 1.0))
        plan = AuditPlan(int(tokens or 0), samples, params, time_limit_s=AUDIT_TIME_LIMIT_S)
        endpoint = Endpoint.of((url or "").strip(), allowed=self.allowed, flag="python app.py --watch-host")

        def report(name: str, done: int, total: int) -> None:
            progress((done, total), desc=f"{name}: {done} of {total} completions", unit="completions")

        if against == REFERENCE:
            ref = Endpoint.of((reference or "").strip(), allowed=self.allowed, flag="python app.py --watch-host")
            return audit_reference(endpoint, ref, prompt, str, plan, report, stop)
        preset = next((p for p in self.ctx.registry.presets if p.target == against), None)
        if preset is None:
            raise ValueError(f"no model {against!r} on this server")
        target = self.ctx.registry.pair(preset.key).target
        tok = target.tokenizer
        ids = encode_prompt(tok, prompt)   # as a completions API takes it: the text itself, no chat template
        progress(0.0, desc="computing the exact distribution")
        joint = self.ctx.registry.gate.run(lambda: exact_joint(target, ids, plan.m, params,
                                                                min_prob=floor_for(samples)))
        return audit_exact(endpoint, ids, joint, preset.target, tok.decode, plan, report, stop)

    def stop_audit(self, request: gr.Request) -> None:
        stop = self._audits.get(request.session_hash if request is not None else "")
        if stop is not None:
            stop.set()
            gr.Info("Stopping the audit after the requests in flight.")


def build(ctx: Context) -> LivePage | None:
    """Lay the tab out in the current Blocks context and wire it; None (and a sentence) when it is off."""
    if not ctx.settings.live_engine:
        gr.Markdown("The Live engine page is **off on this server**: it makes the server fetch a URL, which on a "
                    "public server any visitor could point anywhere. Its operator can turn it on with "
                    "`python app.py --live-engine` (or `SPECPLAY_LIVE_ENGINE=1`), and allow hosts beyond "
                    "loopback with `--watch-host HOST`.")
        return None
    hosts = ", ".join(ctx.settings.watch_hosts) or "none"
    gr.Markdown("### Watch a real engine\nPoint this at a vLLM, llama.cpp or SGLang server's Prometheus `/metrics` "
                "with speculative decoding on (vLLM: `--speculative-config`; llama.cpp's `llama-server`: `--metrics` "
                "and `--spec-type` or a draft model `-md`; SGLang: `--speculative-algorithm`). "
                f"Only loopback addresses are fetched, and these other hosts: {hosts}.")
    with gr.Row():
        url = gr.Textbox(DEFAULT_URL, label="metrics URL", scale=3, elem_id="live-url")
        interval = gr.Number(5, label="seconds between readings", minimum=0.5, maximum=600, scale=1,
                             elem_id="live-interval")
        watch = gr.Button("Watch", variant="primary", scale=1, elem_id="live-watch")
        stop = gr.Button("Stop", scale=1, elem_id="live-stop")
    with gr.Row():
        model = gr.Dropdown([], label="model", scale=2, elem_id="live-model", allow_custom_value=True)
        # text boxes: a number box shows 0 while it is empty, which reads as a measured c of 0
        c = gr.Textbox("", label="c: a draft forward / a target step", placeholder=NOT_MEASURED, scale=1,
                       elem_id="live-c")
        r = gr.Textbox("", label="r: the verify forward / a target step", placeholder=NOT_MEASURED, scale=1,
                       elem_id="live-r")
    summary = gr.Markdown(render.summary_markdown(None, None, None), elem_id="live-summary")
    idle = render.idle_figures()
    with gr.Row():
        acceptance = gr.Plot(idle[0], show_label=False, elem_id="live-acceptance")
        per_position = gr.Plot(idle[1], show_label=False, elem_id="live-per-position")
    with gr.Row():
        throughput = gr.Plot(idle[2], show_label=False, elem_id="live-throughput")
        prediction = gr.Plot(idle[3], show_label=False, elem_id="live-prediction")
    gr.Markdown(f"#### specplay beside it\nRuns this server's default pair here, greedy, {SIDE_TOKENS} tokens, with "
                "the watched model's K, and draws its per-position rates beside the server's (both counted as vLLM "
                "counts them: accepted at position i over drafts). Its measured c and r fill the prediction.")
    with gr.Row():
        prompt = gr.Textbox("Why is the sky blue?", label="prompt", scale=3, elem_id="live-prompt")
        drafter = gr.Dropdown(DRAFTERS, value=DrafterKind.NGRAM.value, label="drafter", scale=1, elem_id="live-drafter")
        run = gr.Button("Run specplay with the same K", scale=1, elem_id="live-run")
    audit = _build_audit(ctx)
    timer = gr.Timer(5, active=False)
    state = gr.State(None)
    page = LivePage(url, interval, watch, stop, model, c, r, summary, acceptance, per_position, throughput,
                    prediction, prompt, drafter, run, timer, state, audit)
    _wire(page, LiveHandlers(ctx))
    return page


def _build_audit(ctx: Context) -> AuditControls:
    targets = list(dict.fromkeys(p.target for p in ctx.registry.presets))
    gr.Markdown("### Audit its sampling\nIs the server's speculative sampling lossless? The audit asks for many "
                "completions of the first few tokens at a temperature above 0 and tests them (chi-square) against "
                "the exact distribution computed here from the same weights, or against the same model served "
                "without speculation. The exact test needs the server to serve exactly the weights named (a "
                "quantized or differently converted copy samples another distribution); otherwise give a reference "
                "server. The losslessness lab (Lesson tab) shows the same test on one round. "
                "`python -m engine audit URL` runs it from a terminal. vLLM 0.32's CPU build stops its engine on a "
                "top-k request with speculation on: set top-k 0 there (docs/audit.md).")
    with gr.Row():
        url = gr.Textbox("http://127.0.0.1:8000", label="server (OpenAI-compatible completions)", scale=3,
                         elem_id="audit-url")
        against = gr.Dropdown([(f"exact: {t} (its weights here)", t) for t in targets]
                              + [("another server, without speculation", REFERENCE)], value=targets[0],
                              label="test against", scale=2, elem_id="audit-against")
        reference = gr.Textbox("", label="reference server (when testing against one)", scale=2,
                               elem_id="audit-reference")
    with gr.Row():
        prompt = gr.Textbox(AUDIT_PROMPT, label="prompt (a repeating one lets prompt lookup draft)", scale=3,
                            elem_id="audit-prompt")
        temperature = gr.Number(1.0, label="temperature", minimum=0.05, maximum=5, scale=1, elem_id="audit-t")
        top_k = gr.Number(8, label="top-k (0 off)", minimum=0, precision=0, scale=1, elem_id="audit-top-k")
        top_p = gr.Number(1.0, label="top-p", minimum=0.01, maximum=1, scale=1, elem_id="audit-top-p")
        tokens = gr.Number(3, label="tokens tested", minimum=1, maximum=4, precision=0, scale=1, elem_id="audit-m")
        samples = gr.Number(1000, label="completions", minimum=50, maximum=AUDIT_MAX_SAMPLES, precision=0, scale=1,
                            elem_id="audit-samples")
    with gr.Row():
        start = gr.Button("Audit", variant="primary", elem_id="audit-start")
        stop = gr.Button("Stop the audit", elem_id="audit-stop")
    verdict = gr.Markdown(render_audit.verdict_markdown(None), elem_id="audit-verdict")
    counts = gr.Plot(render_audit.counts_figure(None), show_label=False, elem_id="audit-counts")
    return AuditControls(url, against, reference, prompt, temperature, top_k, top_p, tokens, samples, start, stop,
                         verdict, counts)


def _wire(page: LivePage, h: LiveHandlers) -> None:
    # Fetches wait on the network, not the CPU: their own queue, never the decoding one.
    fetching = dict(api_name=False, concurrency_id="live-fetch", concurrency_limit=8)
    figures = page.figures()
    inputs = [page.model, page.c, page.r]
    page.watch.click(h.start, [page.state, page.url, page.interval, *inputs], [page.state, page.timer, *figures],
                     **fetching)
    page.timer.tick(h.tick, [page.state, *inputs], [page.state, page.timer, *figures], **fetching)
    page.stop.click(h.stop, [page.state, *inputs], [page.state, page.timer, *figures], api_name=False)
    for box in inputs:
        box.input(h.redraw, [page.state, *inputs], figures, api_name=False)
    a = page.audit
    a.start.click(h.audit, a.inputs(), [a.verdict, a.counts], api_name=False, concurrency_id="live-audit",
                  concurrency_limit=4)
    a.stop.click(h.stop_audit, None, None, api_name=False, queue=False)
    page.run.click(h.run_beside, [page.state, page.prompt, page.drafter, *inputs],
                   [page.state, page.c, page.r, *figures], api_name=False, concurrency_id="live-run",
                   concurrency_limit=1)

"""What the buttons do to a session: reset, step, reveal, step back, scrub, run to end, load a trace.

No Gradio here: each action takes a session and validated inputs and changes the session's run
or cursor. Bad input raises an exception whose message is meant for the user (see USER_ERRORS).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import TypeVar

from engine.block_manager import KVPoolExhausted
from engine.compared import ComparedRun, kv_bytes_needed
from engine.config import K_BOUND, DrafterKind, KSchedule, Mode, SpecConfig, TreeSpec
from engine.models import ModelLoadError
from engine.pair import ModelPair
from engine.prompts import ChatPrompt, PromptError, encode_chat, encode_prompt, has_chat_template
from engine.sampling import SamplingParams
from engine.text import StreamDecoder
from engine.trace import TraceError, load_trace
from playground.inputs import as_float, as_int, as_seed, as_text
from playground.registry import ModelRegistry
from playground.render.tokens import chip_text
from playground.sessions import Session, SessionBusy, SessionLimitReached, SessionPool
from playground.settings import AppSettings
from playground.teach.lesson import RoundRows, round_context, round_rows
from playground.view import Cursor, Panel, RunView, info_for_run, view_from_trace

E = TypeVar("E", bound=Enum)
MAX_MODEL_ID_CHARS = 512   # a Hub id or a local path

# Everything a visitor can cause by typing or uploading: shown as a message, never a traceback.
USER_ERRORS = (ValueError, ModelLoadError, KVPoolExhausted, SessionLimitReached, SessionBusy)  # PromptError, TraceError: ValueErrors


@dataclass(frozen=True, slots=True)
class Context:
    """What every action may use: the shared models, the session pool and the server's limits."""

    registry: ModelRegistry
    pool: SessionPool
    settings: AppSettings


class PromptAs(str, Enum):
    CHAT = "chat"   # a user message, through the target's chat template
    RAW = "raw"     # text the target continues


CHAT, RAW = PromptAs.CHAT.value, PromptAs.RAW.value


@dataclass(frozen=True, slots=True)
class DecodeRequest:
    """The controls' values, as the UI sends them."""

    prompt: str
    preset: str
    custom_draft: str
    custom_target: str
    mode: str
    drafter: str
    k: float
    k_schedule: str
    k_min: float
    k_max: float
    temperature: float
    top_k: float
    top_p: float
    seed: float
    max_new_tokens: float
    prompt_as: str = RAW      # CHAT: the prompt is a user message for the target's chat template
    system: str = ""          # with CHAT: a system prompt ("" = the template's own)
    tree: str = ""            # "" drafts a chain of K; "4-2-2-1" (widths per depth) or "N16d4" a tree

    def config(self, max_new_tokens_cap: int) -> SpecConfig:
        """The validated SpecConfig; raises ValueError with a message for the user that names the field and
        the values it allows. The same checks apply to the UI and the API (both send these values)."""
        sampling = SamplingParams(
            temperature=as_float("Temperature", self.temperature, "a finite number of at least 0 (0 = greedy)"),
            top_k=as_int("Top-k", self.top_k, 0), top_p=as_float("Top-p", self.top_p, "a number in (0, 1]"))
        tree = as_text("Tree", self.tree, 40).strip()
        try:
            shape = TreeSpec.parse(tree) if tree else None
        except ValueError as exc:
            raise ValueError(f"Tree: {exc} (leave it empty to draft a chain of K).") from None
        return SpecConfig(mode=_choice("Mode", Mode, self.mode), drafter=_choice("Drafter", DrafterKind, self.drafter),
                          tree=shape,
                          k=as_int("K", self.k, 1, K_BOUND),
                          k_schedule=_choice("K schedule", KSchedule, self.k_schedule),
                          k_min=as_int("K min", self.k_min, 1, K_BOUND), k_max=as_int("K max", self.k_max, 1, K_BOUND),
                          sampling=sampling, seed=as_seed(self.seed),
                          max_new_tokens=as_int("Max new tokens", self.max_new_tokens, 1, max_new_tokens_cap))

    def prompt_text(self, max_chars: int) -> str:
        return as_text("The prompt", self.prompt, max_chars)

    def prompt_for(self, tokenizer, max_chars: int) -> str | ChatPrompt:
        """The prompt as the run takes it: raw text, or a chat turn when asked for (and the target has a
        chat template)."""
        text = self.prompt_text(max_chars)
        mode = _choice("Prompt as", PromptAs, self.prompt_as)
        if mode is PromptAs.RAW:
            return text
        if not has_chat_template(tokenizer):
            raise PromptError("This target has no chat template: set “Prompt as” to raw text.")
        return ChatPrompt(text, as_text("The system prompt", self.system, max_chars) or None)


def _choice(name: str, kind: type[E], value: object) -> E:
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{name} must be one of {', '.join(e.value for e in kind)}, got {value!r}.") from None


PREVIOUS_RUN = ("This is the previous run, kept so you can look back at it: the last Reset failed, so it was made "
                "with settings other than the ones shown and Step will not continue it. Fix the settings and press "
                "Reset.")


def reset(ctx: Context, session: Session, req: DecodeRequest, load: bool = True) -> None:
    """Start a fresh run with the current settings (loading the pair if needed, or with load=False only
    if it is the server's default pair: see ModelRegistry.pair), recording its trace.

    A Reset that fails, whatever the reason, leaves one state: what was shown before stays visible as the
    previous run (Session.keep_as_previous), and the error is raised for the visitor to read.
    """
    shown, cursor = session.view(), session.cursor
    try:
        _start_run(ctx, session, req, load)
    except Exception as exc:
        session.keep_as_previous(shown, cursor, _first_sentence(exc))
        raise


def _start_run(ctx: Context, session: Session, req: DecodeRequest, load: bool) -> None:
    config = req.config(ctx.settings.max_new_tokens)
    req.prompt_text(ctx.settings.max_prompt_chars)   # a bad prompt is refused before any pair loads
    ids = (as_text(name, value, MAX_MODEL_ID_CHARS) for name, value in
           (("Custom draft", req.custom_draft), ("Custom target", req.custom_target)))
    pair = ctx.registry.pair(req.preset, *ids, load=load)
    _check_drafter(pair, config)
    prompt = req.prompt_for(pair.target.tokenizer, ctx.settings.max_prompt_chars)
    prompt_ids = encode_chat(pair.target.tokenizer, prompt) if isinstance(prompt, ChatPrompt) else \
        encode_prompt(pair.target.tokenizer, prompt)
    session.drop_run()
    ctx.pool.reserve_kv(session, kv_bytes_needed(pair, len(prompt_ids), config))
    trace = session.new_trace_path()
    try:
        session.run = ctx.registry.gate.run(lambda: ComparedRun(pair, prompt, config, trace_path=trace))   # its prefill
    except BaseException:
        session.kv_bytes = 0
        trace.unlink(missing_ok=True)
        raise
    session.use_trace(trace)
    session.info = info_for_run(session.run, pair.target, pair.draft)
    attach_calibration(ctx, session)


def attach_calibration(ctx: Context, session: Session) -> None:
    """Give the live run its target's measured r(n) once the background calibration has it (traced too)."""
    if session.live:
        curve = ctx.registry.calibration(session.run.pair.target)
        if curve is not None and curve is not session.run.calibration:
            session.run.set_calibration(curve)


def remeasure(ctx: Context, session: Session) -> str:
    """Start a fresh calibration of the live run's target; the next refresh shows it."""
    if not session.live:
        raise ValueError("r(n) is measured on a loaded target: start a live run first (a replay keeps its trace's).")
    ctx.registry.calibration(session.run.pair.target, again=True)
    return "Measuring r(n) again in the background: press Update in a few seconds."


def theory_view(ctx: Context, session: Session) -> RunView | None:
    """The run for the Theory tab: its verified rounds, with the newest calibration attached."""
    attach_calibration(ctx, session)
    return verified_view(session)


def _check_drafter(pair: ModelPair, config: SpecConfig) -> None:
    """The drafter must be one this pair can run: a clear sentence instead of the engine's own error."""
    if config.uses_draft_model and pair.draft is None:
        raise ValueError("This pair has no draft model: pick the n-gram drafter, or the EAGLE head where the pair "
                         "has one.")
    if config.uses_eagle and pair.eagle is None:
        raise ValueError("This pair has no EAGLE head (train one with `python -m engine train-draft`): pick another "
                         "drafter.")


def _first_sentence(exc: Exception) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 200 else text[:199] + "…"


def _refuse_previous(session: Session) -> None:
    if session.previous is not None:
        raise ValueError(PREVIOUS_RUN)


def _advance(session: Session, reveal: bool) -> None:
    c = session.cursor
    session.cursor = Cursor(shown=c.shown + 1, revealed=not reveal)


def step(ctx: Context, session: Session, req: DecodeRequest, reveal: bool = False,
         catch_up: bool = True) -> str | None:
    """One click of Step: reveal a pending round, replay a round already run, or run a new one.

    With `reveal`, a new round first shows its drafts as pending and the next Step reveals the
    verification. Without `catch_up`, the target-only baseline is left a round behind for `catch_up()`.
    Returns a note for the user when there is nothing left to do.
    """
    _refuse_previous(session)
    if session.view() is None:
        reset(ctx, session, req, load=False)
    c, view = session.cursor, session.view()
    if not c.revealed:
        session.cursor = replace(c, revealed=True)
    elif c.shown < len(view.rounds):
        _advance(session, reveal)
    elif session.live and not session.run.finished:
        ctx.registry.gate.run(lambda: session.run.step(catch_up=catch_up))
        _advance(session, reveal)
        attach_calibration(ctx, session)
    else:
        return "The run is finished: press Reset to decode again." if session.live else "End of the trace."
    return None


def catch_up(ctx: Context, session: Session) -> bool:
    """Bring a live run's target-only baseline level with its speculative run (after a Step that left it
    behind); False when there was nothing to do."""
    run = session.run if session.live else None
    if run is None or not run.behind:
        return False
    ctx.registry.gate.run(run.catch_up)
    return True


def run_to_end(ctx: Context, session: Session, req: DecodeRequest,
               progress: Callable[[int, int], None] = lambda done, total: None) -> None:
    """Decode (or replay) every remaining round; progress(tokens, max_new_tokens) after each."""
    _refuse_previous(session)
    if session.view() is None:
        reset(ctx, session, req, load=False)
    if session.live:
        run, total = session.run, session.run.config.max_new_tokens
        while not run.finished:
            ctx.registry.gate.run(run.step)   # a round at a time: a calibration waiting goes between two
            progress(len(run.spec.generated), total)
        attach_calibration(ctx, session)
    session.cursor = Cursor(shown=len(session.view().rounds))


def back(session: Session) -> None:
    c = session.cursor
    session.cursor = Cursor(shown=max(0, c.shown - (1 if c.revealed else 0)), revealed=True)


def scrub(session: Session, shown: float) -> None:
    view = session.view()
    total = len(view.rounds) if view else 0
    session.cursor = Cursor(shown=max(0, min(total, as_int("Round", shown))))


def select(session: Session, round_index: int | None, position: int | None) -> None:
    """Pick a token for the detail plots (a chip click or the position picker)."""
    session.cursor = replace(session.cursor, round=round_index, position=position)


def show(session: Session, panel: Panel) -> None:
    """A tab was selected: events render its views from now on (the others stay as last drawn)."""
    session.panel = panel


def load_replay(session: Session, source: str | Path | bytes, name: str) -> None:
    """Replace the session's run with a trace to replay from its first round; no model is needed."""
    view = view_from_trace(load_trace(source), name)
    if not view.rounds:
        raise TraceError(f"{name} holds no rounds to replay.")
    session.drop_run()
    session.replay = view
    session.use_trace(Path(source) if isinstance(source, (str, Path)) else None)


def adopt_replay(session: Session, view: RunView, cursor: Cursor, path: Path | None) -> None:
    """Make a recorded run the page showed without a session (the welcome run) the session's replay, at
    `cursor`, so that Back, the scrubber and chip clicks move through it as through any replay."""
    session.drop_run()
    session.replay, session.cursor = view, cursor
    session.use_trace(path)


def export_rounds_csv(session: Session) -> Path:
    """The shown run's per-round table as CSV, in the session's folder."""
    from engine.trace import export_csv

    view = session.view()
    if view is None or not view.rounds:
        raise ValueError("Nothing to export yet: step a few rounds first.")
    return export_csv(list(view.rounds), session.workdir / f"rounds-{len(view.rounds)}.csv")


def verified_view(session: Session) -> RunView | None:
    """The session's rounds whose verification is shown: a round still pending would give its verdict
    away (the Theory tab reads this)."""
    view, cursor = session.view(), session.cursor
    if view is None:
        return None
    return view.upto(cursor.shown - (0 if cursor.revealed else 1))


def lab_rows(session: Session) -> tuple[RoundRows, Callable[[int], str]]:
    """The full rows of the round selected in the playground, and the target's decoder for its tokens.
    Raises ValueError saying why there are none."""
    view = session.view()
    selection = session.cursor.selection(view) if view is not None else None
    if selection is None:
        raise ValueError("No round shown yet: step the playground at least once (the lab uses the round selected "
                         "there).")
    if not session.live:
        raise ValueError("The lab re-runs the round's forwards, so it needs a live run, not a replayed trace.")
    spec = session.run.spec
    rows = round_rows(spec.target, spec.pair.draft, spec.prompt, spec.rounds, selection[0], spec.config)
    reader = StreamDecoder(spec.target.tokenizer)
    reader.feed_all(round_context(spec.prompt, spec.rounds, selection[0]))

    def label(token: int) -> str:
        """The token as a chip shows it, read after the round's committed text (engine.text)."""
        text = reader.copy().feed(token)
        return chip_text(text.text, text.pending)

    return rows, label

"""What the buttons do to a session: reset, step, reveal, step back, scrub, run to end, load a trace.

No Gradio here: each action takes a session and validated inputs and changes the session's run
or cursor. Bad input raises an exception whose message is meant for the user (see USER_ERRORS).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from engine.block_manager import KVPoolExhausted
from engine.compared import ComparedRun, kv_bytes_needed
from engine.config import DrafterKind, KSchedule, Mode, SpecConfig
from engine.models import ModelLoadError
from engine.sampling import SamplingParams
from engine.speculative import PromptError, encode_prompt
from engine.trace import TraceError, load_trace
from playground.inputs import as_float, as_int, as_seed
from playground.registry import ModelRegistry
from playground.sessions import Session, SessionLimitReached, SessionPool
from playground.settings import AppSettings
from playground.teach.lesson import RoundRows, round_rows
from playground.view import Cursor, Panel, RunView, info_for_run, view_from_trace

# Everything a visitor can cause by typing or uploading: shown as a message, never a traceback.
USER_ERRORS = (ValueError, ModelLoadError, KVPoolExhausted, SessionLimitReached)  # PromptError, TraceError: ValueErrors


@dataclass(frozen=True, slots=True)
class Context:
    """What every action may use: the shared models, the session pool and the server's limits."""

    registry: ModelRegistry
    pool: SessionPool
    settings: AppSettings


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

    def config(self, max_new_tokens_cap: int) -> SpecConfig:
        """The validated SpecConfig; raises ValueError with a message for the user."""
        new = as_int("Max new tokens", self.max_new_tokens)
        if new > max_new_tokens_cap:
            raise ValueError(f"Max new tokens is {new}; this server allows at most {max_new_tokens_cap}.")
        sampling = SamplingParams(temperature=as_float("Temperature", self.temperature),
                                  top_k=as_int("Top-k", self.top_k), top_p=as_float("Top-p", self.top_p))
        return SpecConfig(mode=Mode(self.mode), drafter=DrafterKind(self.drafter), k=as_int("K", self.k),
                          k_schedule=KSchedule(self.k_schedule), k_min=as_int("K min", self.k_min),
                          k_max=as_int("K max", self.k_max), sampling=sampling, seed=as_seed(self.seed),
                          max_new_tokens=new)



def reset(ctx: Context, session: Session, req: DecodeRequest) -> None:
    """Start a fresh run with the current settings (loading the pair if needed), recording its trace."""
    config = req.config(ctx.settings.max_new_tokens)
    if len(req.prompt) > ctx.settings.max_prompt_chars:
        raise PromptError(f"The prompt has {len(req.prompt)} characters; this server takes at most "
                          f"{ctx.settings.max_prompt_chars}.")
    pair = ctx.registry.pair(req.preset, req.custom_draft, req.custom_target)
    prompt_ids = encode_prompt(pair.target.tokenizer, req.prompt)
    session.drop_run()
    ctx.pool.reserve_kv(session, kv_bytes_needed(pair, len(prompt_ids), config))
    try:
        session.run = ComparedRun(pair, req.prompt, config, trace_path=session.new_trace_path())
    except BaseException:
        session.kv_bytes, session.trace_path = 0, None
        raise
    session.info = info_for_run(session.run, pair.target, pair.draft)


def _advance(session: Session, reveal: bool) -> None:
    c = session.cursor
    session.cursor = Cursor(shown=c.shown + 1, revealed=not reveal)


def step(ctx: Context, session: Session, req: DecodeRequest, reveal: bool = False) -> str | None:
    """One click of Step: reveal a pending round, replay a round already run, or run a new one.

    With `reveal`, a new round first shows its drafts as pending and the next Step reveals the
    verification. Returns a note for the user when there is nothing left to do.
    """
    if session.view() is None:
        reset(ctx, session, req)
    c, view = session.cursor, session.view()
    if not c.revealed:
        session.cursor = replace(c, revealed=True)
    elif c.shown < len(view.rounds):
        _advance(session, reveal)
    elif session.live and not session.run.finished:
        session.run.step()
        _advance(session, reveal)
    else:
        return "The run is finished: press Reset to decode again." if session.live else "End of the trace."
    return None


def run_to_end(ctx: Context, session: Session, req: DecodeRequest,
               progress: Callable[[int, int], None] = lambda done, total: None) -> None:
    """Decode (or replay) every remaining round; progress(tokens, max_new_tokens) after each."""
    if session.view() is None:
        reset(ctx, session, req)
    if session.live:
        run, total = session.run, session.run.config.max_new_tokens
        while not run.finished:
            run.step()
            progress(len(run.spec.generated), total)
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
    session.trace_path = Path(source) if isinstance(source, (str, Path)) else None


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
    return rows, lambda t: spec.target.tokenizer.decode([t])

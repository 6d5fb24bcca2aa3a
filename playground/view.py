"""What every page renders: a run's records, live or replayed from a trace, and a cursor into them.

Renderers never see a model or an engine: a `RunView` is built from a `ComparedRun` or from a
loaded `Trace`, so a replayed GPU run and a live CPU run draw exactly the same way.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, replace
from enum import Enum

from engine import metrics
from engine.calibration import RCurve
from engine.compared import ComparedRun
from engine.config import KSchedule, Mode, SpecConfig
from engine.metrics import NotMeasured, Prediction
from engine.models import LoadedModel
from engine.records import Outcome, RoundRecord
from engine.trace import Trace, TraceHeader, make_header


@dataclass(frozen=True, slots=True)
class RunInfo:
    """Who produced the rounds and with which settings."""

    prompt: str
    prompt_tokens: int
    config: SpecConfig
    target: str
    draft: str | None
    devices: dict[str, str]    # role -> device
    dtypes: dict[str, str]     # role -> dtype
    chat: bool = False         # the prompt is a chat turn through the target's template
    eagle: str | None = None   # the EAGLE head the run drafted with
    machine: str | None = None   # what it ran on (engine.clock.machine_name), where its trace says
    layers: str | None = None    # where the target's layers ran ("C++", "Python"), where its trace says
    codes: str | None = None     # what its fp32 products read the matrices from ("Q4_1 and Q8_0 codes"), if codes

    @property
    def greedy(self) -> bool:
        return self.config.sampling.greedy

    def label(self) -> str:
        c = self.config
        if c.mode is Mode.TARGET:
            return f"target-only · T={c.sampling.temperature:g}"
        if c.tree is not None:
            k = f"tree {c.tree.label()}"
        else:
            k = f"K={c.k}" if c.k_schedule is KSchedule.CONSTANT else f"K={c.k} ({c.k_min}..{c.k_max}, heuristic)"
        return f"{c.mode.value} · {c.drafter.value} drafter · {k} · T={c.sampling.temperature:g}"


@dataclass(frozen=True, slots=True)
class RunView:
    """The speculative rounds and the target-only baseline rounds measured beside them."""

    info: RunInfo
    rounds: tuple[RoundRecord, ...]
    baseline: tuple[RoundRecord, ...]
    complete: bool
    source: str    # "live" or the trace's name
    calibration: RCurve | None = None   # the target's measured r(n), when known
    previous: str | None = None   # why this is shown as the previous run (the Reset after it failed), else None

    def prediction(self) -> Prediction | NotMeasured:
        """Leviathan's model for the rounds shown, fed this run's measured alpha, c and r(n)."""
        return metrics.predict(self.rounds, self.baseline, self.calibration.at if self.calibration else None)

    def upto(self, shown: int) -> "RunView":
        """The first `shown` spec rounds, and the baseline rounds run by then (it catches up to the
        spec's token count after every spec round, one token per round)."""
        rounds = self.rounds[:shown]
        baseline = self.baseline[:self.baseline_by(rounds[-1].tokens_total if rounds else 0)]
        return replace(self, rounds=rounds, baseline=baseline, complete=self.complete and shown >= len(self.rounds))

    def baseline_by(self, tokens: int) -> int:
        """How many baseline rounds had run when the spec run held `tokens` tokens: those with at most
        that many (each baseline round adds one token, so their counts ascend)."""
        return bisect_right(self.baseline, tokens, key=lambda b: b.tokens_total)

    @property
    def spec_tokens(self) -> list[int]:
        return [t for r in self.rounds for t in r.emitted]

    @property
    def baseline_tokens(self) -> list[int]:
        return [t for r in self.baseline for t in r.emitted]

    def identical_to_baseline(self) -> bool | None:
        """Token-for-token agreement over the common prefix; None without a baseline to compare."""
        spec, base = self.spec_tokens, self.baseline_tokens
        if not self.baseline or not spec:
            return None
        n = min(len(spec), len(base))
        return spec[:n] == base[:n]


class Panel(Enum):
    """The tabs that draw from the cursor. Only the shown one is rendered on each event; the others
    are rendered when their tab is selected."""

    DETAIL = "detail"
    KV = "kv"
    CHARTS = "charts"
    OTHER = "other"    # a tab that draws none of these (Theory, the lab, Traces, Compare)


@dataclass(frozen=True, slots=True)
class Cursor:
    """Where the viewer stands: how many rounds are shown, and which token is selected for detail.

    revealed=False shows the last shown round's drafts as pending (drafted, not yet verified):
    the lecturer's "reveal" sub-step. position == round.k selects the round's final token.
    """

    shown: int = 0
    revealed: bool = True
    round: int | None = None
    position: int | None = None

    def selection(self, view: RunView) -> tuple[int, int] | None:
        """(round index, position) of the token the detail plots show, defaulting to the last shown
        round's most interesting token: its rejection, else its final token."""
        if self.shown == 0 or not view.rounds:
            return None
        shown = min(self.shown, len(view.rounds))
        index = self.round if self.round is not None and self.round < shown else shown - 1
        record = view.rounds[index]
        if self.position is not None and self.round == index and 0 <= self.position <= record.k:
            return index, self.position
        return index, default_position(record)


def default_position(record: RoundRecord) -> int:
    """The rejected position if there was one, else the final token (position k; a tree's is 0)."""
    if record.tree is not None:
        return 0
    for p in record.positions:
        if p.outcome is Outcome.REJECTED:
            return p.index
    return record.k


def info_from_header(h: TraceHeader, config: SpecConfig) -> RunInfo:
    """The run's info from its header and its parsed config (Trace.config, or a live run's own)."""
    return RunInfo(prompt=h.prompt, prompt_tokens=len(h.prompt_ids), config=config,
                   target=h.target, draft=h.draft, devices=dict(h.devices), dtypes=dict(h.dtypes),
                   chat=h.chat is not None, eagle=h.eagle, machine=h.machine, layers=h.layers,
                   codes=h.codes)


def view_from_trace(trace: Trace, name: str) -> RunView:
    return RunView(info_from_header(trace.header, trace.config), tuple(trace.rounds), tuple(trace.baseline), trace.complete, name,
                   trace.calibration)


def info_for_run(run: ComparedRun, target: LoadedModel, draft: LoadedModel | None) -> RunInfo:
    """A live run's info, built exactly as its trace header is."""
    eagle = run.pair.eagle.name if run.pair.eagle is not None else None
    return info_from_header(make_header(run.prompt, run.spec.prompt, run.config, target, draft, run.chat, eagle),
                            run.config)


def view_from_run(run: ComparedRun, info: RunInfo) -> RunView:
    """A live run's rounds so far."""
    baseline = tuple(run.baseline.rounds) if run.baseline is not None else ()
    return RunView(info, tuple(run.spec.rounds), baseline, run.finished, "live", run.calibration)

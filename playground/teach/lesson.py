"""Teaching mode: the lesson's text (data in assets/lessons), the seed search that finds a run worth
teaching, the driver that walks the lesson's steps on the real engine, and the full-vocabulary
p/q rows of a past round that the losslessness lab samples from.

Nothing here draws anything: the driver hands typed `LessonStep`s (text with the run's own
numbers filled in, the round and position to show, the question and its real answer) to the UI.
"""
from __future__ import annotations

import json
import statistics
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from types import MappingProxyType

import torch
from torch import Tensor

from engine import metrics
from engine.compared import ComparedRun
from engine.config import TREE_BOUND, DrafterKind, Mode, SpecConfig, TreeSpec
from engine.drafters.model import draftable, stand_in_id
from engine.models import LoadedModel
from engine.pair import ModelPair
from engine.prompts import ChatPrompt, encode_chat, encode_prompt
from engine.records import Outcome, PositionRecord, RoundRecord
from engine.runner import ModelRunner
from engine.sampling import SamplingParams, logits_to_probs
from engine.sources import ASSETS
from engine.speculative import SpeculativeEngine
from engine.verify import acceptance_probability, align_vocab
from playground.teach.losslessness import Rule

LESSONS_DIR = ASSETS / "lessons"
SCHEMA, SCHEMA_VERSION = "specplay.lesson", 1


class LessonError(ValueError):
    """The lesson cannot run: bad lesson text, or no seed shows every case. The message says why."""


# -- what each step is ------------------------------------------------------------------------------
class StepId(str, Enum):
    """The lesson's steps, in order. The text file must give one entry per id, in this order."""

    MEMORY_BOUND = "memory_bound"
    DRAFT = "draft"
    VERIFY = "verify"
    ACCEPT = "accept"
    REJECT = "reject"
    RESIDUAL = "residual"
    BONUS = "bonus"
    KV = "kv"
    V1_V2 = "v1_v2"
    TREE = "tree"
    PAYS = "pays"


class View(str, Enum):
    """The one view a step highlights."""

    COST = "cost"          # measured forward times: one token vs K+1
    CHIPS = "chips"        # the token stream
    PQ_BARS = "pq_bars"    # p_target vs q_draft at one drafted position
    RESIDUAL = "residual"  # the correction's residual
    BONUS = "bonus"        # the bonus row K
    KV = "kv"              # v2's target KV grid
    KV_V1 = "kv_v1"        # v1's target KV grid, same round
    TREE = "tree"          # a tree round drawn as a tree
    THEORY = "theory"      # E(alpha, K) and the predicted speed-up


class QuestionKind(str, Enum):
    YES_NO = "yes_no"
    NUMBER = "number"


@dataclass(frozen=True, slots=True)
class StepSpec:
    """What a step shows and asks. `facts` may appear anywhere in its text; `secrets` give the
    answer away, so only the question's reveal text may use them."""

    view: View
    question: QuestionKind | None
    facts: frozenset[str]
    secrets: frozenset[str] = frozenset()


def _spec(view: View, question: QuestionKind | None, facts: str, secrets: str = "") -> StepSpec:
    return StepSpec(view, question, frozenset(facts.split()), frozenset(secrets.split()))


_POSITION_FACTS = "round pos token p q alpha"
STEP_SPECS: Mapping[StepId, StepSpec] = MappingProxyType({
    StepId.MEMORY_BOUND: _spec(View.COST, None, "target_mib drafter drafter_mib step_ms verify_ms verify_ratio cost_claim k k1"),
    StepId.DRAFT: _spec(View.CHIPS, QuestionKind.NUMBER, "round k drafted q_list drafter drafter_mib target_mib",
                        "draft_forwards"),
    StepId.VERIFY: _spec(View.PQ_BARS, QuestionKind.NUMBER, "round k k1 token p q", "target_forwards"),
    StepId.ACCEPT: _spec(View.PQ_BARS, QuestionKind.YES_NO, _POSITION_FACTS, "u outcome"),
    StepId.REJECT: _spec(View.PQ_BARS, QuestionKind.YES_NO, _POSITION_FACTS, "u outcome"),
    StepId.RESIDUAL: _spec(View.RESIDUAL, QuestionKind.YES_NO, "round pos row token p q correction"),
    StepId.BONUS: _spec(View.BONUS, QuestionKind.NUMBER, "round k k1", "row bonus bonus_p"),
    StepId.KV: _spec(View.KV, QuestionKind.NUMBER, "round k k1 accepted", "written rolled_back kept"),
    StepId.V1_V2: _spec(View.KV_V1, QuestionKind.NUMBER, "round k v2_forwards", "v1_forwards v1_rolled_back"),
    StepId.TREE: _spec(View.TREE, QuestionKind.NUMBER, "round nodes shape depth chain_round chain_tokens",
                       "tree_tokens path"),
    StepId.PAYS: _spec(View.THEORY, QuestionKind.YES_NO,
                       "alpha draft_rate k k2 e_k tokens rounds tokens_per_round c r speedup k1 formats_machine "
                       "fp32_r int8_r int4_r best_fp32 best_int8 best_int4 int4_step llamacpp_q4_step llamacpp_q4_r "
                       "best_llamacpp_q4", "e_2k"),
})

UI_KEYS = frozenset(("start restart next back check reveal your_answer correct wrong pick_first not_started pair "
                     "step_counter run_label number_choice yes no accepted rejected figure_idle").split())
YES, NO = "yes", "no"


# -- the text, as data --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class QuestionText:
    prompt: str   # may use the step's facts
    reveal: str   # shown once answered or revealed; may also use the step's secrets


@dataclass(frozen=True, slots=True)
class StepText:
    id: StepId
    title: str
    body: str
    question: QuestionText | None


@dataclass(frozen=True, slots=True)
class LessonText:
    """One language's lesson: assets/lessons/<lang>.json, schema `specplay.lesson` version 1."""

    lang: str
    title: str
    intro: str
    ui: Mapping[str, str]
    steps: tuple[StepText, ...]


def available_languages(root: Path = LESSONS_DIR) -> list[str]:
    return sorted(p.stem for p in root.glob("*.json"))


def load_lesson_text(lang: str = "en", root: Path = LESSONS_DIR) -> LessonText:
    """Read and validate one language's lesson text; LessonError says what is wrong and where."""
    path = root / f"{lang}.json"
    if not path.is_file():
        raise LessonError(f"No lesson text for language {lang!r}: {path} does not exist "
                          f"(available: {', '.join(available_languages(root)) or 'none'}).")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise LessonError(f"{path} is not valid JSON: {exc}") from None
    return parse_lesson_text(data, str(path))


def _text(data: Mapping, key: str, where: str) -> str:
    value = data.get(key)
    if not isinstance(value, str) or not value.strip():
        raise LessonError(f"{where}: {key!r} must be a non-empty string")
    return value


def placeholders(template: str) -> set[str]:
    """The {names} a template uses (format-spec and conversions are not allowed, names only)."""
    return {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}


def _check_names(template: str, allowed: frozenset[str], where: str) -> None:
    unknown = placeholders(template) - allowed
    if unknown:
        raise LessonError(f"{where} uses unknown placeholders {sorted(unknown)}; allowed: {sorted(allowed)}")


def parse_lesson_text(data: object, where: str = "lesson text") -> LessonText:
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise LessonError(f"{where}: not a lesson file (\"schema\" must be {SCHEMA!r})")
    if data.get("version") != SCHEMA_VERSION:
        raise LessonError(f"{where}: schema version {data.get('version')!r} is not supported (expected {SCHEMA_VERSION})")
    ui = data.get("ui")
    if not isinstance(ui, dict) or not UI_KEYS <= ui.keys() or not all(isinstance(v, str) for v in ui.values()):
        missing = sorted(UI_KEYS - set(ui or {})) if isinstance(ui, dict) else sorted(UI_KEYS)
        raise LessonError(f"{where}: \"ui\" must map every UI string to text (missing: {missing})")
    steps = data.get("steps")
    ids = [s.get("id") if isinstance(s, dict) else None for s in steps] if isinstance(steps, list) else None
    if ids != [s.value for s in StepId]:
        raise LessonError(f"{where}: \"steps\" must list the ids {[s.value for s in StepId]} in order, got {ids}")
    return LessonText(lang=_text(data, "lang", where), title=_text(data, "title", where),
                      intro=_text(data, "intro", where), ui=MappingProxyType(dict(ui)),
                      steps=tuple(_parse_step(s, f"{where}, step {s['id']!r}") for s in steps))


def _parse_step(data: dict, where: str) -> StepText:
    step_id = StepId(data["id"])
    spec = STEP_SPECS[step_id]
    body = _text(data, "body", where)
    _check_names(body, spec.facts, f"{where} body")
    q = data.get("question")
    if (q is None) != (spec.question is None):
        raise LessonError(f"{where}: this step {'has no' if spec.question is None else 'needs a'} question")
    question = None
    if q is not None:
        if not isinstance(q, dict):
            raise LessonError(f"{where}: \"question\" must be an object with \"prompt\" and \"reveal\"")
        question = QuestionText(_text(q, "prompt", where), _text(q, "reveal", where))
        _check_names(question.prompt, spec.facts, f"{where} question prompt")
        _check_names(question.reveal, spec.facts | spec.secrets, f"{where} question reveal")
    return StepText(step_id, _text(data, "title", where), body, question)


# -- finding a run worth teaching ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LessonSettings:
    """The lesson's run. Sampling (temperature > 0) so that acceptance is a coin flip worth asking about.

    The default is the built-in code pair's run (a draft model); `for_pair` gives each pair its own."""

    prompt: str | ChatPrompt = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    drafter: DrafterKind = DrafterKind.MODEL
    k: int = 3
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 48
    max_rounds: int = 16   # the cases must all occur within this many rounds
    seeds: int = 200       # seeds 0 .. seeds-1 are tried in order

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError("the lesson needs temperature > 0: greedy acceptance is all-or-nothing")
        if self.max_rounds < 2 or self.seeds < 1:
            raise ValueError(f"need max_rounds >= 2 and seeds >= 1, got {self.max_rounds}, {self.seeds}")
        if self.drafter.copies:
            raise ValueError("the lesson needs a drafter that samples its guesses (a draft model or an EAGLE "
                             "head): prompt lookup proposes with certainty, q = 1")

    @classmethod
    def for_pair(cls, pair: ModelPair) -> "LessonSettings":
        """A chat question drafted by the EAGLE head for a target with a chat template and a head (SmolLM2:
        T 0.7, top-p 0.95, coherent yet uncertain enough for coin flips); the code prompt drafted by the
        draft model otherwise. ValueError when the pair has neither drafter."""
        if pair.eagle is not None and getattr(pair.target.tokenizer, "chat_template", None):
            return cls(prompt=ChatPrompt("Why is the sky blue?"), drafter=DrafterKind.EAGLE, temperature=0.7,
                       top_p=0.95)
        if pair.draft is not None:
            return cls()
        if pair.eagle is not None:
            return cls(drafter=DrafterKind.EAGLE)
        raise ValueError(f"{pair.target.name} has neither a draft model nor an EAGLE head: the lesson needs one")

    @property
    def prompt_text(self) -> str:
        """The prompt as the learner typed it (a chat turn's user message)."""
        return self.prompt.user if isinstance(self.prompt, ChatPrompt) else self.prompt

    def prompt_ids(self, tokenizer) -> list[int]:
        if isinstance(self.prompt, ChatPrompt):
            return encode_chat(tokenizer, self.prompt)
        return encode_prompt(tokenizer, self.prompt)

    def config(self, seed: int) -> SpecConfig:
        return SpecConfig(mode=Mode.V2, drafter=self.drafter, k=self.k,
                          sampling=SamplingParams(temperature=self.temperature, top_p=self.top_p), seed=seed,
                          max_new_tokens=self.max_new_tokens)


@dataclass(frozen=True, slots=True)
class LessonPlan:
    """A seed whose run shows an accept, a rejection with correction and a bonus: the rounds to teach."""

    settings: LessonSettings
    seed: int
    reject_round: int   # accepted >= 1 draft, then rejected one and emitted a correction
    bonus_round: int    # accepted all K drafts and emitted the bonus

    @property
    def config(self) -> SpecConfig:
        return self.settings.config(self.seed)


def is_reject_round(r: RoundRecord, k: int) -> bool:
    """A full-K round that accepted at least one draft, then rejected one and emitted its correction.
    Not the first round: its KV writes would include the prompt's prefill, and the KV step shows
    the cache before the round too."""
    return (r.index >= 1 and r.k == k and r.accepted >= 1 and r.final.outcome is Outcome.CORRECTED
            and len(r.emitted) == r.accepted + 1)


def is_bonus_round(r: RoundRecord, k: int) -> bool:
    """A full-K round that accepted every draft and emitted the bonus (not cut by EOS or the budget)."""
    return r.k == k and r.accepted == k and r.final.outcome is Outcome.BONUS and len(r.emitted) == k + 1


def _first(rounds: list[RoundRecord], test: Callable[[RoundRecord, int], bool], k: int) -> int | None:
    return next((r.index for r in rounds if test(r, k)), None)


def find_plan(pair: ModelPair, settings: LessonSettings | None = None) -> LessonPlan:
    """The first seed (in order, so the search is deterministic) whose first `max_rounds` rounds
    contain both a reject round and a bonus round. Runs the real engine for each seed tried.
    settings: None is the pair's own (LessonSettings.for_pair)."""
    settings = settings if settings is not None else LessonSettings.for_pair(pair)
    prompt_ids = settings.prompt_ids(pair.target.tokenizer)
    for seed in range(settings.seeds):
        engine = SpeculativeEngine(pair, prompt_ids, replace(settings.config(seed), record=False))
        reject = bonus = None
        try:
            while not engine.finished and len(engine.rounds) < settings.max_rounds and (reject is None or bonus is None):
                engine.step()
                reject = reject if reject is not None else _first(engine.rounds[-1:], is_reject_round, settings.k)
                bonus = bonus if bonus is not None else _first(engine.rounds[-1:], is_bonus_round, settings.k)
        finally:
            engine.close()
        if reject is not None and bonus is not None:
            return LessonPlan(settings, seed, reject, bonus)
    raise LessonError(f"No seed in 0..{settings.seeds - 1} gives an accept, a corrected rejection and a bonus "
                      f"within {settings.max_rounds} rounds at K={settings.k}; try more seeds or a smaller K.")


# -- the steps, as the driver hands them to the UI ----------------------------------------------------
@dataclass(frozen=True, slots=True)
class Question:
    kind: QuestionKind
    prompt: str
    choices: tuple[tuple[str, str], ...]  # (label, value)
    answer: str                           # the value, read off the real record
    reveal: str                           # shown once answered or revealed

    def label(self, value: str) -> str:
        return next(label for label, v in self.choices if v == value)


@dataclass(frozen=True, slots=True)
class LessonStep:
    """One step of the lesson as the UI shows it, with the run's own numbers filled in."""

    id: StepId
    index: int
    total: int
    title: str
    body: str
    view: View
    round: int               # the round the view shows (0-based)
    position: int | None     # 0..k-1 a draft, k the final token, None: the whole round
    revealed: bool           # False: the question is open and the view hides its answer
    question: Question | None
    facts: Mapping[str, str]
    answered: str | None     # the learner's choice, once checked


@dataclass(frozen=True, slots=True)
class AnswerCheck:
    correct: bool
    answer: str      # the right choice's label
    feedback: str    # markdown: right/wrong, then the reveal text


@dataclass(frozen=True, slots=True)
class _Content:
    facts: dict[str, str]
    round: int
    position: int | None = None
    answer: str | None = None
    choices: tuple[str, ...] = ()   # NUMBER questions: the values offered


def _num(x: float, digits: int = 3) -> str:
    return f"{x:.{digits}f}"


def code(text: str) -> str:
    """A token's text as inline Markdown code, quotes and escapes visible (repr)."""
    r = repr(text)
    return f"`` {r} ``" if "`" in r else f"`{r}`"


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


class LessonDriver:
    """Walks the lesson on a live run of the real engine: the plan's seed, re-run step by step.

    The run (a ComparedRun: speculative v2 plus the target-only baseline it is timed against) is
    advanced only as far as the current step needs; the v1 run of the same seed is started by the
    v1-vs-v2 step. Holds per-learner state (step index, answers), so each browser session owns one.
    """

    def __init__(self, pair: ModelPair, text: LessonText, plan: LessonPlan) -> None:
        self.pair, self.target, self.text, self.plan = pair, pair.target, text, plan
        self.run = ComparedRun(pair, plan.settings.prompt, plan.config)
        self.v1: SpeculativeEngine | None = None
        self.tree: SpeculativeEngine | None = None
        self.index = 0
        self._answers: dict[int, str] = {}
        self._revealed: set[int] = set()

    @classmethod
    def start(cls, pair: ModelPair, text: LessonText, settings: LessonSettings | None = None) -> "LessonDriver":
        return cls(pair, text, find_plan(pair, settings))

    @property
    def total(self) -> int:
        return len(self.text.steps)

    @property
    def k(self) -> int:
        return self.plan.settings.k

    # -- navigation ------------------------------------------------------------------------------
    def current(self) -> LessonStep:
        return self.go(self.index)

    def go(self, index: int) -> LessonStep:
        """Move to step `index` (clamped), advancing the engine as far as that step needs."""
        self.index = max(0, min(self.total - 1, int(index)))
        return self._build(self.index)

    def next(self) -> LessonStep:
        return self.go(self.index + 1)

    def back(self) -> LessonStep:
        return self.go(self.index - 1)

    def answer(self, choice: str | None) -> AnswerCheck:
        """Check the learner's choice for the current step against the real record; reveals the step."""
        step = self.current()
        if step.question is None:
            raise LessonError("this step has no question")
        if choice not in {v for _, v in step.question.choices}:
            raise LessonError(self.text.ui["pick_first"])
        self._answers[self.index], correct = choice, choice == step.question.answer
        self._revealed.add(self.index)
        head = self.text.ui["correct"] if correct else self.text.ui["wrong"].format(
            answer=step.question.label(step.question.answer))
        return AnswerCheck(correct, step.question.label(step.question.answer), f"{head} {step.question.reveal}")

    def reveal(self) -> LessonStep:
        self._revealed.add(self.index)
        return self.current()

    def close(self) -> None:
        self.run.close()
        for engine in (self.v1, self.tree):
            if engine is not None:
                engine.close()

    # -- the engine, advanced on demand --------------------------------------------------------------
    def record(self, index: int) -> RoundRecord:
        """Round `index` of the v2 run, decoding up to it if needed."""
        while len(self.run.spec.rounds) <= index and not self.run.finished:
            self.run.step()
        if len(self.run.spec.rounds) <= index:
            raise LessonError(f"the run finished before round {index + 1}")
        return self.run.spec.rounds[index]

    def v1_record(self, index: int) -> RoundRecord:
        """Round `index` of a v1 run with the same seed (same draws, so the same tokens)."""
        if self.v1 is None:
            prompt_ids = self.plan.settings.prompt_ids(self.target.tokenizer)
            self.v1 = SpeculativeEngine(self.pair, prompt_ids, replace(self.plan.config, mode=Mode.V1))
        while len(self.v1.rounds) <= index and not self.v1.finished:
            self.v1.step()
        return self.v1.rounds[index]

    def tree_record(self, index: int) -> RoundRecord:
        """Round `index` of a run with the same seed that drafts a tree of 2K nodes, K deep, instead."""
        if self.tree is None:
            prompt_ids = self.plan.settings.prompt_ids(self.target.tokenizer)
            spec = TreeSpec(budget=min(2 * self.k, TREE_BOUND), depth=self.k)
            self.tree = SpeculativeEngine(self.pair, prompt_ids, replace(self.plan.config, tree=spec))
        while len(self.tree.rounds) <= index and not self.tree.finished:
            self.tree.step()
        return self.tree.rounds[index]

    def run_to_end(self) -> list[RoundRecord]:
        return self.run.run_to_end()

    def _reject(self) -> RoundRecord:
        r = self.record(self.plan.reject_round)
        if not is_reject_round(r, self.k):
            raise LessonError("the run diverged from the seed search (reject round); restart the lesson")
        return r

    def _bonus(self) -> RoundRecord:
        r = self.record(self.plan.bonus_round)
        if not is_bonus_round(r, self.k):
            raise LessonError("the run diverged from the seed search (bonus round); restart the lesson")
        return r

    # -- building a step -----------------------------------------------------------------------------
    def _build(self, index: int) -> LessonStep:
        text = self.text.steps[index]
        spec = STEP_SPECS[text.id]
        content = _CONTENT[text.id](self)
        revealed = spec.question is None or index in self._revealed
        public = {k: v for k, v in content.facts.items() if k in spec.facts}
        question = None
        if spec.question is not None:
            question = Question(spec.question, text.question.prompt.format_map(public), self._choices(spec, content),
                                content.answer, text.question.reveal.format_map(content.facts))
        return LessonStep(text.id, index, self.total, text.title, text.body.format_map(public), spec.view,
                          content.round, content.position, revealed, question, MappingProxyType(content.facts),
                          self._answers.get(index))

    def _choices(self, spec: StepSpec, content: _Content) -> tuple[tuple[str, str], ...]:
        ui = self.text.ui
        if spec.question is QuestionKind.YES_NO:
            return ((ui["yes"], YES), (ui["no"], NO))
        return tuple((ui["number_choice"].format(n=v), v) for v in content.choices)

    # One method per step: the facts its text uses, what it shows, and the question's real answer.
    def _memory_bound(self) -> _Content:
        r = self._reject()
        step_ms, verify_ms = self._costs(r.index)
        return _Content(dict(**self._drafter_facts(), step_ms=_num(step_ms, 2),
                             verify_ms=_num(verify_ms, 2), verify_ratio=_num(verify_ms / step_ms, 1),
                             cost_claim=cost_claim(self.k + 1, verify_ms / step_ms), k=str(self.k),
                             k1=str(self.k + 1)), r.index)

    def _drafter_facts(self) -> dict[str, str]:
        """What drafts in this run, as the text names it, and its weights in MiB."""
        if self.plan.settings.drafter.uses_eagle and self.pair.eagle is not None:
            bf16 = "; its matrices read as bf16 copies" if self.pair.eagle.matrices == "bf16 copies" else ""
            name, size = f"the target's EAGLE head (one decoder layer reading the target's own features{bf16})", \
                self.pair.eagle.weight_bytes
        else:
            name, size = f"the draft model (`{self.pair.draft.name}`)", self.pair.draft.weight_bytes
        return dict(drafter=name, drafter_mib=_num(size / 2**20, 1), target_mib=_num(self.target.weight_bytes / 2**20, 1))

    def _costs(self, upto: int) -> tuple[float, float]:
        """(median target-only step, median verify forward of K + 1 tokens) in ms, from the engine's own
        forward times, up to round `upto` (round 0's forward is the prefill: left out)."""
        step = metrics.target_step_ms(self.run.baseline.rounds) if self.run.baseline else None
        verify = [x.timings.target_forward_ms for x in metrics.decode_rounds(self.run.spec.rounds[: upto + 1]) if x.k]
        return (step if step is not None else float("nan")), _median(verify)

    def _draft(self) -> _Content:
        r = self._reject()
        facts = dict(round=str(r.index + 1), k=str(r.k), drafted=" · ".join(code(p.text) for p in r.positions),
                     q_list=", ".join(_num(p.q_draft) for p in r.positions), draft_forwards=str(r.draft_forwards),
                     **self._drafter_facts())
        return _Content(facts, r.index, None, str(r.draft_forwards), tuple(str(n) for n in range(1, r.k + 2)))

    def _verify(self) -> _Content:
        r = self._reject()
        p = r.positions[0]
        facts = dict(round=str(r.index + 1), k=str(r.k), k1=str(r.k + 1), token=code(p.text), p=_num(p.p_target),
                     q=_num(p.q_draft), target_forwards=str(r.target_forwards))
        return _Content(facts, r.index, 0, str(r.target_forwards), tuple(str(n) for n in range(1, r.k + 2)))

    def _position(self, r: RoundRecord, p: PositionRecord) -> _Content:
        facts = dict(round=str(r.index + 1), pos=str(p.index + 1), token=code(p.text), p=_num(p.p_target),
                     q=_num(p.q_draft), alpha=_num(p.alpha), u=_num(p.u),
                     outcome=self.text.ui[p.outcome.value])
        return _Content(facts, r.index, p.index, YES if p.outcome is Outcome.ACCEPTED else NO)

    def _accept(self) -> _Content:
        # The accepted draft with the smallest alpha: the least foregone conclusion to ask about.
        r = self._reject()
        return self._position(r, min(r.positions[: r.accepted], key=lambda p: (p.alpha, p.index)))

    def _reject_step(self) -> _Content:
        r = self._reject()
        return self._position(r, r.positions[r.accepted])

    def _residual(self) -> _Content:
        r = self._reject()
        p = r.positions[r.accepted]
        facts = dict(round=str(r.index + 1), pos=str(p.index + 1), row=str(r.final.row), token=code(p.text),
                     p=_num(p.p_target), q=_num(p.q_draft), correction=code(r.final.text))
        # The rejected token's residual max(0, p - q) is positive only if p > q.
        return _Content(facts, r.index, r.k, YES if p.p_target > p.q_draft else NO)

    def _bonus_step(self) -> _Content:
        r = self._bonus()
        facts = dict(round=str(r.index + 1), k=str(r.k), k1=str(r.k + 1), row=str(r.final.row),
                     bonus=code(r.final.text), bonus_p=_num(r.final.p_target))
        return _Content(facts, r.index, r.k, str(r.final.row), tuple(str(n) for n in range(r.k + 1)))

    def _kv(self) -> _Content:
        r = self._reject()
        kv = next(s for s in r.kv if s.model == "target")
        facts = dict(round=str(r.index + 1), k=str(r.k), k1=str(r.k + 1), accepted=str(r.accepted),
                     written=str(len(kv.written)), rolled_back=str(len(kv.rolled_back)),
                     kept=str(len(kv.written) - len(kv.rolled_back)))
        return _Content(facts, r.index, None, str(len(kv.rolled_back)), tuple(str(n) for n in range(r.k + 2)))

    def _v1_v2(self) -> _Content:
        r = self._reject()
        v1 = self.v1_record(r.index)
        kv = next(s for s in v1.kv if s.model == "target")
        facts = dict(round=str(r.index + 1), k=str(r.k), v2_forwards=str(r.target_forwards),
                     v1_forwards=str(v1.target_forwards), v1_rolled_back=str(len(kv.rolled_back)))
        return _Content(facts, r.index, None, str(v1.target_forwards), ("1", "2", "3"))

    def _tree(self) -> _Content:
        """The first drafted round, as a chain of K and as a tree of 2K nodes with the same seed."""
        chain = self.record(1)
        tree = self.tree_record(1)
        facts = dict(round="2", nodes=str(tree.k), shape=tree.tree.shape, depth=str(tree.depth),
                     chain_round="2", chain_tokens=str(len(chain.emitted)), tree_tokens=str(len(tree.emitted)),
                     path=" · ".join(code(n.text) for n in tree.tree.nodes if n.index in tree.tree.path) or "none")
        top = max(tree.depth + 1, len(chain.emitted)) + 1
        return _Content(facts, 1, None, str(len(tree.emitted)), tuple(str(n) for n in range(1, top + 1)))

    def _pays(self) -> _Content:
        rounds = self.run_to_end()
        drafted = metrics.drafted_rounds(rounds)
        alpha = metrics.alpha(drafted)  # accepted / verified positions: what E(alpha, K) is defined on
        e_k, e_2k = metrics.expected_tokens_per_round(alpha, self.k), metrics.expected_tokens_per_round(alpha, 2 * self.k)
        step_ms, verify_ms = self._costs(len(rounds) - 1)
        c = metrics.cost_ratio(rounds, self.run.baseline.rounds) or 0.0
        r = verify_ms / step_ms
        tokens = rounds[-1].tokens_total
        facts = dict(alpha=_num(alpha), draft_rate=_num(metrics.draft_acceptance(drafted)), k=str(self.k),
                     k2=str(2 * self.k), e_k=_num(e_k, 2), e_2k=_num(e_2k, 2), tokens=str(tokens),
                     rounds=str(len(drafted)), tokens_per_round=_num(metrics.tokens_per_round(drafted), 2), c=_num(c),
                     r=_num(r, 2), speedup=_num(metrics.predicted_speedup(alpha, self.k, c, r), 2),
                     **format_facts(alpha, c, self.k, self.run.pair.target.format))
        return _Content(facts, rounds[-1].index, None, YES if e_2k >= 2 * e_k else NO)


_CONTENT: Mapping[StepId, Callable[[LessonDriver], _Content]] = MappingProxyType({
    StepId.MEMORY_BOUND: LessonDriver._memory_bound, StepId.DRAFT: LessonDriver._draft,
    StepId.VERIFY: LessonDriver._verify, StepId.ACCEPT: LessonDriver._accept,
    StepId.REJECT: LessonDriver._reject_step, StepId.RESIDUAL: LessonDriver._residual,
    StepId.BONUS: LessonDriver._bonus_step, StepId.KV: LessonDriver._kv, StepId.V1_V2: LessonDriver._v1_v2,
    StepId.TREE: LessonDriver._tree, StepId.PAYS: LessonDriver._pays,
})


# -- the real rows of a past round (for the losslessness lab) ------------------------------------------
@dataclass(frozen=True, slots=True)
class RoundRows:
    """The full-vocabulary distributions behind one drafted round, recomputed from its context.

    q_draft: Tensor[K, V] float32 CPU, the draft's processed rows; p_target: Tensor[K+1, V], the
    target's verify rows (row K the bonus row). Same maths as the engine's round, so
    q_draft[i, drafted[i]] and p_target[i, drafted[i]] equal the record's q_draft and p_target.
    """

    round: int
    drafted: tuple[int, ...]
    q_draft: Tensor
    p_target: Tensor


def round_context(prompt_ids: list[int], rounds: list[RoundRecord] | tuple[RoundRecord, ...], index: int) -> list[int]:
    """The committed tokens when round `index` began: the prompt and every earlier round's tokens."""
    return list(prompt_ids) + [t for r in rounds[:index] for t in r.emitted]


def round_rows(target: LoadedModel, draft: LoadedModel | None, prompt_ids: list[int],
               rounds: list[RoundRecord] | tuple[RoundRecord, ...], index: int, config: SpecConfig) -> RoundRows:
    """Re-run round `index`'s verify forward (and the draft's forwards) on fresh KV caches.

    Raises ValueError for a round that drafted nothing (the prefill round, target-only, or no n-gram match).
    Side effects: none on the run; the temporary caches are freed.
    """
    record = rounds[index]
    drafted = [p.token for p in record.positions]
    if not drafted:
        why = "the prefill round, whose token comes from the target alone" if index == 0 else \
            "target-only, or no n-gram match"
        raise ValueError(f"Round {index + 1} drafted nothing ({why}): no q rows to test. Pick a later round.")
    context = round_context(prompt_ids, rounds, index)
    p_target = _target_rows(target, context, drafted, config)
    if config.drafter is DrafterKind.NGRAM or draft is None:
        # Prompt lookup proposes with certainty: its q rows are one-hot on the drafted tokens.
        q_draft = torch.nn.functional.one_hot(torch.tensor(drafted), target.vocab_size).float()
    else:
        q_draft = _draft_rows(draft, context, drafted, config, target)
    return RoundRows(index, tuple(drafted), q_draft, p_target)


def _fresh(loaded: LoadedModel, tokens: int, block_size: int) -> tuple[ModelRunner, object]:
    runner = ModelRunner(loaded, tokens + 1, block_size)
    return runner, runner.new_sequence()


def _target_rows(target: LoadedModel, context: list[int], drafted: list[int], config: SpecConfig) -> Tensor:
    """As the engine does it: cache context[:-1], then one forward over [last, d1..dK] -> K+1 rows."""
    runner, cache = _fresh(target, len(context) + len(drafted), config.block_size)
    try:
        if len(context) > 1:
            runner.forward(cache, context[:-1], last_only=True)
        logits = runner.forward(cache, [context[-1], *drafted])
    finally:
        cache.free()
    return logits_to_probs(logits, config.sampling).cpu()


def _draft_rows(draft: LoadedModel, context: list[int], drafted: list[int], config: SpecConfig,
                target: LoadedModel) -> Tensor:
    """The draft's K rows: after the context, then after each draft but the last (the one forward
    the drafter spreads over K calls). Aligned to the target's vocabulary before softmax, as the
    drafter does; ids the draft has no embedding for are fed as its stand-in, as the drafter does."""
    feed = draftable(context + drafted[:-1], draft.vocab_size, stand_in_id(draft))
    runner, cache = _fresh(draft, len(feed), config.block_size)
    try:
        if len(context) > 1:
            runner.forward(cache, feed[: len(context) - 1], last_only=True)
        logits = runner.forward(cache, feed[len(context) - 1:])
    finally:
        cache.free()
    aligned = align_vocab(logits, target.vocab_size, fill=float("-inf"), device=target.device, dtype=torch.float32)
    return logits_to_probs(aligned, config.sampling).cpu()


# -- which rows make the lab's point ---------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RuleOutput:
    """What a verification rule emits, exactly, when the rows are held fixed (as `simulate` does).

    reach: Tensor[K+1] float64, the probability that output index i emits a token at all;
    dist: Tensor[K+1, V] float64, the distribution of that token given it is emitted.
    """

    reach: Tensor
    dist: Tensor


def rule_output(q_draft: Tensor, p_target: Tensor, rule: Rule) -> RuleOutput:
    """Exact output law of `rule` on rows q_draft[K, V] and p_target[K+1, V].

    With beta_i = sum_t min(p_i, q_i) (the chance draft i is accepted), index i is reached with
    probability prod_{j<i} beta_j. The correct rule emits p_i there: min(p, q) by acceptance plus
    (1 - beta) * residual = max(0, p - q) by correction. DISCARD_ON_REJECT emits only the
    accepted part min(p, q) / beta (and only if accepted); CORRECTION_FROM_P emits
    min(p, q) + (1 - beta) p; BONUS_FROM_ROW_K_MINUS_1 emits p_{K-1} at index K.
    """
    q, p = q_draft.double().cpu(), p_target.double().cpu()
    k = q.shape[0]
    overlap = q * acceptance_probability(p[:k], q)   # q(t) min(1, p(t)/q(t)) = min(p(t), q(t)): the engine's rule
    beta = overlap.sum(dim=-1)
    reach = torch.cat([torch.ones(1, dtype=torch.float64), torch.cumprod(beta, 0)])
    dist = p.clone()
    rule = Rule(rule)
    if rule is Rule.DISCARD_ON_REJECT:
        reach = torch.cat([reach[1:k + 1], reach[k:k + 1]])
        dist[:k] = overlap / beta.clamp(min=1e-300).unsqueeze(-1)
    elif rule is Rule.CORRECTION_FROM_P:
        dist[:k] = overlap + (1 - beta).unsqueeze(-1) * p[:k]
    elif rule is Rule.BONUS_FROM_ROW_K_MINUS_1:
        dist[k] = p[k - 1]
    return RuleOutput(reach, dist)


def format_facts(alpha: float, c: float, k: int, measured_on: str = "float32") -> dict[str, str]:
    """The pays step's words on weight formats, from the shipped r(n) study (engine.bench.formats): a verify of
    K + 1 tokens with fp32, int8 and int4 weights, and the best K under each curve at this run's α and c (c measured
    against a step in format `measured_on`, carried to each curve's own step: `draft_share`); and the same for
    llama.cpp's own forward on the Q4_1 file where the study has it, beside int4's one-token step."""
    from engine.bench.formats import curve_of, draft_share, shipped_study

    study = shipped_study()
    facts = dict(k1=str(k + 1), formats_machine=study.machine if study is not None else
                 "no machine (the measurement is missing)")
    for name, dtype in (("fp32", "float32"), ("int8", "int8"), ("int4", "int4"), ("llamacpp_q4", "llama.cpp Q4_1")):
        curve = curve_of(study, dtype) if study is not None else None
        facts[f"{name}_r"] = _num(curve.at(k + 1), 2) if curve is not None else "—"
        facts[f"best_{name}"] = str(metrics.best_k(alpha, draft_share(study, c, measured_on, curve), curve.at)) \
            if curve is not None else "—"
        if name in ("int4", "llamacpp_q4"):
            facts[f"{name}_step"] = _num(curve.step_ms, 1) if curve is not None else "—"
    return facts


def cost_claim(tokens: int, ratio: float) -> str:
    """What the measured verify/step ratio says, as a sentence (the lesson's text and its cost chart both
    read it, so neither claims what the bars beside it contradict)."""
    if not ratio == ratio:   # NaN: no target-only step measured yet
        return f"Verifying {tokens} tokens has not been compared with one step yet"
    if ratio < 0.8:
        return (f"Verifying {tokens} tokens costs {ratio:.1f}× one step, less than one step, which reading the "
                "weights once cannot explain: the one-token steps measured here were slowed by something else "
                "(another job on this machine, or a slower kernel for one row)")
    if ratio <= 1.3:
        return (f"Verifying {tokens} tokens costs {ratio:.1f}× one step: about one step, since the weights "
                "are read once for all of them")
    return (f"Verifying {tokens} tokens costs {ratio:.1f}× one step, not about 1×: on this CPU the small matrix "
            f"products are compute-bound, so every round pays {ratio:.1f} steps for its verify and the speed-up "
            "shrinks by as much")


def separation(q_draft: Tensor, p_target: Tensor, rule: Rule) -> float:
    """Expected chi-square excess per simulated round: sum_i reach_i * sum_t (r_i - p_i)^2 / p_i.

    Times N rounds it is the non-centrality of the lab's chi-square tests, i.e. how visibly the
    rule fails with N rounds (0 for the correct rule; inf if the rule emits a token p forbids).
    """
    out = rule_output(q_draft, p_target, rule)
    p = p_target.double().cpu()
    if bool(((p == 0) & (out.dist > 0) & (out.reach.unsqueeze(-1) > 0)).any()):
        return float("inf")
    safe = torch.where(p > 0, p, 1.0)
    per_index = torch.where(p > 0, (out.dist - p) ** 2 / safe, 0.0).sum(dim=-1)
    return float((out.reach * per_index).sum())


WRONG_RULES = (Rule.DISCARD_ON_REJECT, Rule.BONUS_FROM_ROW_K_MINUS_1, Rule.CORRECTION_FROM_P)


def best_window(rows: RoundRows, rules: tuple[Rule, ...] = WRONG_RULES) -> tuple[int, int]:
    """(start, length): the run of drafts whose rows make every wrong rule fail most visibly.

    Verifying drafts start..start+length-1 alone uses q rows start.. and p rows start..start+length
    (causal attention: those rows do not depend on later drafts), i.e. the round as seen once the
    first `start` drafts were accepted. Picks the window maximising the smallest separation over
    `rules`; ties go to the earliest, shortest window.
    """
    k = len(rows.drafted)
    best, best_score = (0, 1), -1.0
    for start in range(k):
        for length in range(1, k - start + 1):
            q, p = window(rows, start, length)
            score = min(separation(q, p, r) for r in rules)
            if score > best_score:
                best, best_score = (start, length), score
    return best


def window(rows: RoundRows, start: int, length: int) -> tuple[Tensor, Tensor]:
    """(q_draft[length, V], p_target[length+1, V]) for verifying drafts start..start+length-1 alone."""
    k = len(rows.drafted)
    if not (0 <= start < k and 1 <= length <= k - start):
        raise ValueError(f"window start={start}, length={length} does not fit a round with K={k}")
    return rows.q_draft[start:start + length], rows.p_target[start:start + length + 1]

"""Which drafter and K a visitor starts with, measured on the machine that serves them: a quick calibration.

Acceptance belongs to the model pair and the sampling, but what a round costs belongs to the CPU: a verify of
five rows costs 1.15 target steps on an AMD EPYC and 1.37 on an Intel Xeon with AMX, and the EAGLE head's
step costs differently again. A default read off one machine's bench can lose on another. So every candidate
(drafter, K) decodes the same few held-out prompts at the model card's sampling, each prompt beside a
target-only decode of it, in a rotating order; the candidate with the most tokens per second of engine time
over target-only is the default when it beats target-only (the project's bench default stays when it is within
TIE of the fastest: a few prompts cannot tell such candidates apart), and when none beats target-only the pick
says so and why, in α, c and r. The result is kept per CPU model, model and sampling under the cache, so a
machine measures once.

The clock counts the engine's rounds (`RoundRecord.elapsed_s`, as `metrics.tokens_per_s`): a run may wait
between rounds for a visitor's round (the compute gate), and that wait is not the candidate's.
"""
from __future__ import annotations

import json
import os
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from engine import metrics
from engine.clock import ComputeGate, in_turn
from engine.config import DrafterKind, SpecConfig
from engine.pair import ModelPair
from engine.sampling import SamplingParams
from engine.sources import cache_root

PICK_FORMAT = 7     # 7: a chain's verdict in one compiled call (engine/native/nucleus.cpp), about 0.5 ms less a
                    # speculative round at T > 0; 6: top-p in one compiled pass a row (nucleus.cpp) and no full
                    # collection inside a run (engine.clock.settle_heap): a round at T > 0 spends less outside its
                    # forwards; 5: the layers' norms and gates in one pass (engine/native/pointwise.cpp), a step a
                    # quarter shorter, so a verify's rows cost more steps; 4: 8 prompts a candidate; 3: fp32
                    # products from a GGUF's codes (CodedWeights); 2: layers and the head's step in C++
                    # (engine.native); 1 weighed c and r otherwise
NEW_TOKENS = 48
TIE = 0.10          # a candidate this close to the fastest is as fast, as far as a pick of a few prompts can tell
SLIM = 1.2          # a winner below this speed-up is explained too: α, c and r say why it is not more


class PickStopped(Exception):
    """The measurement was asked to stop before it finished."""


@dataclass(frozen=True, slots=True)
class Candidate:
    drafter: str     # a DrafterKind value
    k: int

    @property
    def label(self) -> str:
        return f"{self.drafter}, K={self.k}"


@dataclass(frozen=True, slots=True)
class Tried:
    """One candidate's figures over the pick's prompts."""

    candidate: Candidate
    tokens_per_s: float
    speedup: float               # over target-only on the same prompts: tokens per second of engine time
    alpha: float | None          # accepted / verified positions
    c: float | None              # median draft forward / median target-only step
    r: float | None              # median verify forward / median target-only step


@dataclass(frozen=True, slots=True)
class Pick:
    cpu: str
    model: str
    weights: str
    temperature: float
    top_p: float
    prompts: int
    new_tokens: int
    target_tokens_per_s: float
    tried: tuple[Tried, ...]
    preferred: Candidate | None = None   # the project's bench default for the pair: kept when it is as good

    @property
    def best(self) -> Tried:
        return max(self.tried, key=lambda t: t.speedup)

    @property
    def winner(self) -> Tried:
        """The fastest candidate, or the preferred one when it is within TIE of it: a quick measurement of a
        few prompts cannot tell apart what the longer bench measured apart."""
        kept = next((t for t in self.tried if t.candidate == self.preferred), None)
        if kept is not None and kept.speedup > 1.0 and kept.speedup >= self.best.speedup * (1 - TIE):
            return kept
        return self.best

    @property
    def chosen(self) -> Candidate | None:
        """The winner when it beat target-only, else None (target-only is faster here)."""
        return self.winner.candidate if self.winner.speedup > 1.0 else None

    def explain(self) -> str:
        """What the pick found, in a sentence or two: the winner and its margin (and why, when it is below SLIM),
        or why nothing won."""
        b = self.winner
        where = f"on this CPU ({self.cpu})"
        figures = ", ".join(f"{name} {value:{form}}" for name, value, form in
                            (("α", b.alpha, ".2f"), ("c", b.c, ".3f"), ("r(K+1)", b.r, ".2f")) if value is not None)
        if self.chosen is not None:
            among = (f"the fastest of {len(self.tried)} candidates" if b is self.best else
                     f"the fastest, {self.best.candidate.label} at {self.best.speedup:.2f}×, is within {TIE:.0%}, so "
                     "the bench default stays")
            said = (f"Measured {where}: {b.candidate.label} decoded {b.speedup:.2f}× as fast as target-only "
                    f"({self.prompts} prompts, T = {self.temperature:g}); {among}.")
            if b.speedup < SLIM and figures:
                said += (f" A slim margin ({figures}): a round's accepted tokens pay for little more than its draft "
                         "and its verify of K + 1 rows, which costs r(K+1) target steps here.")
            return said
        return (f"No drafter beat target-only {where} at T = {self.temperature:g}: the best, {b.candidate.label}, "
                f"decoded {b.speedup:.2f}× ({figures}). A round here yields too few accepted tokens for what "
                "its draft and its verify forward cost in target steps; speculation pays where α is higher or "
                "a verify of several rows costs nearer one step.")


def candidates_for(has_draft: bool, has_eagle: bool) -> tuple[Candidate, ...]:
    """What a pair can draft with, at the Ks that have won somewhere (K above 4 never won on a CPU here)."""
    out = []
    if has_eagle:
        out += [Candidate(DrafterKind.EAGLE_HYBRID.value, k) for k in (1, 2, 3, 4)]
        out += [Candidate(DrafterKind.EAGLE.value, 2)]
    if has_draft:
        out += [Candidate(DrafterKind.HYBRID.value, k) for k in (2, 4)] + [Candidate(DrafterKind.MODEL.value, 4)]
    out += [Candidate(DrafterKind.NGRAM.value, k) for k in (2, 4)]
    return tuple(out)


def measure_pick(pair: ModelPair, prompts: Sequence[list[int]], candidates: Sequence[Candidate],
                 sampling: SamplingParams, cpu: str, *, preferred: Candidate | None = None,
                 new_tokens: int = NEW_TOKENS, gate: ComputeGate | None = None, stop: threading.Event | None = None,
                 progress: Callable[[int, int], None] | None = None) -> Pick:
    """Decode every prompt with target-only and every candidate (a rotating order per prompt, one warm-up
    round each first) and compare their tokens per second of engine time. Each round holds `gate`, so a
    visitor's round never shares the cores with one of these; `stop` ends the measurement (PickStopped)."""
    from engine.speculative import SpeculativeEngine

    if not candidates or not prompts:
        raise ValueError("a pick needs at least one candidate and one prompt")
    runs = [None, *candidates]                  # None: target-only
    rounds: dict[Candidate | None, list] = {c: [] for c in runs}
    total, done = len(prompts) * len(runs), 0

    def decode(candidate: Candidate | None, ids: list[int], tokens: int) -> list:
        config = SpecConfig(mode="target" if candidate is None else "v2",
                            drafter=candidate.drafter if candidate else DrafterKind.MODEL,
                            k=candidate.k if candidate else 1, sampling=sampling, max_new_tokens=tokens,
                            stop_at_eos=False, record=False)
        engine = in_turn(gate, lambda: SpeculativeEngine(pair, ids, config))   # its prefill
        try:
            while not engine.finished:
                if stop is not None and stop.is_set():
                    raise PickStopped()
                in_turn(gate, engine.step)
            return list(engine.rounds)
        finally:
            engine.close()

    for candidate in runs:                      # a warm-up of each: a drafter's first rounds build its kernels
        decode(candidate, list(prompts[0]), 4)
    for i, ids in enumerate(prompts):
        shift = i % len(runs)
        for candidate in runs[shift:] + runs[:shift]:
            rounds[candidate].append(decode(candidate, list(ids), new_tokens))
            done += 1
            if progress is not None:
                progress(done, total)
    base = [r for run in rounds[None] for r in run]
    base_rate = _rate(rounds[None])
    tried = []
    for candidate in candidates:
        flat = [r for run in rounds[candidate] for r in run]
        tally = metrics.Tally.of(flat, base)
        rate = _rate(rounds[candidate])
        tried.append(Tried(candidate, rate, rate / base_rate, tally.alpha(), tally.cost_ratio(),
                           metrics.verify_ratio(flat, base)))
    return Pick(cpu, pair.target.name, pair.target.weights, sampling.temperature, sampling.top_p, len(prompts),
                new_tokens, base_rate, tuple(tried), preferred)


def _rate(runs: list[list]) -> float:
    """Generated tokens over the engine's time for them (prefill included), over all runs."""
    tokens = sum(run[-1].tokens_total for run in runs if run)
    seconds = sum(run[-1].elapsed_s for run in runs if run)
    return tokens / seconds if seconds > 0 else 0.0


# -- kept per CPU -----------------------------------------------------------------------------------------
def _store(cpu: str) -> Path:
    slug = "".join(ch if ch.isalnum() else "-" for ch in cpu.lower()).strip("-")[:120] or "unknown-cpu"
    return cache_root() / "picks" / f"{slug}.json"


def _key(model: str, weights: str, sampling: SamplingParams, candidates: Sequence[Candidate],
         preferred: Candidate | None) -> str:
    return json.dumps([PICK_FORMAT, model, weights, sampling.temperature, sampling.top_p,
                       [asdict(c) for c in candidates], asdict(preferred) if preferred else None])


def load_pick(cpu: str, model: str, weights: str, sampling: SamplingParams, candidates: Sequence[Candidate],
              preferred: Candidate | None = None) -> Pick | None:
    """The pick kept for this CPU, model, weights, sampling, candidates and preferred one, or None (never
    measured, or a file that does not read: it is measured again)."""
    try:
        kept = json.loads(_store(cpu).read_text())[_key(model, weights, sampling, candidates, preferred)]
        tried = tuple(Tried(Candidate(**t.pop("candidate")), **t) for t in kept.pop("tried"))
        preferred = kept.pop("preferred")
        return Pick(**kept, tried=tried, preferred=Candidate(**preferred) if preferred else None)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def save_pick(pick: Pick, sampling: SamplingParams, candidates: Sequence[Candidate]) -> None:
    """Keep `pick` beside the others of its CPU (written whole, then renamed into place)."""
    path = _store(pick.cpu)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        kept = json.loads(path.read_text())
        kept = kept if isinstance(kept, dict) else {}
    except (OSError, ValueError):
        kept = {}
    kept[_key(pick.model, pick.weights, sampling, candidates, pick.preferred)] = asdict(pick)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "w") as f:
        json.dump(kept, f, indent=1)
    os.replace(tmp, path)

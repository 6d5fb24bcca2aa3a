"""Metrics: every measure read off round records, and the speed-up model they feed.

Notation. K drafts per round. The *draft acceptance rate* is accepted / drafted (vLLM's and the
seed system's figure). Leviathan et al.'s alpha is something else: the probability that a *verified*
position is accepted, accepted / verified positions, where a round verifies every position up to
and including its first rejection. Under i.i.d. acceptance, accepted / drafted =
alpha (1 - alpha^K) / (K (1 - alpha)), which is well below alpha at large K; fed to E(alpha, K) it
under-predicts. c is one draft forward over one target decode step; r(n) is the target's forward
over n new tokens over one (a verify of K drafts feeds n = K + 1), measured, never assumed.

Round 0 of every run is the prefill: its forward covers the prompt, so it is left out of every
per-step cost (`decode_rounds`).
"""
from __future__ import annotations

import math
import statistics
from bisect import insort
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from engine.config import DrafterKind, Mode
from engine.records import RoundRecord, RunSummary

Rounds = Sequence[RoundRecord]
# Speed-ups within this relative distance of the maximum count as ties, won by the smaller K: with
# c = 0 the curve creeps up by ~1e-16 per K once alpha^K underflows the sum, and drafting 16 tokens
# for a gain nobody can measure is not a recommendation.
TIE_RTOL = 1e-9
# verify forwards of n rows a run needs before its prediction reads r(n) from them rather than from the calibration:
# the app's quick calibration, a minute before on the same machine, read r(3) 1.03-1.22 in four runs where the
# rounds' own verify forwards gave 1.26-1.40 (SmolLM2, AVX2 EPYC; docs/performance.md); a run's own forwards are
# timed beside its target-only steps, under the same load
OWN_R_LEAST = 3


def median(xs: Sequence[float], default: float = math.nan) -> float:
    """The median, or `default` for an empty sequence."""
    return statistics.median(xs) if xs else default


def decode_rounds(rounds: Rounds) -> list[RoundRecord]:
    """The rounds after the prefill round: the ones whose timings are decode steps."""
    return [r for r in rounds if not r.is_prefill]


def drafted_rounds(rounds: Rounds) -> list[RoundRecord]:
    return [r for r in rounds if r.k > 0]


# -- acceptance -----------------------------------------------------------------------------------
def acceptance_rate(accepted: int, drafted: int) -> float:
    """Draft acceptance rate: accepted / drafted; 0.0 when nothing was drafted."""
    if drafted < 0 or accepted < 0 or accepted > drafted:
        raise ValueError(f"need 0 <= accepted <= drafted, got accepted={accepted}, drafted={drafted}")
    return accepted / drafted if drafted else 0.0


def alpha_rate(accepted: int, verified: int) -> float:
    """Per-position acceptance alpha: accepted / verified positions; 0.0 when nothing was verified."""
    if verified < 0 or accepted < 0 or accepted > verified:
        raise ValueError(f"need 0 <= accepted <= verified, got accepted={accepted}, verified={verified}")
    return accepted / verified if verified else 0.0


def draft_acceptance(rounds: Rounds) -> float | None:
    """Accepted / drafted over the rounds; None when nothing was drafted."""
    drafted = sum(r.k for r in rounds)
    return acceptance_rate(sum(r.accepted for r in rounds), drafted) if drafted else None


def alpha(rounds: Rounds) -> float | None:
    """Accepted / verified positions over the rounds; None when nothing was verified."""
    verified = sum(r.verified for r in rounds)
    return alpha_rate(sum(r.accepted for r in rounds), verified) if verified else None


def prompt_counts(rounds: Rounds) -> tuple[int, int]:
    """(accepted, verified positions) over one prompt's drafted rounds: what `alpha_interval` resamples."""
    drafted = drafted_rounds(rounds)
    return sum(r.accepted for r in drafted), sum(r.verified for r in drafted)


def wilson_interval(successes: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson's score interval for a proportion (z = 1.96: 95%); (0, 1) without trials."""
    if trials <= 0:
        return 0.0, 1.0
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    return max(0.0, centre - half), min(1.0, centre + half)


def alpha_interval(counts: Sequence[Sequence[int]], against: Sequence[Sequence[int]] | None = None,
                   level: float = 0.95, draws: int = 4000, seed: int = 0) -> tuple[float, float, float]:
    """Alpha over prompts, (accepted, verified) per prompt, as accepted / verified summed over them, and the
    percentile bootstrap interval at `level` with the prompts resampled: how far the figure could move on
    another draw of prompts like these. With `against` (another head's counts on the same prompts, in the same
    order): alpha - alpha_against, the prompts resampled in pairs, so that what both heads find hard on a prompt
    cancels. Greedy alpha is deterministic given the prompts, so the prompts are the only chance in it."""
    import random

    if against is not None and len(against) != len(counts):
        raise ValueError(f"paired counts need the same prompts: {len(counts)} against {len(against)}")
    if not counts or not 0 < level < 1 or draws < 1:
        raise ValueError("alpha_interval needs at least one prompt, 0 < level < 1 and draws >= 1")
    pairs = [(a, v, *(against[i] if against is not None else (0, 0))) for i, (a, v) in enumerate(counts)]

    def value(sample: Sequence[tuple[int, int, int, int]]) -> float:
        verified, other = sum(p[1] for p in sample), sum(p[3] for p in sample)
        mine = sum(p[0] for p in sample) / verified if verified else 0.0
        return mine - (sum(p[2] for p in sample) / other if other else 0.0) if against is not None else mine

    rng = random.Random(seed)
    spread = sorted(value(rng.choices(pairs, k=len(pairs))) for _ in range(draws))
    tail = (1 - level) / 2
    return value(pairs), spread[int(tail * (draws - 1))], spread[math.ceil((1 - tail) * (draws - 1))]


def running_acceptance(rounds: Rounds) -> tuple[list[float | None], list[float | None]]:
    """(draft_acceptance, alpha) over rounds[:i + 1] for each i: the cumulative curves the charts draw."""
    drafted_rates, alphas = [], []
    accepted = drafted = verified = 0
    for r in rounds:
        accepted, drafted, verified = accepted + r.accepted, drafted + r.k, verified + r.verified
        drafted_rates.append(acceptance_rate(accepted, drafted) if drafted else None)
        alphas.append(alpha_rate(accepted, verified) if verified else None)
    return drafted_rates, alphas


def tokens_per_round(rounds: Rounds) -> float | None:
    """Tokens emitted per drafted round (the correction or bonus included): the quantity Leviathan's
    E(alpha, K) predicts, the literature's tau. The prefill, and rounds that drafted nothing (a target-only
    step when prompt lookup found no match), are left out. None when no round drafted. Every screen
    that shows "tokens per round" shows this."""
    drafted = drafted_rounds(rounds)
    return sum(len(r.emitted) for r in drafted) / len(drafted) if drafted else None


def mean_accepted_length(tokens_per_round: Sequence[int]) -> float:
    """Mean tokens emitted per round, counting the correction or bonus (so >= 1 for real rounds).

    This is the "tau" / mean accepted length of the literature; 0.0 for no rounds.
    """
    if any(n < 0 for n in tokens_per_round):
        raise ValueError(f"tokens per round must be >= 0, got {list(tokens_per_round)}")
    return sum(tokens_per_round) / len(tokens_per_round) if tokens_per_round else 0.0


def per_position_acceptance(rounds: Sequence[Sequence[bool]], k_max: int) -> list[float]:
    """Acceptance rate at each draft position 0..k_max-1.

    rounds: per round, the accept results of the positions that were verified, in order (a round
    stops at its first rejection, so a False can only be last). Position i's rate counts only
    rounds that verified position i: a position never reached after an earlier rejection is
    neither an accept nor a reject there. A position no round verified gets NaN (unknown), not 0.
    """
    if k_max < 1:
        raise ValueError(f"k_max must be >= 1, got {k_max}")
    for n, checks in enumerate(rounds):
        if len(checks) > k_max:
            raise ValueError(f"round {n} checked {len(checks)} positions, more than k_max={k_max}")
        if not all(checks[:-1]):
            raise ValueError(f"round {n} checks positions after a rejection: {list(checks)}")
    rates = []
    for i in range(k_max):
        outcomes = [bool(checks[i]) for checks in rounds if len(checks) > i]
        rates.append(sum(outcomes) / len(outcomes) if outcomes else math.nan)
    return rates


def position_rates(rounds: Rounds) -> list[float]:
    """Per-position acceptance over the drafted rounds, positions 0..K_max-1 (NaN where none verified)."""
    drafted = drafted_rounds(rounds)
    if not drafted:
        return []
    return per_position_acceptance([r.checks() for r in drafted], max(r.depth for r in drafted))


def accepted_at_positions(rounds: Rounds, k: int) -> list[float]:
    """vLLM's per-position rate over the drafted rounds: at position i (0-based, i < k), the share of all
    drafted rounds that accepted a draft there (its counter accepted_tokens_per_pos[i] over num_drafts).
    Unconditional, unlike `position_rates`: a round rejected earlier counts as a miss at i. [] when no
    round drafted."""
    drafted = drafted_rounds(rounds)
    if not drafted:
        return []
    return [sum(r.accepted > i for r in drafted) / len(drafted) for i in range(k)]


def conditional_rates(unconditional: Sequence[float]) -> list[float]:
    """Per-position rates given the position before was accepted, from unconditional ones (accepted at i
    over every draft, as vLLM counts): a_i = u_i / u_{i-1}. NaN after a position never accepted."""
    rates, reached = [], 1.0
    for u in unconditional:
        rates.append(u / reached if reached > 0 else math.nan)
        reached = u
    return rates


def mean_k(rounds: Rounds) -> int | None:
    """The drafted rounds' mean K, rounded (at least 1); None when no round drafted."""
    drafted = drafted_rounds(rounds)
    return max(1, round(sum(r.k for r in drafted) / len(drafted))) if drafted else None


# -- the speed-up model ---------------------------------------------------------------------------
def _check_alpha_k(alpha: float, k: int) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")


def expected_tokens_per_round(alpha: float, k: int) -> float:
    """E[tokens per round] = (1 - alpha^(K+1)) / (1 - alpha); K+1 in the limit alpha -> 1.

    Position i (0-based) is reached with probability alpha^i and every round emits one final
    token, so E = sum_{i=0..K} alpha^i. Summing the series directly equals the closed form and
    stays exact at alpha = 1 and numerically stable near it.
    """
    _check_alpha_k(alpha, k)
    return math.fsum(alpha**i for i in range(k + 1))


def expected_tokens_from_rates(rates: Sequence[float], k: int) -> float:
    """E[tokens per round] at K from measured per-position rates, with no i.i.d. assumption:
    E = 1 + sum_{i<K} prod_{j<=i} a_j. A position without a measured rate (NaN, or beyond the
    list) takes the last measured one."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    known = [a for a in rates if math.isfinite(a)]
    if not known:
        raise ValueError("no measured per-position rate")
    if any(not 0.0 <= a <= 1.0 for a in known):
        raise ValueError(f"per-position rates must lie in [0, 1], got {list(rates)}")
    total, reach, last = 1.0, 1.0, known[0]
    for i in range(k):
        a = rates[i] if i < len(rates) and math.isfinite(rates[i]) else last
        last = a
        reach *= a
        total += reach
    return total


def predicted_speedup(alpha: float, k: int, c: float, r: float, r_commit: float = 0.0) -> float:
    """Walltime speed-up over target-only decoding: E(alpha, K) / (cK + r) (Leviathan et al. 2023).

    One round costs K draft forwards (c each) plus one verify forward over K + 1 tokens (r of a
    one-token step) and yields E tokens; plain decoding pays 1 per token. `r_commit`: a second target
    forward each round costs this much more (v1 verifies without writing, then commits the accepted
    tokens' K/V in a forward of its own: `commit_rows`).
    """
    _check_alpha_k(alpha, k)
    return _speedup(expected_tokens_per_round(alpha, k), k, c, r + r_commit)


def formula_text(commit: bool = False) -> str:
    """The speed-up formula as a page writes it; with `commit`, v1's second forward over the round's tokens."""
    return "E(α, K) / (cK + r(K+1) + r(E))" if commit else "E(α, K) / (cK + r(K+1))"


def commit_rows(tokens: float) -> int:
    """The rows of v1's commit forward for a round expected to emit `tokens` (the last committed token and the
    accepted drafts: as many as the round emits, its new final token being fed by the next round)."""
    return max(1, round(tokens))


def commit_cost(alpha: float, k: int, r_of_n: Callable[[int], float], commit: bool) -> float:
    """A round's commit forward in target steps at K drafts and `alpha` with `commit` (v1), else 0 (v2)."""
    return r_of_n(commit_rows(expected_tokens_per_round(alpha, k))) if commit else 0.0


def _speedup(tokens: float, draft_forwards: float, c: float, r: float) -> float:
    if not (math.isfinite(c) and c >= 0):
        raise ValueError(f"c (draft/target cost ratio) must be finite and >= 0, got {c}")
    if not (math.isfinite(r) and r > 0):
        raise ValueError(f"r (verify cost relative to one target forward) must be finite and > 0, got {r}")
    return tokens / (c * draft_forwards + r)


def speedup_curve(alpha: float, c: float, r_of_n: Callable[[int], float], k_max: int,
                  commit: bool = False) -> list[float]:
    """predicted_speedup for K = 1..k_max, the verify cost at K being r_of_n(K + 1); with `commit` (v1), each
    round's second forward too, over `commit_rows` of its expected tokens."""
    return [predicted_speedup(alpha, k, c, r_of_n(k + 1), commit_cost(alpha, k, r_of_n, commit))
            for k in range(1, k_max + 1)]


def best_k(alpha: float, c: float, r_of_n: Callable[[int], float] | float = 1.0, k_max: int = 16,
           commit: bool = False) -> int:
    """The K in 1..k_max with the highest predicted speed-up; ties within TIE_RTOL go to the smaller K.

    r_of_n: the target's forward over n tokens relative to one (a verify of K drafts is n = K + 1),
    constant or measured (`calibration.RCurve.at`). On a GPU r stays near 1 while the target is
    memory-bound; on a CPU it grows with n and pulls the best K down. `commit`: v1's second forward
    (`speedup_curve`).
    """
    if isinstance(k_max, bool) or not isinstance(k_max, int) or k_max < 1:
        raise ValueError(f"k_max must be an int >= 1, got {k_max!r}")
    r_at = r_of_n if callable(r_of_n) else (lambda _n: r_of_n)
    curve = speedup_curve(alpha, c, r_at, k_max, commit)
    top = max(curve)
    return 1 + next(i for i, s in enumerate(curve) if s >= top * (1 - TIE_RTOL))


# -- costs and throughput, measured ----------------------------------------------------------------
def target_step_ms(baseline: Rounds) -> float | None:
    """Median one-token target forward of a target-only run (its prefill round left out)."""
    return Tally.of(baseline=baseline).target_step_ms()


def draft_forward_ms(rounds: Rounds) -> float | None:
    """Median draft-model forward over the decode rounds; None when no draft forward ran."""
    return Tally.of(rounds).draft_forward_ms()


def cost_ratio(rounds: Rounds, baseline: Rounds) -> float | None:
    """c = median draft forward / median target-only step, both measured in this run. 0 for rounds
    that drafted without a model (prompt lookup); None until both sides have a timed step."""
    return Tally.of(rounds, baseline).cost_ratio()


def verify_ratio(rounds: Rounds, baseline: Rounds) -> float | None:
    """r as a run measures it inside its rounds: the median verify forward of the drafted decode rounds over
    the median target-only step of its baseline. None until both are measured."""
    step = target_step_ms(baseline)
    verify = [r.timings.target_forward_ms for r in decode_rounds(rounds) if r.k]
    return median(verify) / step if step and verify else None


def tokens_per_s(rounds: Rounds) -> float | None:
    """Generated tokens over decode time (prefill included) after the last of `rounds`."""
    if not rounds or rounds[-1].elapsed_s <= 0:
        return None
    return rounds[-1].tokens_total / rounds[-1].elapsed_s


def measured_speedup(rounds: Rounds, baseline: Rounds) -> float | None:
    """Speculative over target-only throughput, the baseline measured up to the speculative run's token
    count (a time ratio at equal tokens; a sampled baseline may stop early at its own EOS)."""
    spec, base = tokens_per_s(rounds), tokens_per_s(baseline)
    return None if spec is None or base is None or base <= 0 else spec / base


def decode_tokens_per_s(rounds: Rounds) -> float | None:
    """Tokens after the prefill round over the time after it: decoding alone, which speculation changes and
    the prediction speaks of (both runs' prefill is one forward over the same prompt). None before a decode round."""
    if len(rounds) < 2 or not rounds[0].is_prefill:
        return None
    first, last = rounds[0], rounds[-1]
    tokens, seconds = last.tokens_total - first.tokens_total, last.elapsed_s - first.elapsed_s
    return tokens / seconds if tokens > 0 and seconds > 0 else None


def decode_speedup(rounds: Rounds, baseline: Rounds) -> float | None:
    """`measured_speedup` after each run's prefill round: what Leviathan's formula predicts, as the bench's
    decode speed-up (the prefill, which no drafter changes, is the tokens/s figures')."""
    spec, base = decode_tokens_per_s(rounds), decode_tokens_per_s(baseline)
    return None if spec is None or base is None else spec / base


def finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


# -- the prediction for a run ---------------------------------------------------------------------------
def predicted_over_rounds(tokens_at: Callable[[int], float], rounds_k: Sequence[int], draft_forwards: Sequence[int],
                          c: float, r_of_n: Callable[[int], float], depths: Sequence[int] | None = None,
                          commit: bool = False) -> float:
    """Leviathan's speed-up for rounds of varying K: sum of E(k_i) over sum of (c f_i + r(k_i + 1)).

    tokens_at(k): the expected tokens of a round that drafted k (E(alpha, k), or from per-position
    rates); a round that drafted nothing yields 1 token for one plain step. f_i: the draft-model
    forwards the round really ran (a copied hybrid round runs none). With a constant K this is
    exactly E(K) / (cK + r(K + 1)). A tree round of N nodes verifies N + 1 rows and can accept as many
    tokens as it is deep: `depths[i]` (default: rounds_k[i]) is what tokens_at is asked about. `commit`: every
    round also runs v1's commit forward over `commit_rows` of its expected tokens.
    """
    tokens, cost = formula_terms(tokens_at, rounds_k, draft_forwards, c, r_of_n, depths, commit)
    return tokens / cost if cost > 0 else math.nan


def formula_terms(tokens_at: Callable[[int], float], rounds_k: Sequence[int], draft_forwards: Sequence[int],
                  c: float, r_of_n: Callable[[int], float], depths: Sequence[int] | None = None,
                  commit: bool = False) -> tuple[float, float]:
    """(the tokens the rounds are expected to yield, what they cost in target steps): the numerator and the
    denominator of `predicted_over_rounds`, for the bench to say which of the two a measurement departs from."""
    depths = rounds_k if depths is None else depths
    if len(rounds_k) != len(draft_forwards) or len(rounds_k) != len(depths):
        raise ValueError(f"one draft-forward count and one depth per round: {len(rounds_k)} rounds, "
                         f"{len(draft_forwards)} counts, {len(depths)} depths")
    return _mix_terms(tokens_at, Counter(zip(rounds_k, depths)), sum(draft_forwards), c, r_of_n, commit)


@dataclass(frozen=True, slots=True)
class PredictionGap:
    """measured/predicted as a product of factors, each read from the same runs:
    tokens × verify × rest. `tokens`: the tokens the rounds yielded over those E(alpha, k_i) expects (the
    i.i.d. acceptance model); `verify`: the formula's cost in target steps with the calibrated r(K + 1) over
    its cost with the r the rounds' own verify forwards measured; `rest`: what the formula leaves out (time
    outside the forwards, against the target-only baseline's own)."""

    tokens: float
    verify: float
    rest: float


def gap_factors(tokens_at: Callable[[int], float], rounds_k: Sequence[int], draft_forwards: Sequence[int], c: float,
                r_of_n: Callable[[int], float], r_run: Callable[[int], float], depths: Sequence[int],
                yielded: int, commit: bool = False) -> tuple[float, float]:
    """PredictionGap's first two factors: the `yielded` tokens over those the formula expects of the rounds, and
    the formula's cost with `r_of_n` (calibrated) over its cost with `r_run` (the rounds' own verify forwards)."""
    tokens, cost = formula_terms(tokens_at, rounds_k, draft_forwards, c, r_of_n, depths, commit)
    _, cost_run = formula_terms(tokens_at, rounds_k, draft_forwards, c, r_run, depths, commit)
    return yielded / tokens, cost / cost_run


def prediction_gap(rounds: Rounds, baseline: Rounds, r_of_n: Callable[[int], float] | None) -> PredictionGap | None:
    """A run's measured / predicted speed-up (`decode_speedup` over Leviathan's, from the run's α, c and r(n) as
    `Tally.r_used` reads it, `r_of_n` being the calibration) taken apart as PredictionGap: whether the rounds yielded
    fewer tokens than E(α, K) expects, whether their verify forwards cost more than the r the prediction read
    (the calibration's, where the run has too few forwards of its own), or whether the time went outside the
    forwards (sampling over the vocabulary, the drafters' bookkeeping). None until all is measured."""
    tally = Tally.of(rounds, baseline)
    predicted, measured = tally.speedup_iid(r_of_n), decode_speedup(rounds, baseline)
    step, a, c, used = tally.target_step_ms(), tally.alpha(), tally.cost_ratio(), tally.r_used(r_of_n)
    decode = decode_rounds(rounds)
    if not predicted or not measured or not step or a is None or c is None or used is None or not decode:
        return None
    r_run = {n: tally.own_r(n, least=1) for n in tally.verify_ms}
    tokens, verify = gap_factors(lambda k: expected_tokens_per_round(a, k), [r.k for r in decode],
                                 [r.draft_forwards for r in decode], c, used, lambda n: r_run.get(n, used(n)),
                                 [r.depth for r in decode], sum(len(r.emitted) for r in decode), tally.commit)
    return PredictionGap(tokens, verify, measured / predicted / (tokens * verify))


def _over_mix(tokens_at: Callable[[int], float], rounds_by: Mapping[tuple[int, int], int], draft_forwards: int,
              c: float, r_of_n: Callable[[int], float], commit: bool = False) -> float:
    tokens, cost = _mix_terms(tokens_at, rounds_by, draft_forwards, c, r_of_n, commit)
    return tokens / cost if cost > 0 else math.nan


def _mix_terms(tokens_at: Callable[[int], float], rounds_by: Mapping[tuple[int, int], int], draft_forwards: int,
               c: float, r_of_n: Callable[[int], float], commit: bool = False) -> tuple[float, float]:
    """The formula's two sums from the number of rounds at each (K, depth) and the draft forwards of them
    all: they depend on nothing else, so they need not be taken round by round. A round's tokens
    follow its depth (a chain's K, a tree's deepest node); its verify cost its width K + 1; with `commit`
    (v1) every round, one that drafted nothing too, pays a second forward over `commit_rows` of its tokens."""
    def expected(k: int, d: int) -> float:
        return tokens_at(d) if k else 1.0

    tokens = math.fsum(n * expected(k, d) for (k, d), n in rounds_by.items())
    cost = c * draft_forwards + math.fsum(n * ((r_of_n(k + 1) if k else 1.0)
                                              + (r_of_n(commit_rows(expected(k, d))) if commit else 0.0))
                                          for (k, d), n in rounds_by.items())
    return tokens, cost


# -- running sums: a measure after every round ---------------------------------------------------------
@dataclass(slots=True)
class Tally:
    """Running sums over a run's rounds, taken in order, and over its target-only baseline: what c and
    Leviathan's prediction read. Adding a round costs O(K) (and a sorted insert per timing, for the
    medians), so the prediction after every round of a run costs O(rounds · K) in all, where reading
    each prefix again would cost O(rounds²)."""

    accepted: int = 0        # over the drafted decode rounds: drafts accepted,
    verified: int = 0        # and positions verified
    rounds_by: Counter[tuple[int, int]] = field(default_factory=Counter)  # decode rounds by (K drafted, depth)
    draft_forwards: int = 0  # draft-model forwards the decode rounds ran
    draft_ms: list[float] = field(default_factory=list)  # the decode rounds' draft forwards, ms, ascending
    step_ms: list[float] = field(default_factory=list)   # the baseline's decode steps, ms, ascending
    verify_ms: dict[int, list[float]] = field(default_factory=dict)   # the drafted decode rounds' verify forwards,
                                                                      # by rows verified (K + 1), ms, ascending
    drafted: bool = False           # some round, the prefill's included, drafted
    draft_model_ran: bool = False   # some round ran a draft-model forward
    commit: bool = False            # the rounds are v1's: each also runs a commit forward (`commit_rows`)

    @classmethod
    def of(cls, rounds: Rounds = (), baseline: Rounds = ()) -> "Tally":
        tally = cls()
        for r in rounds:
            tally.add(r)
        for b in baseline:
            tally.add_baseline(b)
        return tally

    def add(self, r: RoundRecord) -> None:
        """Count the run's next round."""
        self.drafted |= r.k > 0
        self.draft_model_ran |= r.draft_forwards > 0
        self.commit |= r.mode is Mode.V1
        if r.is_prefill:
            return
        self.rounds_by[(r.k, r.depth)] += 1
        self.draft_forwards += r.draft_forwards
        for ms in r.timings.draft_forward_ms:
            insort(self.draft_ms, ms)
        if r.k > 0:
            self.accepted += r.accepted
            self.verified += r.verified
            insort(self.verify_ms.setdefault(r.k + 1, []), r.timings.target_forward_ms)

    def add_baseline(self, b: RoundRecord) -> None:
        """Count the baseline's next round."""
        if not b.is_prefill:
            insort(self.step_ms, b.timings.target_forward_ms)

    def target_step_ms(self) -> float | None:
        return median(self.step_ms) if self.step_ms else None

    def draft_forward_ms(self) -> float | None:
        return median(self.draft_ms) if self.draft_ms else None

    def cost_ratio(self) -> float | None:
        """c (see `cost_ratio`)."""
        step = self.target_step_ms()
        if step is None or step <= 0 or not self.drafted:
            return None
        draft = self.draft_forward_ms()
        if draft is None:
            return None if self.draft_model_ran else 0.0
        return draft / step

    def own_r(self, n: int, least: int = OWN_R_LEAST) -> float | None:
        """r(n) as this run measured it: its median verify forward of n rows over its median target-only step;
        None with fewer than `least` such forwards or no step yet."""
        step, ms = self.target_step_ms(), self.verify_ms.get(n, ())
        return median(ms) / step if step and ms and len(ms) >= least else None

    def r_used(self, calibrated: Callable[[int], float] | None) -> Callable[[int], float] | None:
        """The r(n) a prediction for these rounds reads: the run's own (`own_r`) at the n it has verified often
        enough, the calibration's elsewhere; None without a calibration."""
        if calibrated is None:
            return None
        own = {n: r for n in self.verify_ms if (r := self.own_r(n)) is not None}
        return lambda n: own[n] if n in own else calibrated(n)

    def alpha(self) -> float | None:
        """Accepted / verified positions over the drafted decode rounds; None before one."""
        return alpha_rate(self.accepted, self.verified) if self.verified else None

    def predicted_speedup(self, tokens_at: Callable[[int], float], c: float, r_of_n: Callable[[int], float]) -> float:
        """predicted_over_rounds over the decode rounds counted."""
        return _over_mix(tokens_at, self.rounds_by, self.draft_forwards, c, r_of_n, self.commit)

    def speedup_iid(self, calibrated: Callable[[int], float] | None, alpha: float | None = None) -> float | None:
        """Leviathan's speed-up for the rounds so far, E(alpha, k_i) per round, r(n) as `r_used` reads it; None
        until alpha, c and a calibration are all measured (`predict` says which is missing). `alpha`: another α in
        place of the run's."""
        a, c, r_of_n = self.alpha() if alpha is None else alpha, self.cost_ratio(), self.r_used(calibrated)
        if a is None or c is None or r_of_n is None:
            return None
        return self.predicted_speedup(lambda k: expected_tokens_per_round(a, k), c, r_of_n)

    def speedup_iid_interval(self, calibrated: Callable[[int], float] | None,
                             z: float = 1.96) -> tuple[float, float] | None:
        """`speedup_iid` at the two ends of α's Wilson score interval over the verified positions (z = 1.96:
        95%), the rest as measured: how far the prediction could move on this many positions alone. It is
        narrower than the truth, since positions of one round are not independent draws, and c and r(n) are
        taken as exact."""
        if self.speedup_iid(calibrated) is None:
            return None
        lo, hi = wilson_interval(self.accepted, self.verified, z)
        return self.speedup_iid(calibrated, lo), self.speedup_iid(calibrated, hi)


@dataclass(frozen=True, slots=True)
class Prediction:
    """What Leviathan's model predicts for a run, from the run's own measured inputs."""

    draft_acceptance: float        # accepted / drafted (for comparison with vLLM and the seed system)
    alpha: float                   # accepted / verified positions: what E(alpha, K) is defined on
    rates: list[float]             # per-position acceptance
    c: float                       # median draft forward / median target-only step, this run
    k: int                         # the drafted rounds' mean K
    r: float                       # r(k + 1) as the figures below read it (Tally.r_used): the run's own, or the
                                   # calibration's (`r_forwards`)
    tokens_iid: float              # predicted tokens per drafted round, E(alpha, k_i) averaged
    tokens_rates: float            # the same from the per-position rates (no i.i.d. assumption)
    tokens_measured: float         # tokens per drafted round, counted
    speedup_iid: float
    speedup_rates: float
    best_k: int                    # the argmax of E(alpha, K) / (cK + r(K + 1)) over K
    best_speedup: float
    commit: bool = False           # v1 rounds: each cost a commit forward too, counted in every figure above
    r_calibrated: float = math.nan   # the calibration's r(k + 1), which the best K reads
    r_forwards: int = 0              # the run's verify forwards of k + 1 rows that `r` is read from; 0: calibrated


@dataclass(frozen=True, slots=True)
class NotMeasured:
    """Why a prediction cannot be made yet."""

    reason: str


def predict(rounds: Rounds, baseline: Rounds, r_of_n: Callable[[int], float] | None,
            k_max: int = 16) -> Prediction | NotMeasured:
    """The prediction for the rounds so far, or why there is none yet. `r_of_n` is the calibrated
    curve (`RCurve.at`); without it there is no prediction, since r is measured, never assumed. The run's own
    figures read r(n) as `Tally.r_used` does (its own verify forwards where it has enough); the best K reads the
    calibration alone, as one curve over every K."""
    drafted = [r for r in decode_rounds(rounds) if r.k > 0]
    if not drafted:
        return NotMeasured("Not measured yet: no round has drafted anything (target-only, or no n-gram match).")
    tally = Tally.of(rounds, baseline)
    c = tally.cost_ratio()
    if c is None:
        return NotMeasured("c not measured yet: it needs the target-only baseline's timings (not recorded in "
                           "target-only mode) and a timed draft forward.")
    if r_of_n is None:
        return NotMeasured("r(n) not measured yet: the calibration of the target's forward is still running.")
    a, rates = tally.alpha(), position_rates(drafted)
    iid = lambda k: expected_tokens_per_round(a, k)  # noqa: E731
    by_rates = lambda k: expected_tokens_from_rates(rates, k)  # noqa: E731
    best, used, mean = best_k(a, c, r_of_n, k_max, tally.commit), tally.r_used(r_of_n), mean_k(drafted)
    own = tally.own_r(mean + 1) is not None
    return Prediction(
        draft_acceptance=draft_acceptance(drafted), alpha=a, rates=rates, c=c, k=mean, r=used(mean + 1),
        r_calibrated=r_of_n(mean + 1), r_forwards=len(tally.verify_ms[mean + 1]) if own else 0,
        tokens_iid=sum(iid(r.depth) for r in drafted) / len(drafted),
        tokens_rates=sum(by_rates(r.depth) for r in drafted) / len(drafted),
        tokens_measured=tokens_per_round(drafted),
        speedup_iid=tally.speedup_iid(r_of_n), speedup_rates=tally.predicted_speedup(by_rates, c, used),
        best_k=best, best_speedup=predicted_speedup(a, best, c, r_of_n(best + 1),
                                                     commit_cost(a, best, r_of_n, tally.commit)),
        commit=tally.commit)


# -- the run summary ----------------------------------------------------------------------------------
def summarize(rounds: Rounds, weight_bytes: dict[str, int], kv_bytes: dict[str, int]) -> RunSummary:
    """The run-level record of a run's rounds (exact counts, the engine's own times)."""
    if not rounds:
        raise ValueError("no rounds to summarise")
    tokens = rounds[-1].tokens_total
    drafted, verified = sum(r.k for r in rounds), sum(r.verified for r in rounds)
    accepted = sum(r.accepted for r in rounds)
    elapsed, ttft = rounds[-1].elapsed_s, rounds[0].elapsed_s * 1000
    return RunSummary(
        mode=rounds[0].mode, drafter=rounds[0].drafter, rounds=len(rounds), tokens=tokens,
        drafted=drafted, verified=verified, accepted=accepted,
        draft_acceptance_rate=acceptance_rate(accepted, drafted), alpha=alpha_rate(accepted, verified),
        mean_accepted_length=mean_accepted_length([len(r.emitted) for r in rounds]),
        per_position_acceptance=position_rates(rounds),
        target_forwards=sum(r.target_forwards for r in rounds), draft_forwards=sum(r.draft_forwards for r in rounds),
        target_forwards_per_token=sum(r.target_forwards for r in rounds) / max(tokens, 1),
        ttft_ms=ttft, tpot_ms=(elapsed * 1000 - ttft) / (tokens - 1) if tokens > 1 else 0.0,
        tokens_per_s=tokens / elapsed if elapsed > 0 else 0.0,
        elapsed_s=elapsed, weight_bytes=weight_bytes, kv_bytes=kv_bytes)


def describe(mode: Mode, drafter: DrafterKind | None) -> str:
    """'v2 / model', 'target / none': how a run is named in one line of text."""
    return f"{mode.value} / {drafter.value if drafter else 'none'}"

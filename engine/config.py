"""Run configuration: the modes, drafters and K schedules, and one validated config record."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from engine.sampling import SamplingParams

K_BOUND = 16  # the largest K the engine accepts; verify rows and UI charts are sized for it
K_SLACK = K_BOUND + 2  # KV room beyond max_new_tokens for a round's K+1 speculative slots
# torch.Generator.manual_seed takes up to 2**64 - 1; the draft's generator is seeded with seed + 7919,
# so any seed up to the signed 64-bit maximum leaves room for it.
SEED_MAX = 2**63 - 1
DRAFT_SEED_OFFSET = 7919


def check_seed(seed: object) -> int:
    """`seed` when it is a whole number in [0, SEED_MAX]; else ValueError with the one sentence every entry
    point (the playground's controls, its API, the command line) shows for a bad seed."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
        raise ValueError(f"Seed must be a whole number from 0 to {SEED_MAX}, got {seed!r}.")
    return seed


class Mode(str, Enum):
    V2 = "v2"          # one target forward writes K+1 slots; rejected slots are rolled back
    V1 = "v1"          # the seed system: verify without a KV write, then a second forward commits
    TARGET = "target"  # plain target-only decoding: the baseline


class DrafterKind(str, Enum):
    MODEL = "model"    # a small draft model with its own paged cache
    NGRAM = "ngram"    # prompt lookup: copy what followed the last matching n-gram
    HYBRID = "hybrid"  # prompt lookup when the context repeats, else the draft model

    @property
    def uses_model(self) -> bool:
        return self is not DrafterKind.NGRAM


class KSchedule(str, Enum):
    CONSTANT = "constant"
    HEURISTIC = "heuristic"  # K+2 after a fully accepted round, K-1 otherwise, within [k_min, k_max]


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """Everything that decides a run's tokens and its cost, apart from the models and prompt."""

    mode: Mode = Mode.V2
    drafter: DrafterKind = DrafterKind.MODEL
    k: int = 4
    k_schedule: KSchedule = KSchedule.CONSTANT
    k_min: int = 1
    k_max: int = 8
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    max_new_tokens: int = 64
    stop_at_eos: bool = True
    top_n: int = 8          # candidates kept per position in round records
    record: bool = True     # build per-position candidate lists and token texts (the UI); off for benches
    ngram_max: int = 4
    ngram_min: int = 1
    hybrid_min_n: int = 2   # hybrid: copy when the last hybrid_min_n+ tokens occurred before, else draft
    block_size: int = 16
    fused_forward: bool = True  # the engine's own Llama-family forward; False runs the transformers one

    def __post_init__(self) -> None:
        for name, enum in (("mode", Mode), ("drafter", DrafterKind), ("k_schedule", KSchedule)):
            value = getattr(self, name)
            if not isinstance(value, enum):
                try:
                    object.__setattr__(self, name, enum(value))
                except ValueError:
                    raise ValueError(f"{name} must be one of {[e.value for e in enum]}, not {value!r}") from None
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError("sampling must be a SamplingParams")
        check_seed(self.seed)
        if not (1 <= self.k_min <= self.k_max <= K_BOUND):
            raise ValueError(f"need 1 <= k_min <= k_max <= {K_BOUND}, got k_min={self.k_min}, k_max={self.k_max}")
        if not isinstance(self.k, int) or not 1 <= self.k <= K_BOUND:
            raise ValueError(f"K must be an integer between 1 and {K_BOUND}, got {self.k!r}")
        if self.k_schedule is KSchedule.HEURISTIC and not self.k_min <= self.k <= self.k_max:
            raise ValueError(f"K={self.k} lies outside the heuristic schedule's bounds [{self.k_min}, {self.k_max}]")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if self.top_n < 1:
            raise ValueError(f"top_n must be >= 1, got {self.top_n}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        if not 1 <= self.hybrid_min_n <= self.ngram_max:
            raise ValueError(f"need 1 <= hybrid_min_n <= ngram_max, got {self.hybrid_min_n}, {self.ngram_max}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    @property
    def uses_draft_model(self) -> bool:
        """Whether a run with this config runs the draft model (and so needs one loaded)."""
        return self.mode is not Mode.TARGET and self.drafter.uses_model

    def next_k(self, k: int, fully_accepted: bool) -> int:
        if self.k_schedule is KSchedule.CONSTANT:
            return k
        return min(self.k_max, k + 2) if fully_accepted else max(self.k_min, k - 1)

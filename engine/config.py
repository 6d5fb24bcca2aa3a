"""Run configuration: the modes, drafters and K schedules, and one validated config record."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from engine.sampling import SamplingParams

K_BOUND = 32  # the largest K (and tree, TREE_BOUND below) the engine accepts
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


TREE_BOUND = K_BOUND   # a tree's drafted nodes at most: its verify forward covers TREE_BOUND + 1 rows


@dataclass(frozen=True, slots=True)
class TreeSpec:
    """A tree's shape: fixed widths per depth (static), or a node budget and a depth (dynamic)."""

    widths: tuple[int, ...] = ()
    budget: int = 0
    depth: int = 4
    # greedy trees grow by the draft's confidence as measured (engine.tree.Confidence); False: by raw q
    calibrated: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "widths", tuple(self.widths))
        if self.widths:
            if self.budget:
                raise ValueError("a tree is static (widths per depth) or dynamic (a node budget), not both")
            if any(not isinstance(w, int) or w < 1 for w in self.widths):
                raise ValueError(f"every width must be a positive integer, got {list(self.widths)}")
            if sum(self.widths) > TREE_BOUND:
                raise ValueError(f"the tree {'-'.join(map(str, self.widths))} has {sum(self.widths)} nodes; "
                                 f"the bound is {TREE_BOUND}")
        else:
            if not isinstance(self.budget, int) or not 1 <= self.budget <= TREE_BOUND:
                raise ValueError(f"a dynamic tree needs a node budget between 1 and {TREE_BOUND}, got {self.budget!r}")
            if not isinstance(self.depth, int) or not 1 <= self.depth <= TREE_BOUND:
                raise ValueError(f"tree depth must be between 1 and {TREE_BOUND}, got {self.depth!r}")

    @property
    def nodes(self) -> int:
        return sum(self.widths) if self.widths else self.budget

    @property
    def max_depth(self) -> int:
        return len(self.widths) if self.widths else self.depth

    @property
    def draft_room(self) -> int:
        """Draft KV slots one round's growth may fill beyond the committed tokens (engine.tree.grow drafts a
        level at a time, each level's nodes that may still get children, some pushed out later): at most a
        level's width, or the budget, on every level but the last."""
        return sum(self.widths[:-1]) if self.widths else self.budget * (self.depth - 1)

    @staticmethod
    def parse(text: str) -> "TreeSpec":
        """'4-2-2-1' (static widths) or 'N16' / 'N16d6' (dynamic: budget, optional depth); a trailing 'q'
        grows by the draft's raw q instead of its measured confidence (e.g. 'N16d6q')."""
        text = text.strip().lower()
        shape = text.removesuffix("q")
        calibrated = shape == text
        try:
            if shape.startswith("n"):
                budget, _, depth = shape[1:].partition("d")
                return TreeSpec(budget=int(budget), depth=int(depth) if depth else 4, calibrated=calibrated)
            return TreeSpec(widths=tuple(int(w) for w in shape.split("-")), calibrated=calibrated)
        except ValueError as exc:
            if "invalid literal" in str(exc):
                raise ValueError(f"a tree is written as widths per depth (e.g. 4-2-2-1) or a budget (e.g. N16 or "
                                 f"N16d6), optionally ending in q (grow by raw q), not {text!r}") from None
            raise

    def label(self) -> str:
        shape = "-".join(map(str, self.widths)) if self.widths else f"N{self.budget}d{self.depth}"
        return shape if self.calibrated else shape + "q"


class Mode(str, Enum):
    V2 = "v2"          # one target forward writes K+1 slots; rejected slots are rolled back
    V1 = "v1"          # the seed system: verify without a KV write, then a second forward commits
    TARGET = "target"  # plain target-only decoding: the baseline


class DrafterKind(str, Enum):
    MODEL = "model"                # a small draft model with its own paged cache
    NGRAM = "ngram"                # prompt lookup: copy what followed the last matching n-gram
    HYBRID = "hybrid"              # prompt lookup when the context repeats, else the draft model
    EAGLE = "eagle"                # one decoder layer drafting from the target's own features
    EAGLE_HYBRID = "eagle-hybrid"  # prompt lookup when the context repeats, else the EAGLE head

    @property
    def uses_model(self) -> bool:
        """Whether this drafter runs a separate draft model."""
        return self in (DrafterKind.MODEL, DrafterKind.HYBRID)

    @property
    def uses_eagle(self) -> bool:
        """Whether this drafter runs an EAGLE head (trained for the target)."""
        return self in (DrafterKind.EAGLE, DrafterKind.EAGLE_HYBRID)

    @property
    def copies(self) -> bool:
        """Whether it copies from the context (prompt lookup) when the context repeats."""
        return self in (DrafterKind.NGRAM, DrafterKind.HYBRID, DrafterKind.EAGLE_HYBRID)


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
    tree: TreeSpec | None = None  # draft a tree instead of a chain (every drafter but n-gram alone)

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
            raise ValueError(f"K min and K max must satisfy 1 <= K min <= K max <= {K_BOUND}, got K min={self.k_min}, "
                             f"K max={self.k_max}")
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
        if self.tree is not None:
            if not isinstance(self.tree, TreeSpec):
                raise ValueError("tree must be a TreeSpec (engine.config), e.g. TreeSpec(widths=(4, 2, 2, 1))")
            if self.drafter is DrafterKind.NGRAM:
                raise ValueError("a tree is drafted by the draft model or the EAGLE head (alone or with prompt "
                                 "lookup merged in: hybrid, eagle-hybrid), not by the ngram drafter alone")
            if self.k_schedule is not KSchedule.CONSTANT:
                raise ValueError("a tree has its own shape: use the constant K schedule with it")

    @property
    def uses_draft_model(self) -> bool:
        """Whether a run with this config runs the draft model (and so needs one loaded)."""
        return self.mode is not Mode.TARGET and self.drafter.uses_model

    @property
    def uses_eagle(self) -> bool:
        """Whether a run with this config runs the target's EAGLE head (and so needs one loaded)."""
        return self.mode is not Mode.TARGET and self.drafter.uses_eagle

    @property
    def grows_by_confidence(self) -> bool:
        """Greedy trees grow by the draft's calibrated confidence (engine.tree.Confidence), learned as the
        run goes; sampled trees, raw-q trees and chains grow by q or not at all."""
        return (self.tree is not None and self.tree.calibrated and self.sampling.greedy
                and self.mode is not Mode.TARGET)

    def next_k(self, k: int, fully_accepted: bool) -> int:
        if self.k_schedule is KSchedule.CONSTANT:
            return k
        return min(self.k_max, k + 2) if fully_accepted else max(self.k_min, k - 1)

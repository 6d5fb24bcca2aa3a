"""The bench's methods (engine and Hugging Face decoders, each at a K) and its settings."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.config import K_BOUND, DrafterKind, KSchedule, Mode, SpecConfig, TreeSpec

DEFAULT_KS = (1, 2, 3, 4, 6, 8)
HEURISTIC_START_K = 4
BASELINES = ("hf-generate", "target")      # always run: the speed-up reference and the token reference
REFERENCE = "hf-generate"
METHOD_NAMES = ("hf-generate", "target", "target-transformers", "hf-assisted", "hf-prompt-lookup",
                "v2", "v1", "v2-heuristic", "v1-heuristic", "ngram", "hybrid", "hybrid-heuristic",
                "eagle", "eagle-heuristic", "eagle-hybrid", "tree-static", "tree-dynamic", "eagle-tree-static",
                "eagle-tree-dynamic", "tree-static-q", "tree-dynamic-q", "eagle-tree-static-q", "eagle-tree-dynamic-q",
                "hybrid-tree-static", "hybrid-tree-dynamic", "eagle-hybrid-tree-static", "eagle-hybrid-tree-dynamic",
                "eagle3", "eagle3-hybrid", "eagle3-tree-dynamic", "eagle3-hybrid-tree-dynamic", "ngram-min2")
# "eagle3...": the eagle methods with the target's second head (--eagle3: its EAGLE-3-style head), beside the
# first (--eagle) in the same process. "ngram-min2": prompt lookup that needs a match of 2 tokens or more (vLLM's
# prompt_lookup_min), beside the engine's default minimum (SpecConfig.ngram_min).
# Tree methods grow by the draft's measured confidence (engine.tree.Confidence); "-q": by raw q, as EAGLE-2;
# "hybrid-": with prompt lookup merged into the tree.
TREE_METHODS = tuple(m for m in METHOD_NAMES if "tree-" in m)
# Tree methods take K as their node budget N: the verify forward covers N + 1 rows, like a chain at K = N.
STATIC_TREES = {1: (1,), 2: (2,), 3: (2, 1), 4: (2, 1, 1), 6: (3, 2, 1), 8: (3, 2, 2, 1), 12: (4, 3, 2, 2, 1),
                16: (4, 4, 3, 3, 2), 24: (6, 6, 5, 4, 3), 32: (8, 8, 6, 4, 3, 2, 1)}
DYNAMIC_TREE_DEPTH = 8
DEFAULT_METHODS = METHOD_NAMES[:12]   # the EAGLE and tree methods run when named (--methods)
UNDRAFTED = ("hf-generate", "target", "target-transformers")  # target-only: no K
PROMPT_SETS = ("heldout", "code", "chat", "chat-heldout", "chat-fresh", "chat-wide")
NGRAM_MAX = 4
# Code prompts keep the last 192 tokens of each file's first half: the built-in pair was trained on
# 256-token windows, so 192 + 64 new tokens stay inside what it learned. Past that both models are
# out of distribution (at 512 tokens the draft's acceptance at K=2 falls from 0.73 to 0.44).
CODE_PROMPT_TOKENS = 192


# ---------------------------------------------------------------------------- methods and prompts

@dataclass(frozen=True, slots=True)
class Method:
    """One way of decoding. `k` is the (starting) K; None for target-only decoding."""

    name: str
    k: int | None = None

    @property
    def label(self) -> str:
        return self.name if self.k is None else f"{self.name} K={self.k}"

    @property
    def family(self) -> str:
        return "hf" if self.name.startswith("hf-") else "engine"

    @property
    def head(self) -> str:
        """Which EAGLE head an eagle method drafts with: "eagle3" (the bench's --eagle3) or "" (--eagle)."""
        return "eagle3" if self.name.startswith("eagle3") else ""

    @property
    def drafter(self) -> str:
        if self.k is None:
            return "none"
        base = self.name.removesuffix("-heuristic").replace("eagle3", "eagle", 1)
        for hybrid in ("eagle-hybrid", "hybrid"):
            if base.startswith(hybrid):
                return hybrid
        if base.startswith("eagle"):
            return "eagle"
        return "ngram" if base in ("ngram", "ngram-min2", "hf-prompt-lookup") else "model"

    @property
    def uses_draft_model(self) -> bool:
        return self.drafter in ("model", "hybrid")

    @property
    def uses_eagle(self) -> bool:
        return self.drafter in ("eagle", "eagle-hybrid")

    @property
    def tree(self) -> TreeSpec | None:
        """The tree of a tree method at its budget N = K (static shapes from STATIC_TREES)."""
        if self.name not in TREE_METHODS:
            return None
        calibrated = not self.name.endswith("-q")
        if self.name.removesuffix("-q").endswith("static"):
            return TreeSpec(widths=STATIC_TREES[self.k], calibrated=calibrated)
        return TreeSpec(budget=self.k, depth=min(self.k, DYNAMIC_TREE_DEPTH), calibrated=calibrated)

    @property
    def schedule(self) -> str:
        if self.k is None:
            return "none"
        return "heuristic" if self.name.endswith("-heuristic") else "constant"

    @property
    def mode(self) -> Mode:
        base = self.name.removesuffix("-heuristic")
        return {"target": Mode.TARGET, "target-transformers": Mode.TARGET, "v1": Mode.V1}.get(base, Mode.V2)

    def spec_config(self, new_tokens: int) -> SpecConfig:
        """The engine config of an engine method: greedy, no EOS stop (exact token counts), no UI records."""
        base, mode = self.name.removesuffix("-heuristic"), self.mode
        drafter = DrafterKind(self.drafter) if self.drafter != "none" else DrafterKind.MODEL
        schedule = KSchedule.HEURISTIC if self.schedule == "heuristic" else KSchedule.CONSTANT
        extra = {"ngram_min": 2} if base == "ngram-min2" else {}
        return SpecConfig(**extra, mode=mode, drafter=drafter, k=self.k or 1, k_schedule=schedule, k_max=max(8, self.k or 1),
                          max_new_tokens=new_tokens, stop_at_eos=False, record=False, ngram_max=NGRAM_MAX,
                          fused_forward=self.name != "target-transformers", tree=self.tree)


def method_ks(entry: str, ks: Sequence[int]) -> tuple[str, tuple[int, ...]]:
    """A --methods entry and the Ks it runs at: 'eagle' at every K of --ks, 'eagle:6' at K = 6 only."""
    name, _, k = entry.partition(":")
    if not k:
        return name, tuple(ks)
    try:
        return name, (int(k),)
    except ValueError:
        raise ValueError(f"bad K in {entry!r}; write METHOD:K, e.g. eagle:6") from None


def build_methods(names: Sequence[str], ks: Sequence[int]) -> list[Method]:
    """The baselines first, then each selected method at each of its Ks (heuristic ones once, from K=4),
    in METHOD_NAMES order."""
    wanted: dict[str, list[int]] = {}
    for entry in names:
        name, its_ks = method_ks(entry, ks)
        wanted.setdefault(name, []).extend(k for k in its_ks if k not in wanted.get(name, []))
    out = [Method(n) for n in BASELINES]
    for name in METHOD_NAMES:
        if name in BASELINES or name not in wanted:
            continue
        if name in UNDRAFTED:
            out.append(Method(name))
        elif name.endswith("-heuristic"):
            out.append(Method(name, HEURISTIC_START_K))
        else:
            out.extend(Method(name, k) for k in sorted(wanted[name]))
    return out


@dataclass(frozen=True, slots=True)
class BenchSettings:
    prompt_set: str = "heldout"        # one of PROMPT_SETS
    num_prompts: int = 8
    prompt_tokens: int = 128           # heldout: window length; code: the most prompt tokens kept
    new_tokens: int = 64
    repeats: int = 3
    warmup: int = 1                    # untimed runs of every method before timing
    ks: tuple[int, ...] = DEFAULT_KS
    methods: tuple[str, ...] = DEFAULT_METHODS
    seed: int = 0
    calibration_repeats: int = 5       # passes of the r(n) calibration before the runs

    def __post_init__(self) -> None:
        if self.prompt_set not in PROMPT_SETS:
            raise ValueError(f"--prompts must be one of {', '.join(PROMPT_SETS)}, not {self.prompt_set!r}")
        per_method = [method_ks(entry, self.ks) for entry in self.methods]
        static = sorted({k for name, ks in per_method if name.removesuffix("-q").endswith("tree-static") for k in ks}
                        - set(STATIC_TREES))
        if static:
            raise ValueError(f"static trees are defined for N in {sorted(STATIC_TREES)}, got K = {static}")
        for name in ("num_prompts", "prompt_tokens", "new_tokens", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        all_ks = [*self.ks, *(k for _, ks in per_method for k in ks)]
        if not self.ks or any(not 1 <= k <= K_BOUND for k in all_ks):
            raise ValueError(f"every K must lie in 1..{K_BOUND}, got {sorted(set(all_ks))}")
        unknown = sorted({name for name, _ in per_method} - set(METHOD_NAMES))
        if unknown:
            raise ValueError(f"unknown method(s) {unknown}; choose from {list(METHOD_NAMES)}")


def parse_method(spec: str, default_k: int) -> Method:
    """'v2', 'v2:4', 'target', 'hf-assisted:2', ... -> Method."""
    name, _, k = spec.partition(":")
    if name not in METHOD_NAMES:
        raise ValueError(f"unknown method {name!r}; choose from {list(METHOD_NAMES)}")
    if name in UNDRAFTED:
        return Method(name)
    if name.endswith("-heuristic"):
        return Method(name, HEURISTIC_START_K)
    try:
        return Method(name, int(k) if k else default_k)
    except ValueError:
        raise ValueError(f"bad K in {spec!r}; write METHOD:K, e.g. v2:4") from None

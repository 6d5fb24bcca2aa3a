"""The draft/target pair: a target, what drafts for it (a draft model, the target's EAGLE head), their
tokenizers checked once. Models only: what a run learns (engine.tree.Confidence) belongs to the run or
to whoever passes it in."""
from __future__ import annotations

from dataclasses import dataclass

from engine.drafters.eagle import EagleRuntime
from engine.models import LoadedModel, ModelLoadError


@dataclass(frozen=True, slots=True)
class ModelPair:
    """A target, the draft model that proposes for it (None: none) and its EAGLE head (None: none), checked once.

    Building a pair checks that the two tokenizers give shared tokens the same ids (vocabulary
    sizes may differ) and raises ModelLoadError otherwise; every engine over the pair relies on
    that check instead of repeating it (reading two 150k vocabularies costs tens of milliseconds).
    Read-only and shared: every session and engine over the same models may hold the same pair.
    """

    target: LoadedModel
    draft: LoadedModel | None = None
    eagle: EagleRuntime | None = None   # the target's EAGLE head, when one is loaded

    def __post_init__(self) -> None:
        if self.draft is not None and self.draft.tokenizer is not self.target.tokenizer:
            _compare_tokenizers(self.draft, self.target, probes=2000)
        if self.eagle is not None and self.eagle.target is not self.target:
            raise ModelLoadError(f"The EAGLE head given was bound to {self.eagle.target.name!r}, not to the "
                                 f"target {self.target.name!r}.")


def _compare_tokenizers(draft: LoadedModel, target: LoadedModel, probes: int) -> None:
    td, tt = draft.tokenizer, target.tokenizer
    vd, vt = td.get_vocab(), tt.get_vocab()
    shared = min(len(vd), len(vt))
    # Compare the ids of the common part of the vocabulary, by token string.
    by_id_t = {i: s for s, i in vt.items() if i < shared}
    step = max(1, shared // probes)
    bad = [i for i in range(0, shared, step) if i in by_id_t and vd.get(by_id_t[i]) != i]
    sample = "def main(argv):\n    return 0  # ok\n"
    if bad or td.encode(sample, add_special_tokens=False) != tt.encode(sample, add_special_tokens=False):
        raise ModelLoadError(
            f"Draft and target tokenizers do not match: draft {draft.name!r} "
            f"({type(td).__name__}, {len(vd)} tokens) and target {target.name!r} ({type(tt).__name__}, "
            f"{len(vt)} tokens) give different ids to the same tokens. Speculative decoding needs a shared "
            f"tokenizer; pick a draft from the target's model family.")

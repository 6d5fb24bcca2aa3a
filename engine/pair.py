"""The draft/target pair: a target, what drafts for it (a draft model, the target's EAGLE head), their
tokenizers checked once. Models only: what a run learns (engine.tree.Confidence) belongs to the run or
to whoever passes it in."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.drafters.eagle import EagleLoadError, EagleRuntime, load_eagle
from engine.models import LoadedModel, ModelLoadError, default_devices, load_model


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


def load_pair(target: str, draft: str | None = None, eagle: str | None = None, *,
              draft_device: str | torch.device | None = None, target_device: str | torch.device | None = None,
              dtype: str | torch.dtype = "auto", trust_remote_code: bool = False) -> ModelPair:
    """Load a pair from sources: the target, the draft model when `draft` names one, and the EAGLE head
    `eagle` names (a source under assets/eagle, or a folder) bound to the target. Devices default as
    engine.models.default_devices says. Every failure is a ModelLoadError naming the fix."""
    draft_dev, target_dev = default_devices(draft_device, target_device)
    loaded = load_model(target, "target", device=target_dev, dtype=dtype, trust_remote_code=trust_remote_code)
    proposer = load_model(draft, "draft", device=draft_dev, dtype=dtype, trust_remote_code=trust_remote_code) \
        if draft is not None else None
    try:
        head = load_eagle(eagle, loaded) if eagle is not None else None
    except EagleLoadError as exc:
        raise ModelLoadError(str(exc)) from None
    return ModelPair(loaded, proposer, head)


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

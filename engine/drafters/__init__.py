"""Drafters: each proposes K tokens and the q_draft rows they were drawn from, behind one interface."""
from engine.drafters.base import Drafter, Proposal, common_prefix
from engine.drafters.hybrid import HybridDrafter
from engine.drafters.model import ModelDrafter
from engine.drafters.ngram import NgramDrafter

__all__ = ["Drafter", "Proposal", "common_prefix", "ModelDrafter", "NgramDrafter", "HybridDrafter"]

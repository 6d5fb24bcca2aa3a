"""What an EAGLE-3-style head's training run is told (Eagle3Plan) and where it stands (Cursor): what a checkpoint
keeps, so that a stopped run resumes where it was."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Eagle3Plan:
    kept: int = 8192                 # reduced vocabulary: the most frequent answer tokens
    depth: int = 6                   # training-time-test steps
    step_decay: float = 0.8          # step s's loss weighs step_decay ** (s - 1)
    lr: float = 6e-4
    warmup: int = 100
    epochs: float = 2.0
    batch: int = 8                   # sequences per optimiser step
    max_len: int = 384               # longer sequences are cut (prompt + answer)
    bf16: bool = False               # autocast the head's matrix products to bf16 (fast on CPUs with AMX)
    own_head: bool = True            # train its own LM head (else draft through the target's rows, frozen)
    layers: tuple[int, ...] | None = None   # the target layers it fuses (default: the data's); see lift_features
    feature_norm: bool = False       # RMS-normalise each fused layer first, weights started from the target's norms
    feature_weight: float = 0.0      # smooth-L1 of step 1's output against the next post-norm feature (EAGLE-1's loss)
    noise: float = 0.0               # Gaussian noise on the real fused features while training, relative to their std
    seed: int = 0
    checkpoint_every_s: float = 120.0
    log_every_s: float = 60.0
    heldout_every: int = 250         # optimiser steps between measurements on the held-out shard (0: at the end only)
    init: str = ""                   # a saved head to start from (its layers, vocabulary, LM-head choice)
    replay_share: float = 0.25       # the share of each replay folder's shards trained on (a seeded sample)

    def __post_init__(self) -> None:
        if self.depth < 1 or self.kept < 16 or self.batch < 1 or self.epochs <= 0 or not self.lr > 0:
            raise ValueError("need depth >= 1, kept >= 16, batch >= 1, epochs > 0 and lr > 0")
        if self.feature_weight < 0 or self.noise < 0 or self.heldout_every < 0:
            raise ValueError("need feature_weight >= 0, noise >= 0 and heldout_every >= 0")
        if not 0 < self.replay_share <= 1:
            raise ValueError("need 0 < replay share <= 1")


@dataclass
class Cursor:
    """Where the data stream stands: epoch, position in that epoch's shard order, sequences taken."""

    epoch: int = 0
    shard: int = 0
    seen: int = 0
    step: int = 0
    log: list[dict] = field(default_factory=list)
    seconds: float = 0.0    # training time over every run of the command, resumed ones included
    heldout: list[dict] = field(default_factory=list)   # {step, loss, top1 by step} on the held-out shard
    fitted: int = 0         # the schedule's steps where it was fitted to a deadline (0: the plan's epochs)


def fitted_steps(step: int, planned: int, rate: float, seconds_left: float) -> int:
    """How long a schedule can be to end by a deadline: the steps a run at `rate` steps a second still takes in
    `seconds_left`, less a reserve for the export's measurement and save (a twentieth of it, at least 15 s);
    never more than `planned`, never fewer than one more."""
    reserve = max(15.0, seconds_left / 20)
    return max(step + 1, min(planned, step + int(rate * max(0.0, seconds_left - reserve))))

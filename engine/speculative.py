"""The speculative loop: one round per `step()`: draft, verify (one target forward), commit/rollback.

Invariant between rounds, for the target and the draft alike: the cache holds the K/V of every
committed token except the last one. Each round's target forward therefore starts with that last
token, so its K/V is written before anything attends past it. (The seed system verified its
drafts without ever writing the first generated token's K/V, so every later round attended to
the wrong context.)

v2 feeds [last, d1..dK] once: K+1 slots written, K+1 verify rows (row i checks d_{i+1}; row K is
the bonus row), and the K - accepted slots of rejected drafts are rolled back. v1 verifies with a
read-only forward and commits the accepted tokens with a second forward. Target-only mode is the
same loop with K = 0: one forward, one token, from the bonus row.
"""
from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch

from engine.clock import Now, PhaseClock
from engine.config import DRAFT_SEED_OFFSET, K_BOUND, K_SLACK, DrafterKind, Mode, SpecConfig
from engine.drafters.base import NO_DRAFT, Drafter, DraftStep, NoDraft, Proposal, TreeProposal, drive
from engine.drafters.eagle import EagleDrafter
from engine.drafters.hybrid import HybridDrafter
from engine.drafters.model import ModelDrafter
from engine.drafters.ngram import NgramDrafter
from engine.faults import Fault, faulty_verify
from engine.kv_cache import KVPool
from engine.metrics import summarize
from engine.pair import ModelPair
from engine.prompts import PromptError
from engine.recorder import RoundRecorder, RoundResult, RunState, drafter_of, kv_state
from engine.records import RoundRecord, RoundTimings, RunSummary
from engine.runner import ForwardRequest, ModelRunner, pool_blocks, pool_bytes
from engine.sequence import Sequence
from engine.tree import Confidence
from engine.verify import Verdict


def kv_capacity(prompt_tokens: int, config: SpecConfig) -> int:
    """Tokens each of an engine's KV pools holds: the prompt, the new tokens, and one round's slack."""
    return prompt_tokens + config.max_new_tokens + K_SLACK


def draft_capacity(prompt_tokens: int, config: SpecConfig) -> int:
    """Tokens a drafter's KV pool holds: the target's, and the room a tree round may draft into."""
    return kv_capacity(prompt_tokens, config) + (config.tree.draft_room if config.tree is not None else 0)


def kv_bytes(pair: ModelPair, prompt_tokens: int, config: SpecConfig) -> int:
    """Bytes of the KV pools one engine allocates (the target's, plus the draft model's if it runs one)."""
    capacity, drafts = kv_capacity(prompt_tokens, config), draft_capacity(prompt_tokens, config)
    total = pool_bytes(pair.target, capacity, config.block_size)
    if pair.draft is not None and config.uses_draft_model:
        total += pool_bytes(pair.draft, drafts, config.block_size)
    if pair.eagle is not None and config.uses_eagle:
        shape = pair.eagle.config.kv_shape
        total += shape.bytes_per_slot(pair.target.dtype) * pool_blocks(drafts, config.block_size) * config.block_size
    return total


@dataclass(frozen=True, slots=True)
class PendingRound:
    """A round between its two parts (`SpeculativeEngine.begin_round` / `finish_round`): what was drafted, the
    target forward it needs, its clock, and the phase that forward is timed in ("prefill" or "verify")."""

    proposal: Proposal | TreeProposal | None
    request: ForwardRequest
    clock: PhaseClock
    forwards_before: int
    phase: str


class SpeculativeEngine:
    """One sequence decoded speculatively (or target-only), one round per `step()`.

    Owns its KV pools (one per model), so each session can have its own; the models are shared
    and read-only. Randomness comes from two generators seeded from `config.seed` (verification
    and drafting), so a seed reproduces a run exactly, and v1 and v2 consume draws identically.
    A greedy tree's confidence table is the run's own unless the caller passes one (`confidence`).
    Times come from `now` (see engine.clock). `target_pool`: the target's KV pool shared with a batch's other
    sequences (engine.batch), each holding its own blocks in it.
    """

    def __init__(self, pair: ModelPair, prompt_ids: list[int], config: SpecConfig, kv_blocks: int | None = None,
                 eos_id: int | None = None, now: Now = time.perf_counter, confidence: Confidence | None = None,
                 fault: Fault | None = None, target_pool: KVPool | None = None) -> None:
        if not prompt_ids:
            raise PromptError("The prompt is empty.")
        target = pair.target
        outside = [t for t in prompt_ids if not 0 <= t < target.vocab_size]
        if outside:
            raise PromptError(f"The prompt holds token id {outside[0]}, outside the target's vocabulary "
                              f"(ids 0..{target.vocab_size - 1}).")
        need = len(prompt_ids) + config.max_new_tokens
        if need > target.max_context:
            raise PromptError(
                f"The prompt has {len(prompt_ids)} tokens and max_new_tokens is {config.max_new_tokens}: "
                f"{need} tokens exceed the target's context of {target.max_context}. Shorten the prompt "
                f"or ask for fewer new tokens.")
        if fault is not None and (config.sampling.greedy or config.tree is not None or config.mode is Mode.TARGET):
            raise ValueError("a verification fault applies to a sampled (T > 0) chain of drafts only")
        self.config, self.pair, self.target = config, pair, target
        self.fault = fault   # engine.faults: verify every drafted chain with a known-wrong rule (audits' checks)
        self.sequence = Sequence(prompt_ids, config.max_new_tokens,
                                 eos_id if eos_id is not None else target.tokenizer.eos_token_id, config.stop_at_eos)
        self._now = now
        capacity = kv_capacity(len(prompt_ids), config)
        self.target_runner = ModelRunner(target, capacity, config.block_size, num_blocks=kv_blocks,
                                         fused=config.fused_forward, now=now, pool=target_pool)
        self.target_cache = self.target_runner.new_sequence()
        self.gen_verify = torch.Generator().manual_seed(config.seed)
        self.gen_draft = torch.Generator().manual_seed(config.seed + DRAFT_SEED_OFFSET)
        self.drafter = self._make_drafter(draft_capacity(len(prompt_ids), config), kv_blocks)
        self._needs_features = self.drafter is not None and self.drafter.needs_features
        self._taps = self.drafter.feature_layers if self._needs_features else ()
        self.recorder = RoundRecorder(target.tokenizer, config, drafter_of(config), self.sequence.prompt)
        self.k = config.k
        # greedy trees grow by the draft's calibrated confidence, learned round by round: from `confidence`
        # when the caller keeps one across its runs (engine.tree.Confidences), else from a fresh table, so
        # that a seed reproduces a run whatever ran before it
        self.confidence = (confidence if confidence is not None else Confidence()) \
            if config.grows_by_confidence else None
        self.rounds: list[RoundRecord] = []
        self._started = False
        self._busy_s = 0.0  # time spent inside step(): a stepping UI's idle time never counts

    def _make_drafter(self, capacity: int, kv_blocks: int | None) -> Drafter | None:
        c = self.config
        if c.mode is Mode.TARGET:
            return None
        ngram = NgramDrafter(c.ngram_max, c.ngram_min, self.target.vocab_size, self.target.device)
        if c.drafter is DrafterKind.NGRAM:
            return ngram
        model = self._model_drafter(capacity, kv_blocks)
        return HybridDrafter(model, ngram, c.hybrid_min_n, c.drafter) if c.drafter.copies else model

    def _model_drafter(self, capacity: int, kv_blocks: int | None) -> Drafter:
        """The draft model's drafter, or the target's EAGLE head's."""
        c = self.config
        if c.drafter.uses_eagle:
            if self.pair.eagle is None:
                raise ValueError(f"the {c.drafter.value} drafter needs an EAGLE head trained for the target")
            if not c.fused_forward:
                raise ValueError("the EAGLE drafter reads the target's features through the fused forward")
            return EagleDrafter(self.pair.eagle, c.sampling, self.gen_draft, capacity, c.block_size, kv_blocks,
                                now=self._now)
        if self.pair.draft is None:
            raise ValueError(f"the {c.drafter.value} drafter needs a draft model")
        runner = ModelRunner(self.pair.draft, capacity, c.block_size, num_blocks=kv_blocks, fused=c.fused_forward,
                             now=self._now)
        return ModelDrafter(runner, c.sampling, self.target.vocab_size, self.target.device, self.gen_draft)

    # -- the round ------------------------------------------------------------------------------
    @property
    def prompt(self) -> list[int]:
        return self.sequence.prompt

    @property
    def tokens(self) -> list[int]:
        return self.sequence.tokens

    @property
    def generated(self) -> list[int]:
        return self.sequence.generated

    @property
    def finished(self) -> bool:
        return self.sequence.finished

    def step(self) -> RoundRecord:
        """Run one round and return its record. Raises RuntimeError once the run is finished.

        The first round is the prefill: one target forward over the whole prompt, whose last row
        gives the first token (as `generate` does), while the draft prefills alongside. Every
        later round drafts, verifies and commits. A round holds a chain, a tree or nothing drafted
        (engine.drafters.base), and asks each the same four things: what to feed the verify
        forward, how to verify, which fed rows to keep, and the next K.

        A round is three parts: `begin_round` (draft, and say what the target must be fed), the target's
        forward, `finish_round` (verify, commit, record). A batch (engine.batch) runs the same parts, with one
        forward for all its sequences in the middle.
        """
        pending = self.begin_round()
        with pending.clock.phase(pending.phase):
            logits, features = pending.request.run(self._needs_features, self._taps)
        return self.finish_round(pending, logits, features)

    @property
    def started(self) -> bool:
        """Whether the prefill round has begun (every later round drafts first)."""
        return self._started

    def begin_round(self, drafted: tuple[Proposal | TreeProposal | None, float] | None = None) -> PendingRound:
        """The round's first part: the draft (none in the prefill), and the target forward it needs. A batch
        drafts for all its sequences together (`draft_steps`) and passes each its (proposal, drafting ms)."""
        if self.finished:
            raise RuntimeError("the run is finished; reset to decode again")
        clock, forwards_before = PhaseClock(self._now), self.target_runner.forwards
        if not self._started:
            self._started = True
            request = ForwardRequest(self.target_runner, self.target_cache, list(self.prompt), last_only=True,
                                     argmax_only=self.config.sampling.greedy)
            return PendingRound(None, request, clock, forwards_before, "prefill")
        if drafted is None:
            with clock.phase("draft"):
                proposal = drive(self.draft_steps())
        else:   # drafted before this clock started: the round began when its drafting did
            proposal, clock.ms["draft"] = drafted
            clock.start -= clock.ms["draft"] / 1000
        feed, extra = (proposal or NO_DRAFT).feed(self.sequence.last, len(self.tokens) - 1)
        request = ForwardRequest(self.target_runner, self.target_cache, feed, positions=extra.get("positions"),
                                 attn_mask=extra.get("attn_mask"), read_only=self.config.mode is Mode.V1,
                                 argmax_only=self.config.sampling.greedy)
        return PendingRound(proposal, request, clock, forwards_before, "verify")

    def finish_round(self, pending: PendingRound, logits: torch.Tensor, features: torch.Tensor | None) -> RoundRecord:
        """The round's last part, given the target's (logits, features) for what `begin_round` asked: in the
        prefill the drafter prefills from the prompt's features; then verify, commit, record."""
        clock, proposal = pending.clock, pending.proposal
        if pending.phase == "prefill" and self.drafter is not None:
            with clock.phase("prefill"):
                self.drafter.prefill(self.prompt, features)
        drafted = proposal or NO_DRAFT
        with clock.phase("verify"):
            if self.fault is not None and isinstance(drafted, Proposal):
                p_rows, verdict = faulty_verify(self.fault, drafted.q_draft, drafted.tokens, logits, self.config,
                                                self.gen_verify)
            else:
                p_rows, verdict = drafted.verify(logits, self.config, self.gen_verify)
        with clock.phase("commit"):
            emitted = self.sequence.accept(verdict.tokens)
            self._commit(drafted, verdict, features)
        self.k = drafted.next_k(self.config, self.k, verdict, self.confidence)
        record = self._record(RoundResult(proposal, p_rows, verdict, emitted), clock, pending.forwards_before)
        self.rounds.append(record)
        self._busy_s = record.elapsed_s
        return record

    @property
    def needs_features(self) -> bool:
        """Whether the drafter reads the target's features (`taps` says which layers' inputs, if any)."""
        return self._needs_features

    @property
    def taps(self) -> tuple[int, ...]:
        return self._taps

    def draft_steps(self) -> Generator[DraftStep, Any, Proposal | TreeProposal | None]:
        """The round's drafting as steps (engine.drafters.base.DraftSteps): up to K drafts (or a tree), never more
        than the tokens still to generate leave room to verify. A tree is drafted whole, without steps."""
        remaining = self.sequence.remaining
        k = 0 if self.drafter is None else max(0, min(self.k, remaining - 1))
        if not k:
            return None
        if self.config.tree is not None:
            return self.drafter.propose_tree(self.tokens, self.config.tree,
                                             self.confidence.weigh if self.confidence else None)
        proposal = yield from self.drafter.propose_steps(self.tokens, k, min(K_BOUND, remaining - 1))
        return proposal if proposal.tokens else None

    def _commit(self, drafted: Proposal | TreeProposal | NoDraft, verdict: Verdict,
                features: torch.Tensor | None) -> None:
        """Bring both caches back to the invariant: K/V of tokens[:-1]. When the kept rows are not a prefix of
        the fed ones (a tree's root and accepted path), their K/V first move into consecutive slots, and the
        drafter is handed the features of those rows only."""
        keep = len(self.tokens) - 1
        cache = self.target_cache
        rows = drafted.kept_rows(verdict)
        if rows is not None:
            if self.config.mode is not Mode.V1:   # v2 wrote every fed row: the cache's last slots
                cache.compact(cache.table.length - drafted.fed_rows, rows)
            if features is not None:
                features = features[rows]
        if self.config.mode is Mode.V1:
            # The seed system's second forward: commit the accepted tokens' K/V.
            feed = self.tokens[cache.table.length : keep]
            if feed:
                self.target_runner.forward(cache, feed, last_only=True)
        cache.rollback(cache.table.length - keep)
        if self.drafter is not None:
            self.drafter.commit(self.tokens, features)

    # -- records ----------------------------------------------------------------------------------
    def _record(self, result: RoundResult, clock: PhaseClock, forwards_before: int) -> RoundRecord:
        kv = [kv_state("target", self.target_cache, len(self.prompt) - 1)]
        kv += [kv_state(c.name, c.cache, len(self.prompt) - 1) for c in self._draft_caches()]
        target_ms = self.target_runner.drain_forward_ms()
        draft_ms = self.drafter.drain_forward_ms() if self.drafter is not None else []
        total = clock.total_ms()
        phases = [clock.get(p) for p in ("prefill", "draft", "verify", "commit")]
        timings = RoundTimings(*phases, total - sum(phases), total, target_ms[0] if target_ms else 0.0, draft_ms,
                               sum(target_ms[1:]))
        run = RunState(len(self.rounds), len(self.generated), self._busy_s + total / 1000, self.finished,
                       self.target_runner.forwards - forwards_before)
        return self.recorder.round(result, timings, kv, run)

    def _draft_caches(self):
        return self.drafter.caches() if self.drafter is not None else []

    # -- whole runs ---------------------------------------------------------------------------------
    def run(self) -> list[RoundRecord]:
        while not self.finished:
            self.step()
        return self.rounds

    def summary(self) -> RunSummary:
        """The run's metrics, with weight and KV bytes per device."""
        weights: dict[str, int] = {}
        kv: dict[str, int] = {}
        parts = [(str(self.target.device), self.target.weight_bytes, self.target_runner.pool.nbytes)]
        parts += [(c.device, c.weight_bytes, c.cache.pool.nbytes) for c in self._draft_caches()]
        for device, weight_bytes, nbytes in parts:
            weights[device] = weights.get(device, 0) + weight_bytes
            kv[device] = kv.get(device, 0) + nbytes
        return summarize(self.rounds, weights, kv)

    def close(self) -> None:
        """Free this run's KV blocks (the pools themselves go with the engine)."""
        self.target_cache.free()
        if self.drafter is not None:
            self.drafter.close()

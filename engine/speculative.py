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

import torch

from engine.clock import Now, PhaseClock
from engine.config import DRAFT_SEED_OFFSET, K_BOUND, K_SLACK, DrafterKind, Mode, SpecConfig
from engine.drafters import Drafter, HybridDrafter, ModelDrafter, NgramDrafter, Proposal
from engine.drafters.base import TreeProposal
from engine.drafters.eagle import EagleDrafter
from engine.metrics import summarize
from engine.pair import ModelPair
from engine.prompts import PromptError
from engine.recorder import RoundRecorder, RoundResult, RunState, drafter_of, kv_state
from engine.records import Outcome, RoundRecord, RoundTimings, RunSummary
from engine.runner import ModelRunner, pool_blocks, pool_bytes
from engine.sampling import draw_uniform, greedy_ids, logits_to_probs, one_hot_rows, sample_from
from engine.sequence import Sequence
from engine.tree import Confidence, TreeVerdict, attention_mask, verify_tree
from engine.verify import VerifyResult, verify, verify_greedy


def kv_capacity(prompt_tokens: int, config: SpecConfig) -> int:
    """Tokens each of an engine's KV pools holds: the prompt, the new tokens, and one round's slack."""
    return prompt_tokens + config.max_new_tokens + K_SLACK


def kv_bytes(pair: ModelPair, prompt_tokens: int, config: SpecConfig) -> int:
    """Bytes of the KV pools one engine allocates (the target's, plus the draft model's if it runs one)."""
    capacity = kv_capacity(prompt_tokens, config)
    total = pool_bytes(pair.target, capacity, config.block_size)
    if pair.draft is not None and config.uses_draft_model:
        total += pool_bytes(pair.draft, capacity, config.block_size)
    if pair.eagle is not None and config.uses_eagle:
        shape = pair.eagle.config.kv_shape
        total += shape.bytes_per_slot(pair.target.dtype) * pool_blocks(capacity, config.block_size) * config.block_size
    return total


class SpeculativeEngine:
    """One sequence decoded speculatively (or target-only), one round per `step()`.

    Owns its KV pools (one per model), so each session can have its own; the models are shared
    and read-only. Randomness comes from two generators seeded from `config.seed` (verification
    and drafting), so a seed reproduces a run exactly, and v1 and v2 consume draws identically.
    A greedy tree's confidence table is the run's own unless the caller passes one (`confidence`).
    Times come from `now` (see engine.clock).
    """

    def __init__(self, pair: ModelPair, prompt_ids: list[int], config: SpecConfig, kv_blocks: int | None = None,
                 eos_id: int | None = None, now: Now = time.perf_counter, confidence: Confidence | None = None) -> None:
        if not prompt_ids:
            raise PromptError("The prompt is empty.")
        target = pair.target
        need = len(prompt_ids) + config.max_new_tokens
        if need > target.max_context:
            raise PromptError(
                f"The prompt has {len(prompt_ids)} tokens and max_new_tokens is {config.max_new_tokens}: "
                f"{need} tokens exceed the target's context of {target.max_context}. Shorten the prompt "
                f"or ask for fewer new tokens.")
        self.config, self.pair, self.target = config, pair, target
        self.sequence = Sequence(prompt_ids, config.max_new_tokens,
                                 eos_id if eos_id is not None else target.tokenizer.eos_token_id, config.stop_at_eos)
        self._now = now
        capacity = kv_capacity(len(prompt_ids), config)
        self.target_runner = ModelRunner(target, capacity, config.block_size, num_blocks=kv_blocks,
                                         fused=config.fused_forward, now=now)
        self.target_cache = self.target_runner.new_sequence()
        self.gen_verify = torch.Generator().manual_seed(config.seed)
        self.gen_draft = torch.Generator().manual_seed(config.seed + DRAFT_SEED_OFFSET)
        self.drafter = self._make_drafter(capacity, kv_blocks)
        self._needs_features = self.drafter is not None and self.drafter.needs_features
        self._taps = self.drafter.feature_layers if self._needs_features else ()
        self._features: torch.Tensor | None = None   # the last target forward's features, for the drafter
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
        later round drafts, verifies and commits.
        """
        if self.finished:
            raise RuntimeError("the run is finished; reset to decode again")
        clock, forwards_before = PhaseClock(self._now), self.target_runner.forwards
        proposal = None
        if not self._started:
            with clock.phase("prefill"):
                logits = self._prefill()
        else:
            with clock.phase("draft"):
                proposal = self._draft()
            with clock.phase("verify"):
                logits = self._verify_forward(proposal)
        with clock.phase("verify"):
            p_rows, verdict = self._verify(logits, proposal)
        with clock.phase("commit"):
            emitted = self.sequence.accept(verdict.tokens)
            self._commit(proposal, verdict)
        self._schedule(proposal, verdict)
        record = self._record(RoundResult(proposal, p_rows, verdict, emitted), clock, forwards_before)
        self.rounds.append(record)
        self._busy_s = record.elapsed_s
        return record

    def _prefill(self) -> torch.Tensor:
        """Write the whole prompt's K/V (the invariant: every committed token but the last, which
        will be the first generated one) and return the target's logits row after it."""
        self._started = True
        logits, self._features = self.target_runner.forward_features(self.target_cache, self.prompt, last_only=True,
                                                                     features=self._needs_features, taps=self._taps)
        if self.drafter is not None:
            self.drafter.prefill(self.prompt, self._features)
        return logits

    def _draft(self) -> Proposal | TreeProposal | None:
        """Up to K drafts (or a tree), never more than the tokens still to generate leave room to verify."""
        remaining = self.sequence.remaining
        k = 0 if self.drafter is None else max(0, min(self.k, remaining - 1))
        if not k:
            return None
        if self.config.tree is not None:
            return self.drafter.propose_tree(self.tokens, self.config.tree,
                                             self.confidence.weigh if self.confidence else None)
        proposal = self.drafter.propose(self.tokens, k, min(K_BOUND, remaining - 1))
        return proposal if proposal.tokens else None

    def _verify_forward(self, proposal: Proposal | TreeProposal | None) -> torch.Tensor:
        """Target logits for [last, d1..dK]: K+1 rows, row K the bonus row; for a tree, one row per node
        (the root first), each node at its depth and attending to its ancestors."""
        extra: dict = {}
        if isinstance(proposal, TreeProposal):
            tree, past = proposal.tree, len(self.tokens) - 1
            feed = tree.tokens
            extra = {"positions": [past + d for d in tree.depths], "attn_mask": attention_mask(tree, past)}
        else:
            feed = [self.sequence.last, *(proposal.tokens if proposal else [])]
        forward = self.target_runner.forward_features
        if self.config.mode is Mode.V1:
            with self.target_cache.read_only():
                logits, self._features = forward(self.target_cache, feed, features=self._needs_features,
                                                 taps=self._taps, **extra)
        else:
            logits, self._features = forward(self.target_cache, feed, features=self._needs_features, taps=self._taps,
                                             **extra)
        return logits

    def _verify(self, logits: torch.Tensor,
                proposal: Proposal | TreeProposal | None) -> tuple[torch.Tensor, VerifyResult | TreeVerdict]:
        """(processed target rows, the round's verdict). Greedy rounds verify from the argmaxes
        (`verify_greedy`, the same result as `verify` on one-hot rows, without the [K+1, V] work)."""
        if isinstance(proposal, TreeProposal):
            greedy = self.config.sampling.greedy
            p_rows = one_hot_rows(greedy_ids(logits), logits.shape[1]) if greedy else \
                logits_to_probs(logits, self.config.sampling)
            return p_rows, verify_tree(proposal.tree, p_rows, self.gen_verify, greedy, self.config.tree.rule)
        if self.config.sampling.greedy:
            ids = greedy_ids(logits)
            p_rows = one_hot_rows(ids, logits.shape[1])
            if proposal is not None:
                return p_rows, verify_greedy(proposal.tokens, ids.tolist(), logits.shape[1], self.gen_verify)
            return p_rows, self._sample_only(p_rows, int(ids[-1]))
        p_rows = logits_to_probs(logits, self.config.sampling)
        if proposal is not None:
            return p_rows, verify(proposal.q_draft, p_rows, proposal.tokens, self.gen_verify, validate=False)
        return p_rows, self._sample_only(p_rows)

    def _sample_only(self, p_rows: torch.Tensor, greedy_token: int | None = None) -> VerifyResult:
        """K = 0: the token comes from the bonus row alone (target-only decoding, or no n-gram match).
        Consumes one uniform, as verify does for its final sample."""
        u = draw_uniform(1, self.gen_verify, p_rows.device)
        token = greedy_token if greedy_token is not None else int(sample_from(p_rows[-1:], u)[0])
        return VerifyResult(tokens=[token], accepted_count=0, rejected=False, target_positions_checked=0,
                            positions=[], final_token=token, final_outcome=Outcome.BONUS, final_row=0,
                            final_u=float(u[0]), residual=None)

    def _commit(self, proposal: Proposal | TreeProposal | None, verdict: VerifyResult | TreeVerdict) -> None:
        """Bring both caches back to the invariant: K/V of tokens[:-1]. A tree round first moves its
        accepted path's K/V next to the root's, into consecutive slots, and hands the drafter the
        features of the root and the path."""
        keep = len(self.tokens) - 1
        cache = self.target_cache
        if isinstance(proposal, TreeProposal):
            rows = [0, *verdict.path]
            if self.config.mode is not Mode.V1:   # v2 wrote the whole tree: its last len(tree) slots
                cache.compact(cache.table.length - len(proposal.tree.tokens), rows)
            if self._features is not None:
                self._features = self._features[rows]
        if self.config.mode is Mode.V1:
            # The seed system's second forward: commit the accepted tokens' K/V.
            feed = self.tokens[cache.table.length : keep]
            if feed:
                self.target_runner.forward(cache, feed, last_only=True)
        cache.rollback(cache.table.length - keep)
        if self.drafter is not None:
            self.drafter.commit(self.tokens, self._features)

    def _schedule(self, proposal: Proposal | TreeProposal | None, verdict: VerifyResult | TreeVerdict) -> None:
        """The next round's K (the heuristic schedule reacts to a fully accepted round); a tree round
        teaches the calibration what its children's q was worth."""
        if isinstance(proposal, TreeProposal) and self.confidence is not None:
            self.confidence.observe(proposal.tree, verdict)
        if isinstance(proposal, Proposal):
            self.k = self.config.next_k(self.k, verdict.accepted_count == len(proposal.tokens))

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

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

from engine.config import K_BOUND, DrafterKind, Mode, SpecConfig
from engine.drafters import Drafter, HybridDrafter, ModelDrafter, NgramDrafter, Proposal
from engine.kv_cache import PagedCache
from engine.models import LoadedModel, check_same_tokenizer
from engine.records import (
    Candidate,
    FinalRecord,
    KVState,
    PositionRecord,
    RoundRecord,
    RoundTimings,
    RunSummary,
    summarize,
)
from engine.runner import ModelRunner
from engine.sampling import draw_uniform, greedy_ids, logits_to_probs, one_hot_rows, sample_from
from engine.verify import Outcome, VerifyResult, verify, verify_greedy


class PromptError(ValueError):
    """The prompt cannot be decoded with these settings (empty, or too long for the context)."""


def encode_prompt(tokenizer, text: str) -> list[int]:
    if not text or not text.strip():
        raise PromptError("The prompt is empty: type some text (for the built-in pair, some Python code).")
    ids = tokenizer(text)["input_ids"]
    return list(ids)


class SpeculativeEngine:
    """One sequence decoded speculatively (or target-only), one round per `step()`.

    Owns its KV pools (one per model), so each session can have its own; the models are shared
    and read-only. Randomness comes from two generators seeded from `config.seed` (verification
    and drafting), so a seed reproduces a run exactly, and v1 and v2 consume draws identically.
    """

    def __init__(self, target: LoadedModel, draft: LoadedModel | None, prompt_ids: list[int],
                 config: SpecConfig, kv_blocks: int | None = None, eos_id: int | None = None) -> None:
        if not prompt_ids:
            raise PromptError("The prompt is empty.")
        self.config, self.target, self.draft = config, target, draft
        need = len(prompt_ids) + config.max_new_tokens
        if need > target.max_context:
            raise PromptError(
                f"The prompt has {len(prompt_ids)} tokens and max_new_tokens is {config.max_new_tokens}: "
                f"{need} tokens exceed the target's context of {target.max_context}. Shorten the prompt "
                f"or ask for fewer new tokens.")
        capacity = need + K_SLACK
        self.prompt = list(prompt_ids)
        self.tokens = list(prompt_ids)  # committed: prompt + generated
        self.eos_id = eos_id if eos_id is not None else target.tokenizer.eos_token_id
        self.target_runner = ModelRunner(target, capacity, config.block_size, num_blocks=kv_blocks,
                                         fused=config.fused_forward)
        self.target_cache = self.target_runner.new_sequence()
        self.gen_verify = torch.Generator().manual_seed(config.seed)
        self.gen_draft = torch.Generator().manual_seed(config.seed + 7919)
        self.drafter = self._make_drafter(capacity, kv_blocks)
        self.k = config.k
        self.rounds: list[RoundRecord] = []
        self._started = False
        self._busy_s = 0.0  # time spent inside step(): a stepping UI's idle time never counts
        self.finished = False

    def _make_drafter(self, capacity: int, kv_blocks: int | None) -> Drafter | None:
        c = self.config
        if c.mode is Mode.TARGET:
            return None
        ngram = NgramDrafter(c.ngram_max, c.ngram_min, self.target.vocab_size, self.target.device)
        if c.drafter is DrafterKind.NGRAM:
            return ngram
        if self.draft is None:
            raise ValueError(f"the {c.drafter.value} drafter needs a draft model")
        check_same_tokenizer(self.draft, self.target)
        runner = ModelRunner(self.draft, capacity, c.block_size, num_blocks=kv_blocks, fused=c.fused_forward)
        model = ModelDrafter(runner, c.sampling, self.target.vocab_size, self.target.device, self.gen_draft)
        if c.drafter is DrafterKind.HYBRID:
            return HybridDrafter(model, ngram, c.hybrid_min_n)
        return model

    # -- the round ------------------------------------------------------------------------------
    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt):]

    def step(self) -> RoundRecord:
        """Run one round and return its record. Raises RuntimeError once the run is finished.

        The first round is the prefill: one target forward over the whole prompt, whose last row
        gives the first token (as `generate` does), while the draft prefills alongside. Every
        later round drafts, verifies and commits.
        """
        if self.finished:
            raise RuntimeError("the run is finished; reset to decode again")
        t_start = time.perf_counter()
        forwards_before = self.target_runner.forwards
        remaining = self.config.max_new_tokens - len(self.generated)
        prefill_ms = draft_ms = 0.0
        drafted: list[int] = []
        proposal = None
        if not self._started:
            logits, prefill_ms = self._prefill()
            t = time.perf_counter()
        else:
            k = 0 if self.drafter is None else max(0, min(self.k, remaining - 1))
            t = time.perf_counter()
            proposal = self.drafter.propose(self.tokens, k, min(K_BOUND, remaining - 1)) if k else None
            drafted = proposal.tokens if proposal else []
            draft_ms = (time.perf_counter() - t) * 1000
            t = time.perf_counter()
            logits = self._verify_forward(drafted)
        p_rows, result = self._verify(logits, drafted, proposal)
        verify_ms = (time.perf_counter() - t) * 1000

        t = time.perf_counter()
        emitted = self._accept(result.tokens, remaining)
        self._commit(drafted, len(emitted))
        commit_ms = (time.perf_counter() - t) * 1000

        if drafted:
            self.k = self.config.next_k(self.k, result.accepted_count == len(drafted))
        record = self._record(drafted, proposal, p_rows, result, emitted, t_start, prefill_ms,
                              draft_ms, verify_ms, commit_ms, self.target_runner.forwards - forwards_before)
        self.rounds.append(record)
        self._busy_s = record.elapsed_s
        return record

    def _prefill(self) -> tuple[torch.Tensor, float]:
        """Write the whole prompt's K/V (the invariant: every committed token but the last, which
        will be the first generated one) and return the target's logits row after it."""
        t0 = time.perf_counter()
        self._started = True
        logits = self.target_runner.forward(self.target_cache, self.prompt, last_only=True)
        if self.drafter is not None:
            self.drafter.prefill(self.prompt)
        return logits, (time.perf_counter() - t0) * 1000

    def _verify_forward(self, drafted: list[int]) -> torch.Tensor:
        """Target logits for [last, d1..dK]: K+1 rows, row K the bonus row."""
        feed = [self.tokens[-1], *drafted]
        if self.config.mode is Mode.V1:
            with self.target_cache.read_only():
                return self.target_runner.forward(self.target_cache, feed)
        return self.target_runner.forward(self.target_cache, feed)

    def _verify(self, logits: torch.Tensor, drafted: list[int],
                proposal: Proposal | None) -> tuple[torch.Tensor, VerifyResult]:
        """(processed target rows, the round's verdict). Greedy rounds verify from the argmaxes
        (`verify_greedy`, the same result as `verify` on one-hot rows, without the [K+1, V] work)."""
        if self.config.sampling.greedy:
            ids = greedy_ids(logits)
            p_rows = one_hot_rows(ids, logits.shape[1])
            if drafted:
                return p_rows, verify_greedy(drafted, ids.tolist(), logits.shape[1], self.gen_verify)
            return p_rows, self._sample_only(p_rows, int(ids[-1]))
        p_rows = logits_to_probs(logits, self.config.sampling)
        if drafted:
            return p_rows, verify(proposal.q_draft, p_rows, drafted, self.gen_verify, validate=False)
        return p_rows, self._sample_only(p_rows)

    def _sample_only(self, p_rows: torch.Tensor, greedy_token: int | None = None) -> VerifyResult:
        """K = 0: the token comes from the bonus row alone (target-only decoding, or no n-gram match).
        Consumes one uniform, as verify does for its final sample."""
        u = draw_uniform(1, self.gen_verify, p_rows.device)
        token = greedy_token if greedy_token is not None else int(sample_from(p_rows[-1:], u)[0])
        return VerifyResult(tokens=[token], accepted_count=0, rejected=False, target_positions_checked=0,
                            positions=[], final_token=token, final_outcome=Outcome.BONUS, final_row=0,
                            final_u=float(u[0]), residual=None)

    def _accept(self, tokens: list[int], remaining: int) -> list[int]:
        """Append the round's tokens, cut at EOS or max_new_tokens (a prefix of a lossless sample is lossless)."""
        emitted = tokens[:remaining]
        if self.config.stop_at_eos and self.eos_id is not None and self.eos_id in emitted:
            emitted = emitted[: emitted.index(self.eos_id) + 1]
            self.finished = True
        self.tokens.extend(emitted)
        if len(self.generated) >= self.config.max_new_tokens:
            self.finished = True
        return emitted

    def _commit(self, drafted: list[int], n_emitted: int) -> None:
        """Bring both caches back to the invariant: K/V of tokens[:-1]."""
        keep = len(self.tokens) - 1
        cache = self.target_cache
        if self.config.mode is Mode.V1:
            # The seed system's second forward: commit the accepted tokens' K/V.
            feed = self.tokens[cache.table.length : keep]
            if feed:
                self.target_runner.forward(cache, feed, last_only=True)
        cache.rollback(cache.table.length - keep)
        if self.drafter is not None:
            self.drafter.commit(self.tokens)

    # -- records ----------------------------------------------------------------------------------
    def _text(self, token: int) -> str:
        return self.target.tokenizer.decode([token]) if self.config.record else ""

    def _candidates(self, p_row: torch.Tensor, q_row: torch.Tensor | None, must: list[int],
                    residual: torch.Tensor | None = None) -> list[Candidate]:
        if not self.config.record:
            return []
        n = self.config.top_n
        ids = set(torch.topk(p_row, min(n, p_row.numel())).indices.tolist()) | set(must)
        if q_row is not None:
            ids |= set(torch.topk(q_row, min(n, q_row.numel())).indices.tolist())
        if residual is not None:
            ids |= set(torch.topk(residual, min(n, residual.numel())).indices.tolist())
        out = [Candidate(t, self._text(t), float(p_row[t]), float(q_row[t]) if q_row is not None else 0.0,
                         float(residual[t]) if residual is not None else None) for t in ids]
        return sorted(out, key=lambda c: -max(c.p_target, c.q_draft, c.residual or 0.0))

    def _record(self, drafted, proposal, p_rows, result: VerifyResult, emitted, t_start,
                prefill_ms, draft_ms, verify_ms, commit_ms, target_forwards) -> RoundRecord:
        verdicts = {v.index: v for v in result.positions}
        positions = []
        for i, token in enumerate(drafted):
            v = verdicts.get(i)
            q_row = proposal.q_draft[i]
            positions.append(PositionRecord(
                index=i, token=token, text=self._text(token), q_draft=float(q_row[token]),
                p_target=v.p_target if v else None, alpha=v.alpha if v else None, u=v.u if v else None,
                outcome=v.outcome if v else Outcome.REJECTED, checked=v is not None,
                candidates=self._candidates(p_rows[i], q_row, [token]) if v else []))
        row = result.final_row
        q_final = proposal.q_draft[row] if result.final_outcome is Outcome.CORRECTED else None
        final = FinalRecord(
            token=result.final_token, text=self._text(result.final_token), outcome=result.final_outcome,
            row=row, u=result.final_u, p_target=float(p_rows[row][result.final_token]),
            candidates=self._candidates(p_rows[row], q_final, [result.final_token],
                                        result.residual if result.final_outcome is Outcome.CORRECTED else None))
        kv = [self._kv_state("target", self.target_cache, self.target)]
        if isinstance(self.drafter, (ModelDrafter, HybridDrafter)):
            kv.append(self._kv_state("draft", self.drafter.cache, self.draft))
        now = time.perf_counter()
        total_ms = (now - t_start) * 1000
        return RoundRecord(
            index=len(self.rounds), mode=self.config.mode.value,
            drafter="none" if self.drafter is None else self.drafter.kind.value, k=len(drafted),
            positions=positions, final=final, emitted=emitted,
            emitted_text=self.target.tokenizer.decode(emitted) if self.config.record else "",
            accepted=min(result.accepted_count, len(emitted)), kv=kv,
            timings=RoundTimings(prefill_ms, draft_ms, verify_ms, commit_ms,
                                 total_ms - prefill_ms - draft_ms - verify_ms - commit_ms, total_ms),
            target_forwards=target_forwards,
            draft_forwards=proposal.forwards if proposal else 0,
            tokens_total=len(self.generated), elapsed_s=self._busy_s + total_ms / 1000, finished=self.finished)

    def _kv_state(self, name: str, cache: PagedCache, loaded: LoadedModel) -> KVState:
        log = cache.drain_log()
        written = [s for kind, ch in log if kind == "write" for s in ch.slots]
        pool = cache.pool
        return KVState(
            model=name, device=str(pool.device), dtype=str(pool.dtype).replace("torch.", ""),
            block_size=pool.block_size, num_blocks=pool.num_blocks, block_table=list(cache.table.blocks),
            length=cache.table.length, prompt_len=len(self.prompt) - 1, written=written,
            rolled_back=[s for kind, ch in log if kind == "rollback" for s in ch.slots],
            blocks_allocated=[b for _, ch in log for b in ch.blocks_allocated],
            blocks_freed=[b for _, ch in log for b in ch.blocks_freed], pool_bytes=pool.nbytes)

    # -- whole runs ---------------------------------------------------------------------------------
    def run(self) -> list[RoundRecord]:
        while not self.finished:
            self.step()
        return self.rounds

    def summary(self) -> RunSummary:
        weights: dict[str, int] = {}
        kv: dict[str, int] = {}
        runners = [self.target_runner] + ([self.drafter.runner] if isinstance(self.drafter, (ModelDrafter, HybridDrafter)) else [])
        for r in runners:
            dev = str(r.loaded.device)
            weights[dev] = weights.get(dev, 0) + r.loaded.weight_bytes
            kv[dev] = kv.get(dev, 0) + r.pool.nbytes
        return summarize(self.rounds, weights, kv)

    def close(self) -> None:
        """Free this run's KV blocks (the pools themselves go with the engine)."""
        self.target_cache.free()
        if self.drafter is not None:
            self.drafter.close()


K_SLACK = 18  # room for a round's K+1 speculative slots beyond max_new_tokens (K <= 16)

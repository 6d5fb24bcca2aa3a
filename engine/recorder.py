"""Building a round's record from its tensors: the drafts, the target's rows, the verdict, the caches.

The speculative loop hands over one `RoundResult` per round; the recorder turns it into the typed
`RoundRecord` that traces store and renderers draw, reading token texts and top candidates only
when the run records for a UI (`SpecConfig.record`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from engine.config import DrafterKind, Mode, SpecConfig
from engine.drafters.base import Proposal
from engine.kv_cache import PagedCache
from engine.records import Candidate, FinalRecord, KVState, Outcome, PositionRecord, RoundRecord, RoundTimings
from engine.verify import VerifyResult


@dataclass(frozen=True, slots=True)
class RoundResult:
    """What one round did, before it becomes a record."""

    proposal: Proposal | None      # None: nothing drafted (the prefill, target-only, no n-gram match)
    p_rows: torch.Tensor           # [K+1, V] the target's processed rows (one-hot when greedy)
    verdict: VerifyResult
    emitted: list[int]             # what the sequence kept (cut at EOS or the budget)

    @property
    def drafted(self) -> list[int]:
        return self.proposal.tokens if self.proposal is not None else []


@dataclass(frozen=True, slots=True)
class RunState:
    """The run around a round: counts the record carries."""

    index: int
    tokens_total: int
    elapsed_s: float
    finished: bool
    target_forwards: int


def kv_state(name: str, cache: PagedCache, prompt_len: int) -> KVState:
    """One cache after a round, with the slots and blocks the round wrote, rolled back, took and freed."""
    log = cache.drain_log()
    pool = cache.pool
    return KVState(
        model=name, device=str(pool.device), dtype=str(pool.dtype).replace("torch.", ""),
        block_size=pool.block_size, num_blocks=pool.num_blocks, block_table=list(cache.table.blocks),
        length=cache.table.length, prompt_len=prompt_len,
        written=[s for kind, ch in log if kind == "write" for s in ch.slots],
        rolled_back=[s for kind, ch in log if kind == "rollback" for s in ch.slots],
        blocks_allocated=[b for _, ch in log for b in ch.blocks_allocated],
        blocks_freed=[b for _, ch in log for b in ch.blocks_freed], pool_bytes=pool.nbytes)


class RoundRecorder:
    """Builds RoundRecords for one run."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, config: SpecConfig, drafter: DrafterKind | None) -> None:
        self.tokenizer, self.config, self.drafter = tokenizer, config, drafter

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token]) if self.config.record else ""

    def candidates(self, p_row: torch.Tensor, q_row: torch.Tensor | None, must: list[int],
                   residual: torch.Tensor | None = None) -> list[Candidate]:
        """The top tokens of p, q and the residual (plus `must`), for the p/q bars; [] when not recording."""
        if not self.config.record:
            return []
        n = self.config.top_n
        ids = set(torch.topk(p_row, min(n, p_row.numel())).indices.tolist()) | set(must)
        for row in (q_row, residual):
            if row is not None:
                ids |= set(torch.topk(row, min(n, row.numel())).indices.tolist())
        out = [Candidate(t, self._text(t), float(p_row[t]), float(q_row[t]) if q_row is not None else 0.0,
                         float(residual[t]) if residual is not None else None) for t in ids]
        return sorted(out, key=lambda c: -max(c.p_target, c.q_draft, c.residual or 0.0))

    def positions(self, result: RoundResult) -> list[PositionRecord]:
        """One record per draft: its verdict, or UNCHECKED after the rejection."""
        verdicts = {v.index: v for v in result.verdict.positions}
        out = []
        for i, token in enumerate(result.drafted):
            v, q_row = verdicts.get(i), result.proposal.q_draft[i]
            out.append(PositionRecord(
                index=i, token=token, text=self._text(token), q_draft=float(q_row[token]),
                p_target=v.p_target if v else None, alpha=v.alpha if v else None, u=v.u if v else None,
                outcome=v.outcome if v else Outcome.UNCHECKED,
                candidates=self.candidates(result.p_rows[i], q_row, [token]) if v else []))
        return out

    def final(self, result: RoundResult) -> FinalRecord:
        v = result.verdict
        corrected = v.final_outcome is Outcome.CORRECTED
        q_row = result.proposal.q_draft[v.final_row] if corrected else None
        return FinalRecord(
            token=v.final_token, text=self._text(v.final_token), outcome=v.final_outcome, row=v.final_row,
            u=v.final_u, p_target=float(result.p_rows[v.final_row][v.final_token]),
            candidates=self.candidates(result.p_rows[v.final_row], q_row, [v.final_token],
                                       v.residual if corrected else None))

    def round(self, result: RoundResult, timings: RoundTimings, kv: list[KVState], run: RunState) -> RoundRecord:
        proposal = result.proposal
        return RoundRecord(
            index=run.index, mode=self.config.mode, drafter=self.drafter,
            proposer=proposal.source if proposal is not None and proposal.tokens else None,
            k=len(result.drafted), positions=self.positions(result), final=self.final(result),
            emitted=result.emitted, emitted_text=self.tokenizer.decode(result.emitted) if self.config.record else "",
            accepted=min(result.verdict.accepted_count, len(result.emitted)), kv=kv, timings=timings,
            target_forwards=run.target_forwards, draft_forwards=proposal.forwards if proposal else 0,
            tokens_total=run.tokens_total, elapsed_s=run.elapsed_s, finished=run.finished)


def drafter_of(config: SpecConfig) -> DrafterKind | None:
    """The drafter a run records: None for target-only runs."""
    return None if config.mode is Mode.TARGET else config.drafter

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
from engine.drafters.base import Proposal, TreeProposal
from engine.kv_cache import PagedCache
from engine.records import (
    Candidate,
    FinalRecord,
    KVState,
    Outcome,
    PositionRecord,
    RoundRecord,
    RoundTimings,
    TreeNode,
    TreeRecord,
)
from engine.text import StreamDecoder, TokenText
from engine.verify import Verdict


@dataclass(frozen=True, slots=True)
class RoundResult:
    """What one round did, before it becomes a record."""

    proposal: Proposal | TreeProposal | None   # None: nothing drafted (the prefill, target-only, no n-gram match)
    p_rows: torch.Tensor           # [K+1, V] the target's processed rows (one-hot when greedy); a tree: one per node
    verdict: Verdict
    emitted: list[int]             # what the sequence kept (cut at EOS or the budget)

    @property
    def drafted(self) -> list[int]:
        return self.proposal.drafted if self.proposal is not None else []


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
        blocks_freed=[b for _, ch in log for b in ch.blocks_freed], pool_bytes=pool.nbytes,
        moved=[s for kind, ch in log if kind == "move" for s in ch.slots])


class RoundRecorder:
    """Builds RoundRecords for one run."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, config: SpecConfig, drafter: DrafterKind | None,
                 prompt: list[int] = ()) -> None:
        self.tokenizer, self.config, self.drafter = tokenizer, config, drafter
        self.stream = StreamDecoder(tokenizer)   # the committed tokens, read as one text
        if config.record:
            self.stream.feed_all(list(prompt))

    def _text(self, decoder: StreamDecoder, token: int) -> TokenText:
        return decoder.feed(token) if self.config.record else TokenText("", False, b"")

    def candidates(self, context: StreamDecoder, p_row: torch.Tensor, q_row: torch.Tensor | None, must: list[int],
                   residual: torch.Tensor | None = None) -> list[Candidate]:
        """The top tokens of p, q and the residual (plus `must`), each read after `context`, for the p/q
        bars; [] when not recording."""
        if not self.config.record:
            return []
        n = self.config.top_n
        ids = set(torch.topk(p_row, min(n, p_row.numel())).indices.tolist()) | set(must)
        for row in (q_row, residual):
            if row is not None:
                ids |= set(torch.topk(row, min(n, row.numel())).indices.tolist())
        out = []
        for t in ids:
            text = self._text(context.copy(), t)
            out.append(Candidate(t, text.text, float(p_row[t]), float(q_row[t]) if q_row is not None else 0.0,
                                 float(residual[t]) if residual is not None else None, text.pending))
        return sorted(out, key=lambda c: -max(c.p_target, c.q_draft, c.residual or 0.0))

    def positions(self, result: RoundResult) -> list[PositionRecord]:
        """One record per draft: its verdict, or UNCHECKED after the rejection. Each draft is read after
        the committed text and the drafts before it."""
        verdicts = {v.index: v for v in result.verdict.tested}
        out, reader = [], self.stream.copy()
        for i, token in enumerate(result.drafted):
            v, q_row = verdicts.get(i), result.proposal.q_draft[i]
            context = reader.copy()
            text = self._text(reader, token)
            out.append(PositionRecord(
                index=i, token=token, text=text.text, q_draft=float(q_row[token]),
                p_target=v.p_target if v else None, alpha=v.alpha if v else None, u=v.u if v else None,
                outcome=v.outcome if v else Outcome.UNCHECKED,
                candidates=self.candidates(context, result.p_rows[i], q_row, [token]) if v else [],
                pending=text.pending))
        return out

    def final(self, result: RoundResult) -> FinalRecord:
        """The round's last token, read after the committed text and the accepted drafts (a chain's prefix or
        a tree's path); a correction's candidates show p, q and the residual it was drawn from."""
        v = result.verdict
        corrected = v.final_outcome is Outcome.CORRECTED
        q_row = result.proposal.q_row(v.final_row) if corrected else None
        context = self.stream.copy()
        if self.config.record:
            context.feed_all(v.tokens[:-1])
        text = self._text(context.copy(), v.final_token)
        return FinalRecord(
            token=v.final_token, text=text.text, outcome=v.final_outcome, row=v.final_row,
            u=v.final_u, p_target=float(result.p_rows[v.final_row][v.final_token]),
            candidates=self.candidates(context, result.p_rows[v.final_row], q_row, [v.final_token],
                                       v.residual if corrected else None), pending=text.pending)

    def tree(self, result: RoundResult) -> TreeRecord:
        """Every node of a tree round with its test (or UNCHECKED), read after the committed text and its
        ancestors; the candidates of a tested node are its parent's p and q rows."""
        tree, verdict = result.proposal.tree, result.verdict
        tests = {t.index: t for t in verdict.tested}
        readers = {0: self.stream.copy()}
        nodes = []
        for i in range(1, len(tree.tokens)):
            parent, token = tree.parents[i], tree.tokens[i]
            readers[i] = readers[parent].copy()
            context = readers[parent].copy()
            text = self._text(readers[i], token)
            t = tests.get(i)
            q_row = tree.q_rows.get(parent)
            copied = tree.copied(i)
            q = t.q_draft if t else 1.0 if copied else float(q_row[token]) if q_row is not None else 0.0
            nodes.append(TreeNode(
                i, parent, tree.depths[i], token, text.text, tree.scores[i], q,
                t.p_target if t else None, t.alpha if t else None, t.u if t else None,
                t.outcome if t else Outcome.UNCHECKED,
                self.candidates(context, result.p_rows[parent], q_row, [token]) if t else [], text.pending,
                copied))
        return TreeRecord(self.config.tree.label(), nodes, list(verdict.path), verdict.final_row)

    def round(self, result: RoundResult, timings: RoundTimings, kv: list[KVState], run: RunState) -> RoundRecord:
        proposal = result.proposal
        tree = self.tree(result) if proposal is not None and proposal.tree is not None else None
        positions, final = self.positions(result) if tree is None else [], self.final(result)
        emitted_text = "".join(t.text for t in self.stream.feed_all(result.emitted)) if self.config.record else ""
        return RoundRecord(
            index=run.index, mode=self.config.mode, drafter=self.drafter,
            proposer=proposal.source if proposal is not None and result.drafted else None,
            k=len(result.drafted), positions=positions, final=final,
            emitted=result.emitted, emitted_text=emitted_text,
            accepted=min(result.verdict.accepted_count, len(result.emitted)), kv=kv, timings=timings,
            target_forwards=run.target_forwards, draft_forwards=proposal.forwards if proposal else 0,
            tokens_total=run.tokens_total, elapsed_s=run.elapsed_s, finished=run.finished, tree=tree)


def drafter_of(config: SpecConfig) -> DrafterKind | None:
    """The drafter a run records: None for target-only runs."""
    return None if config.mode is Mode.TARGET else config.drafter

"""Drafters: propose K tokens and the q_draft rows they were drawn from, behind one interface."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.config import DrafterKind
from engine.kv_cache import PagedCache
from engine.runner import ModelRunner
from engine.sampling import SamplingParams, draw_uniform, greedy_ids, logits_to_probs, one_hot_rows, sample_from
from engine.verify import align_vocab


@dataclass(frozen=True, slots=True)
class Proposal:
    tokens: list[int]        # up to k drafted ids (an n-gram drafter may find fewer, even none)
    q_draft: torch.Tensor    # [len(tokens), V_target] float32 on the target's device
    forwards: int            # draft-model forwards spent


class Drafter(Protocol):
    kind: DrafterKind

    def prefill(self, prompt: list[int]) -> None: ...
    def propose(self, committed: list[int], k: int, limit: int | None = None) -> Proposal: ...
    def commit(self, committed: list[int]) -> None: ...
    def close(self) -> None: ...


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class ModelDrafter:
    """A small causal LM with its own paged cache, kept in step with the committed tokens.

    Its cache holds committed[:-1] between rounds, like the target's. A round feeds whatever is
    pending (the last committed token, plus the last accepted draft if the draft never cached it),
    then one token per forward. Logits are aligned to the target's vocabulary *before* softmax
    (padding with -inf), so the draft can never propose an id the target does not have.
    """

    kind = DrafterKind.MODEL

    def __init__(self, runner: ModelRunner, sampling: SamplingParams, target_vocab: int,
                 target_device: torch.device, generator: torch.Generator) -> None:
        self.runner, self.sampling = runner, sampling
        self.target_vocab, self.target_device = target_vocab, target_device
        self.generator = generator
        self.cache: PagedCache = runner.new_sequence()
        self.stand_in = runner.loaded.tokenizer.eos_token_id or 0

    def prefill(self, prompt: list[int]) -> None:
        if len(prompt) > 1:
            self.runner.forward(self.cache, self._draftable(prompt[:-1]), last_only=True)

    def _aligned(self, logits: torch.Tensor) -> torch.Tensor:
        return align_vocab(logits[-1:], self.target_vocab, fill=float("-inf"),
                           device=self.target_device, dtype=torch.float32)

    def propose(self, committed: list[int], k: int, limit: int | None = None) -> Proposal:
        """K tokens, one forward each, every one drawn with one uniform from the generator.

        Greedy q rows are one-hot on the drafted tokens, so they are built once at the end
        instead of per step (the draft forward is cheap enough that per-step [1, V] work shows)."""
        feed = self._draftable(committed[self.cache.table.length:])
        rows, tokens = [], []
        for _ in range(k):
            logits = self._aligned(self.runner.forward(self.cache, feed, last_only=True))
            u = draw_uniform(1, self.generator, logits.device)
            if self.sampling.greedy:
                token = int(greedy_ids(logits)[0])
            else:
                q = logits_to_probs(logits, self.sampling)
                token = int(sample_from(q, u)[0])
                rows.append(q[0])
            tokens.append(token)
            feed = self._draftable([token])
        if self.sampling.greedy:
            q_draft = one_hot_rows(torch.tensor(tokens, dtype=torch.long, device=self.target_device), self.target_vocab)
        else:
            q_draft = torch.stack(rows)
        return Proposal(tokens, q_draft, k)

    def _draftable(self, tokens: list[int]) -> list[int]:
        # A target with more vocabulary rows can emit ids the draft has no embedding for (padding
        # rows in real pairs). The draft only proposes, so feeding it a stand-in id can cost
        # acceptance but never correctness.
        vocab = self.runner.vocab_size
        return [t if t < vocab else self.stand_in for t in tokens]

    def commit(self, committed: list[int]) -> None:
        keep = min(common_prefix(self.cache.tokens, self._draftable(committed)), len(committed) - 1)
        self.cache.rollback(self.cache.table.length - keep)

    def close(self) -> None:
        self.cache.free()


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the last n tokens (n from ngram_max down
    to ngram_min) and propose what followed it. q_draft is one-hot, so accept-probability is p(x).
    Costs no model forward."""

    kind = DrafterKind.NGRAM

    def __init__(self, ngram_max: int, ngram_min: int, target_vocab: int, target_device: torch.device) -> None:
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        self.target_vocab, self.target_device = target_vocab, target_device

    def prefill(self, prompt: list[int]) -> None:
        pass

    def lookup(self, committed: list[int], k: int) -> list[int]:
        return self.match(committed, k)[1]

    def match(self, committed: list[int], k: int) -> tuple[int, list[int]]:
        """(n, up to k tokens): the longest suffix of n tokens (ngram_max..ngram_min) that occurred
        before, and what followed its latest earlier occurrence; (0, []) when none did."""
        n_tokens = len(committed)
        for n in range(min(self.ngram_max, n_tokens - 1), self.ngram_min - 1, -1):
            pattern = committed[-n:]
            for start in range(n_tokens - n - 1, -1, -1):
                if committed[start : start + n] == pattern:
                    return n, committed[start + n : start + n + k]
        return 0, []

    def propose(self, committed: list[int], k: int, limit: int | None = None) -> Proposal:
        return self.proposal(self.lookup(committed, k))

    def proposal(self, tokens: list[int]) -> Proposal:
        tokens = [t for t in tokens if t < self.target_vocab]
        q = torch.zeros(len(tokens), self.target_vocab, device=self.target_device)
        if tokens:
            q[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
        return Proposal(tokens, q, 0)

    def commit(self, committed: list[int]) -> None:
        pass

    def close(self) -> None:
        pass


class HybridDrafter:
    """Prompt lookup when the context repeats, the draft model otherwise.

    If the last `min_n` or more committed tokens occurred earlier, the round copies what followed
    them (up to 2K tokens: a copy costs no draft forward, so a longer guess is cheap); otherwise
    the draft model proposes K. Repetitive stretches (loops, repeated identifiers, boilerplate)
    then cost no drafting, and the model covers the rest. The model's cache catches up on the
    tokens it skipped at its next proposal, in one forward.
    """

    kind = DrafterKind.HYBRID

    def __init__(self, model: ModelDrafter, ngram: NgramDrafter, min_n: int) -> None:
        self.model, self.ngram, self.min_n = model, ngram, min_n
        self.cache, self.runner = model.cache, model.runner

    def prefill(self, prompt: list[int]) -> None:
        self.model.prefill(prompt)

    def propose(self, committed: list[int], k: int, limit: int | None = None) -> Proposal:
        """`limit`: the most tokens this round may draft (the engine's remaining budget and K bound)."""
        n, copied = self.ngram.match(committed, min(2 * k, limit if limit is not None else 2 * k))
        if n >= self.min_n and copied:
            return self.ngram.proposal(copied)
        return self.model.propose(committed, k)

    def commit(self, committed: list[int]) -> None:
        self.model.commit(committed)

    def close(self) -> None:
        self.model.close()

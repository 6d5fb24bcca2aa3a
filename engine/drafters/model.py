"""The draft-model drafter: a small causal LM with its own paged cache proposes K tokens."""
from __future__ import annotations

import torch

from engine.config import DrafterKind, TreeSpec
from engine.drafters.base import DraftCache, DraftSteps, Proposal, TreeProposal, common_prefix, drive
from engine.kv_cache import PagedCache
from engine.models import LoadedModel
from engine.runner import ForwardRequest, ModelRunner
from engine.sampling import SamplingParams, draw_uniform, greedy_ids, logits_to_probs, one_hot_rows, sample_from
from engine.tree import CopyAt, DraftTree, Weigh, attention_mask, grow
from engine.verify import align_vocab


def stand_in_id(draft: LoadedModel) -> int:
    """The id fed to the draft in place of a target id it has no embedding for."""
    return draft.tokenizer.eos_token_id or 0


def draftable(tokens: list[int], vocab: int, stand_in: int) -> list[int]:
    """`tokens` as the draft can read them. A target with more vocabulary rows can emit ids the draft
    has no embedding for (padding rows in real pairs). The draft only proposes, so feeding it a
    stand-in id can cost acceptance but never correctness."""
    return [t if t < vocab else stand_in for t in tokens]


class ModelDrafter:
    """A small causal LM with its own paged cache, kept in step with the committed tokens.

    Its cache holds committed[:-1] between rounds, like the target's. A round feeds whatever is
    pending (the last committed token, plus the last accepted draft if the draft never cached it),
    then one token per forward. Logits are aligned to the target's vocabulary *before* softmax
    (padding with -inf), so the draft can never propose an id the target does not have.
    """

    kind = DrafterKind.MODEL
    needs_features = False
    feature_layers = ()

    def __init__(self, runner: ModelRunner, sampling: SamplingParams, target_vocab: int,
                 target_device: torch.device, generator: torch.Generator) -> None:
        self.runner, self.sampling = runner, sampling
        self.target_vocab, self.target_device = target_vocab, target_device
        self.generator = generator
        self.cache: PagedCache = runner.new_sequence()
        self.stand_in = stand_in_id(runner.loaded)
        self._tree_base: int | None = None   # cache length before a tree round's nodes

    def prefill(self, prompt: list[int], features: torch.Tensor | None = None) -> None:
        if len(prompt) > 1:
            self.runner.forward(self.cache, self._draftable(prompt[:-1]), last_only=True)

    def _aligned(self, logits: torch.Tensor) -> torch.Tensor:
        return align_vocab(logits[-1:], self.target_vocab, fill=float("-inf"),
                           device=self.target_device, dtype=torch.float32)

    def propose(self, committed: list[int], k: int, limit: int | None = None) -> Proposal:
        """K tokens, one forward each, every one drawn with one uniform from the generator.

        Greedy q rows are one-hot on the drafted tokens, so they are built once at the end
        instead of per step (the draft forward is cheap enough that per-step [1, V] work shows)."""
        return drive(self.propose_steps(committed, k, limit))

    def propose_steps(self, committed: list[int], k: int, limit: int | None = None) -> DraftSteps:
        """`propose` as steps: yields each draft forward (a ForwardRequest on the draft's runner) and is sent its
        (logits, features); returns the Proposal. A batch runs its sequences' steps as one forward."""
        feed = self._draftable(committed[self.cache.table.length:])
        rows, tokens = [], []
        for _ in range(k):
            logits, _ = yield ForwardRequest(self.runner, self.cache, feed, last_only=True)
            logits = self._aligned(logits)
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
        return Proposal(tokens, q_draft, k, self.kind)

    def _draftable(self, tokens: list[int]) -> list[int]:
        return draftable(tokens, self.runner.vocab_size, self.stand_in)

    def propose_tree(self, committed: list[int], spec: TreeSpec, weigh: Weigh | None = None,
                     copy_at: CopyAt | None = None) -> TreeProposal:
        """A draft tree: one forward up to the root, then one per level of nodes (engine.tree.grow), each
        node attending to the committed context and its ancestors."""
        feed, root_position, forwards = self._draftable(committed[self.cache.table.length:]), len(committed) - 1, 0
        fed: list[int] = []

        def rows_at(tree: DraftTree, nodes: list[int]) -> dict[int, torch.Tensor]:
            nonlocal forwards
            forwards += 1
            if nodes == [0]:
                self._tree_base = len(committed)
                return {0: self._rows(self.runner.forward(self.cache, feed, last_only=True))[0]}
            fed.extend(nodes)
            mask = attention_mask(tree, self._tree_base, nodes, fed)
            logits, _ = self.runner.forward_features(
                self.cache, self._draftable([tree.tokens[i] for i in nodes]), features=False,
                positions=[root_position + tree.depths[i] for i in nodes], attn_mask=mask)
            return dict(zip(nodes, self._rows(logits)))

        tree = grow(spec, committed[-1], rows_at, self.sampling.greedy, self.generator, weigh, copy_at)
        return TreeProposal(tree, forwards, self.kind)

    def _rows(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft rows for a tree: the distributions children are drawn from when sampling; when greedy,
        the draft's plain softmax, which only ranks the children (a greedy walk never reads q)."""
        aligned = align_vocab(logits, self.target_vocab, fill=float("-inf"), device=self.target_device,
                              dtype=torch.float32)
        return torch.softmax(aligned, dim=-1) if self.sampling.greedy else logits_to_probs(aligned, self.sampling)

    def commit(self, committed: list[int], features: torch.Tensor | None = None) -> None:
        if self._tree_base is not None:   # a tree round: its nodes leave the cache, the accepted path is refed
            self.cache.rollback(self.cache.table.length - self._tree_base)
            self._tree_base = None
        keep = min(common_prefix(self.cache.tokens, self._draftable(committed)), len(committed) - 1)
        self.cache.rollback(self.cache.table.length - keep)

    def caches(self) -> list[DraftCache]:
        loaded = self.runner.loaded
        return [DraftCache("draft", self.cache, str(loaded.device), loaded.weight_bytes)]

    def drain_forward_ms(self) -> list[float]:
        return self.runner.drain_forward_ms()

    def close(self) -> None:
        self.cache.free()

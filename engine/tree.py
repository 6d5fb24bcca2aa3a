"""Tree speculation: the shape of a draft tree, its construction from a drafter's distributions, the
attention mask that verifies it in one target forward, and its lossless verification.

A tree round drafts N nodes below the root (the last committed token). Node i sits at depth d_i and
sees the committed context plus its own ancestors; one target forward over [root, nodes...] gives a
p row at every node. The walk starts at the root; at each accepted node it tests that node's
children, and stops with a correction (no child accepted) or a bonus (a leaf was accepted).

Construction (`grow`) builds the tree that best-first growth over "draw the next child of node v"
options would, EAGLE-2 style (Li et al. 2024): an option's priority is the cumulative draft probability
of v times the draft mass still available to its next child. Children of v are drawn in order: greedily the
most likely first; when sampling, without replacement from q_v (Gumbel top-k). Whether v gets its j-th
child is decided before that child is drawn (it depends on earlier draws only), which is what keeps
sampling lossless. The drafter runs once per level of the tree, on every node of that level that may
still get children, not once per node: the same tree at a fraction of the draft forwards.

A hybrid drafter also merges prompt lookup into the tree, as SpecInfer merges the trees of several
speculators: wherever a node's context (the committed tokens and the node's path) ends in an n-gram
that occurred earlier, the token that followed it becomes the node's first child, before the model's
own children (which are then the model's choices without that token). Copies and model children
compete for the same budget, so a copy can continue a model's branch and the model a copied one.

Verification at T > 0 is recursive rejection sampling without replacement (Jeon et al. 2024, after
SpecInfer's multi-step speculative sampling, Miao et al. 2024). At node v with target row p and draft
row q, children c_1, c_2, ... (drawn without replacement from q):
    accept c_i with probability min(1, p(c_i) / q_i(c_i)), where q_i is q renormalised without c_1..c_{i-1};
    on rejection p <- normalise(max(0, p - q_i)), and try c_{i+1};
    if every child is rejected, emit a correction drawn from the last p.
A copied child (prompt lookup, always the first child of its node) was proposed with certainty: its
q_1 is one-hot, so it is accepted with probability p(c_1) and a rejection removes c_1 from p; the model's
children were drawn from q without c_1, which is q_2.
Why it is lossless: each test is one step of ordinary speculative sampling with draft q_i and target
p_i, whose output (the accepted c_i, or a draw from the residual) is distributed as p_i; a rejected
c_i has p_i(c_i) < q_i(c_i), so the residual gives it no mass, and drawing the next child from q
without c_1..c_i is exactly drawing from q_{i+1}. By induction from the last child, the token emitted
at v is distributed as p_v, and so is the whole accepted path. Skipping the residual update between
siblings is the classic mistake; it lives with the lab (playground.teach.losslessness.no_residual_update),
which hands it to `verify_tree` to show the losslessness test fail.
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from engine.config import SpecConfig, TreeSpec
from engine.records import Outcome
from engine.sampling import draw_uniform, sample_from
from engine.verify import PositionVerdict, Verdict, acceptance_probability


@dataclass(slots=True)
class DraftTree:
    """A drafted tree. Node 0 is the root (the last committed token, not drafted); nodes 1..N are drafts.

    parents[i] < i for i >= 1; q_rows[v] is the distribution v's children were drawn from (every node
    that has children has one), over the target's vocabulary. ranks[i] is node i's place in its
    parent's q order (0: the draft's first choice), or COPIED when prompt lookup proposed it.
    """

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    children: list[list[int]]
    q_rows: dict[int, Tensor] = field(default_factory=dict)
    scores: list[float] = field(default_factory=list)   # cumulative draft probability of each node
    ranks: list[int] = field(default_factory=list)

    @staticmethod
    def root(token: int) -> "DraftTree":
        return DraftTree([token], [-1], [0], [[]], {}, [1.0], [0])

    def add(self, parent: int, token: int, score: float, rank: int | None = None) -> int:
        """Add a child of `parent`; its rank defaults to its place among the parent's children."""
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.children.append([])
        self.scores.append(score)
        self.ranks.append(len(self.children[parent]) if rank is None else rank)
        self.children[parent].append(len(self.tokens) - 1)
        return len(self.tokens) - 1

    def copied(self, node: int) -> bool:
        """Whether prompt lookup proposed this node."""
        return self.ranks[node] == COPIED

    @property
    def size(self) -> int:
        """Drafted nodes (the root excluded)."""
        return len(self.tokens) - 1

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's first child down to `node`."""
        out = []
        while node > 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def ancestor_mask(self, nodes: list[int] | None = None) -> Tensor:
        """[len(nodes), size + 1] bool: row i marks the tree nodes node i attends to (itself and its ancestors)."""
        nodes = list(range(len(self.tokens))) if nodes is None else nodes
        mask = torch.zeros(len(nodes), len(self.tokens), dtype=torch.bool)
        for row, node in enumerate(nodes):
            while node >= 0:
                mask[row, node] = True
                node = self.parents[node]
        return mask


def attention_mask(tree: DraftTree, past: int, nodes: list[int] | None = None,
                   fed: list[int] | None = None) -> Tensor:
    """[len(nodes), past + len(fed)] bool for feeding `nodes` after a cache that holds `past` committed
    tokens and then the tree nodes `fed` (in cache order, ending with `nodes`): every committed token
    is visible; a tree node only to its descendants."""
    nodes = list(range(len(tree.tokens))) if nodes is None else nodes
    fed = nodes if fed is None else fed
    ancestry = tree.ancestor_mask(nodes)[:, fed]
    return torch.cat([torch.ones(len(nodes), past, dtype=torch.bool), ancestry], dim=1)


# -- construction -----------------------------------------------------------------------------------
RowsAt = Callable[["DraftTree", list[int]], dict[int, Tensor]]   # (tree, nodes) -> their draft rows, one forward
CopyAt = Callable[["DraftTree", int], "int | None"]   # (tree, node) -> prompt lookup's token after the node, if any
Weigh = Callable[[float, int, int], float]   # (a child's q, its rank (DraftTree.ranks), its depth) -> its chance
COPIED = -1   # the rank of a child proposed by prompt lookup


def _ranked(rows: list[Tensor], limit: int) -> list[tuple[list[float], list[int]]]:
    """Each row's `limit` most likely tokens and their q, best first: one top-k for a level's rows."""
    values, indices = torch.topk(torch.stack(rows), min(limit, rows[0].shape[0]), dim=-1)
    return list(zip(values.tolist(), indices.tolist()))


def _draw_order(q: Tensor, greedy: bool, generator: torch.Generator, limit: int,
                copy: int | None = None,
                ranked: tuple[list[float], list[int]] | None = None) -> tuple[list[int], list[int], list[float]]:
    """The first `limit` children of a node in draw order, their ranks and their q: by probability when
    greedy, else a sample without replacement from q (Gumbel top-k: the order of log q + Gumbel noise).
    A copied token comes first, and the model's children are then drawn from q without it. `ranked`: q's
    `limit` + 1 most likely tokens, best first (_ranked), when greedy and already known."""
    if greedy and ranked is not None:   # a child's rank is its place in the draft's own order, a copy's too
        values, tokens = ranked
        order = [(t, r, v) for r, (v, t) in enumerate(zip(values, tokens)) if v > 0 and t != copy]
        order = order[:limit - (copy is not None)]
        if copy is not None:
            order.insert(0, (copy, COPIED, float(q[copy])))
        return [t for t, _, _ in order], [r for _, r, _ in order], [v for _, _, v in order]
    if copy is not None:
        rest, ranks, _ = _draw_order(q.clone().index_fill_(0, torch.tensor([copy], device=q.device), 0.0),
                                     greedy, generator, limit - 1)
        if greedy:   # a greedy child's rank is its place in the draft's own order, the copy left out
            above = int((q > q[copy]).sum())
            ranks = [r + (r >= above) for r in ranks]
        tokens = [copy, *rest]
        return tokens, [COPIED, *ranks], q[torch.tensor(tokens, device=q.device)].tolist()
    ids = torch.nonzero(q > 0).flatten()     # q's support: the draws are among it (top-p keeps it small)
    limit = min(limit, ids.shape[0])
    if limit <= 0:
        return [], [], []
    if greedy:
        values, indices = torch.topk(q, limit)
        return indices.tolist(), list(range(limit)), values.tolist()
    u = draw_uniform(ids.shape[0], generator, q.device).clamp(min=1e-300)
    keys = q[ids].double().log() - (-u.log()).log()
    tokens = ids[torch.topk(keys, limit).indices]
    return tokens.tolist(), list(range(limit)), q[tokens].tolist()


class _Growth:
    """The candidates of one tree's growth, kept in a working tree (every node whose children might be
    chosen, and those children), with each candidate's turn: when best-first growth would add it.

    Best-first growth (EAGLE-2) adds "the next child of v" in order of its priority: score(v) times
    that child's weighed q when greedy (the order is known), the q mass not yet drawn from v when
    sampling (known before the draw). A child can be added only after its parent and its previous
    sibling, so its turn is the lower of its own priority and its predecessor's turn; the tree of N
    nodes is the first N candidates by turn (ties: the earlier candidate) whose predecessor is in and
    whose depth still has room. Every key is fixed once a candidate exists, so the choice among the
    candidates known so far holds every node of the final tree that is known yet: more candidates
    only push a node down. That is what lets a whole level be drafted in one forward."""

    def __init__(self, spec: TreeSpec, root_token: int, greedy: bool, generator: torch.Generator,
                 weigh: Weigh, copy_at: CopyAt | None) -> None:
        self.spec, self.greedy, self.generator, self.weigh, self.copy_at = spec, greedy, generator, weigh, copy_at
        self.work = DraftTree.root(root_token)
        self.turn = [math.inf]     # the root is always in
        self.before = [-1]         # the candidate that must be in first: previous sibling, else parent
        self.caps = list(spec.widths) if spec.widths else None

    def chosen(self) -> list[int]:
        """The tree among the candidates so far, in turn order (parents before children, siblings in draw order)."""
        work, taken, filled, out = self.work, {0}, [0] * (self.spec.max_depth + 1), []
        for node in sorted(range(1, len(work.tokens)), key=lambda n: (-self.turn[n], n)):
            if len(out) == self.spec.nodes:
                break
            depth = work.depths[node]
            if self.before[node] not in taken or (self.caps is not None and filled[depth] >= self.caps[depth - 1]):
                continue     # a predecessor left out, or a full depth: best-first drops the rest of that option
            taken.add(node)
            filled[depth] += 1
            out.append(node)
        return out

    def bar(self, chosen: list[int]) -> float:
        """The turn a new candidate must beat to enter (created later, it loses ties): the last chosen one's
        when the budget is full."""
        return self.turn[chosen[-1]] if len(chosen) == self.spec.nodes else -math.inf

    def expand(self, node: int, bar: float, ranked: tuple[list[float], list[int]] | None = None) -> None:
        """Add `node`'s children, in draw order, while their turn beats `bar` (a later one's is no higher);
        `ranked`: its row's most likely tokens, when greedy (_ranked)."""
        work, depth = self.work, self.work.depths[node] + 1
        copy = self.copy_at(work, node) if self.copy_at else None
        tokens, ranks, qs = _draw_order(work.q_rows[node], self.greedy, self.generator, self.spec.nodes, copy,
                                        ranked)
        score, before, drawn = work.scores[node], node, 0.0
        for token, rank, q in zip(tokens, ranks, qs):
            weight = self.weigh(q, rank, depth)
            priority = score * weight if self.greedy else score * max(0.0, 1.0 - drawn)
            turn = min(priority, self.turn[before])
            if turn <= bar:
                break
            drawn += q
            self.turn.append(turn)
            self.before.append(before)
            before = work.add(node, token, score * weight, rank)

    def subtree(self, chosen: list[int]) -> DraftTree:
        """The chosen candidates as a tree of their own (renumbered), with the rows of those that have them."""
        work, tree, index = self.work, DraftTree.root(self.work.tokens[0]), {0: 0}
        for node in chosen:
            index[node] = tree.add(index[work.parents[node]], work.tokens[node], work.scores[node], work.ranks[node])
        tree.q_rows = {index[n]: row for n, row in work.q_rows.items() if n in index}
        return tree


def grow(spec: TreeSpec, root_token: int, rows_at: RowsAt, greedy: bool, generator: torch.Generator,
         weigh: Weigh | None = None, copy_at: CopyAt | None = None) -> DraftTree:
    """The tree best-first growth builds (_Growth), drafted a level at a time. rows_at(tree, nodes) runs
    the drafter on those nodes (one forward, a tree mask; node 0 alone: the drafter's forward up to the
    root) and returns their draft rows; it is called once per level, on that level's nodes that may still
    get children, so a tree costs a forward per level, not per node. Greedy rows rank children; sampled
    rows are the distributions children are drawn from.

    A node's score is its parent's times the child's chance of acceptance: its draft probability, or
    when greedy and `weigh` is given, weigh(q, rank, depth) (a Confidence table's estimate from earlier rounds).
    `copy_at(tree, v)`: prompt lookup's token after node v (from v's context), merged in as v's first child.
    When sampling, whether v gets its j-th child depends on earlier draws only (the mass they took, other
    nodes' draws), never on the j-th draw itself: that is what keeps sampling lossless."""
    growth = _Growth(spec, root_token, greedy, generator, weigh if greedy and weigh is not None else raw_q, copy_at)
    work, level, chosen = growth.work, [0], []
    while level:
        for node, row in rows_at(work, level).items():
            work.q_rows[node] = row
        ranked = _ranked([work.q_rows[n] for n in level], spec.nodes + 1) if greedy else [None] * len(level)
        for node, top in zip(level, ranked):
            growth.expand(node, growth.bar(chosen), top)
        chosen = growth.chosen()
        bar, depth = growth.bar(chosen), work.depths[level[0]] + 1
        level = [n for n in chosen if work.depths[n] == depth < spec.max_depth
                 and min(work.scores[n], growth.turn[n]) > bar]   # its first child's turn is at most that
    return growth.subtree(chosen)


class Confidence:
    """How much a drafted child's q is worth: how often children turn out to be the target's greedy
    token, against how often their q said they would, by q bin, rank (first child, a later sibling,
    or a copy from prompt lookup) and depth band, learned from the rounds verified so far.

    Best-first growth by cumulative q (EAGLE-2) assumes the draft is calibrated: that children with q
    = 0.3 are the target's token 30% of the time. A small draft is often right but unsure, and then
    q-growth spends the budget on siblings where depth would pay. No power of q fixes that (a path's
    product of q^t orders nodes exactly as the product of q), so each cell keeps hits and the q mass
    of its trials, and a child weighs q x hits / mass (at most 1): the draft's own ranking within a
    cell, rescaled by what the cell measured. A prior of `prior` trials at ratio 1 makes the first
    rounds grow as q does, and a calibrated draft keeps growing so. Depth matters because acceptance
    is correlated along a path: a round that reached depth 6 is in text the draft predicts well.
    A copied child's q (the draft's opinion of it) only picks its cell: it weighs its cell's hit
    rate, from a prior of `prior` trials at one half (a copy is drafted from the first round on, so
    the table sees how good copies are).
    Greedy trees only; the tree's structure depends on draft rows and past rounds, never on this
    round's target, so verification stays exact."""

    EDGES = (0.0, 0.01, 0.03, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
    DEPTHS = (1, 2, 3, 5, 9)   # depth bands start here
    RANKS = 3                  # the first child, every later sibling, a copy
    COPY_PRIOR = 0.5           # a copy's hit rate before any was verified

    def __init__(self, prior: float = 4.0) -> None:
        mids = [(a + b) / 2 for a, b in zip(self.EDGES, self.EDGES[1:])]
        bands = len(self.DEPTHS)
        self.hits = [[prior * m for m in mids] for _ in range(2 * bands)] + \
                    [[prior * self.COPY_PRIOR] * len(mids) for _ in range(bands)]
        self.mass = [[prior * m for m in mids] for _ in range(2 * bands)] + \
                    [[prior] * len(mids) for _ in range(bands)]

    def _cell(self, q: float, rank: int, depth: int) -> tuple[int, int]:
        b = min(max(bisect.bisect_right(self.EDGES, q) - 1, 0), len(self.EDGES) - 2)
        band = bisect.bisect_right(self.DEPTHS, depth) - 1
        return (2 if rank == COPIED else min(rank, 1)) * len(self.DEPTHS) + band, b

    def weigh(self, q: float, rank: int, depth: int) -> float:
        r, b = self._cell(q, rank, depth)
        return min(1.0, (1.0 if rank == COPIED else q) * self.hits[r][b] / self.mass[r][b])

    def observe(self, tree: DraftTree, verdict: Verdict) -> None:
        """Count every child of every node the greedy walk reached: a hit iff it is the token the
        target chose there (the next accepted token, or the final one)."""
        for node, chosen in zip([0, *verdict.path], verdict.tokens):
            row = tree.q_rows.get(node)
            for child in tree.children[node]:
                q, rank = float(row[tree.tokens[child]]), tree.ranks[child]
                r, b = self._cell(q, rank, tree.depths[child])
                self.mass[r][b] += 1.0 if rank == COPIED else q
                self.hits[r][b] += float(tree.tokens[child] == chosen)


class Confidences:
    """Confidence tables by drafter, for an owner that keeps what its runs learn across runs (a bench
    method over its prompts): each engine is handed `for_run(config)`. Nothing shares one by default."""

    def __init__(self) -> None:
        self._tables: dict[str, Confidence] = {}

    def for_run(self, config: SpecConfig) -> Confidence | None:
        """The table a run with `config` learns in (one per drafter: the draft model's, the EAGLE head's),
        or None when its trees do not grow by confidence."""
        if not config.grows_by_confidence:
            return None
        return self._tables.setdefault("eagle" if config.drafter.uses_eagle else "model", Confidence())


def raw_q(q: float, rank: int, depth: int) -> float:
    """EAGLE-2's weight: the probability the child was proposed with (a copy: certainty)."""
    return 1.0 if rank == COPIED else q


# -- verification ------------------------------------------------------------------------------------
def residual_after_rejection(p: Tensor, q_i: Tensor) -> Tensor:
    """The target distribution the next sibling is tested against once child i is rejected: the residual
    normalise(max(0, p - q_i)). ValueError when it has no mass (the child was not drawn from q_i)."""
    residual = (p - q_i).clamp(min=0.0)
    if float(residual.sum()) <= 0:
        raise ValueError("a rejection left a residual with zero mass: the child was not drawn from q")
    return residual / residual.sum()


def verify_tree(tree: DraftTree, p_rows: Tensor, generator: torch.Generator | None, greedy: bool,
                after_rejection: Callable[[Tensor, Tensor], Tensor] = residual_after_rejection) -> Verdict:
    """Walk the tree: p_rows [size + 1, V] are the target's processed rows at every node (row 0 the
    root). Greedy: descend to the child equal to the target's argmax. Otherwise recursive rejection
    sampling without replacement (the module docstring); `after_rejection(p, q_i)` gives the p the next
    sibling is tested against (only the lab passes another). Every tested child draws one uniform, and
    the final token one more."""
    if p_rows.dim() != 2 or p_rows.shape[0] != len(tree.tokens):
        raise ValueError(f"need one p row per tree node ({len(tree.tokens)}), got shape {tuple(p_rows.shape)}")
    node, path, tested = 0, [], []
    while True:
        kids = tree.children[node]
        p = p_rows[node].double()
        if not kids:
            u = draw_uniform(1, generator, p.device)
            token = int(p.argmax()) if greedy else int(sample_from(p[None], u)[0])
            return Verdict(path, [tree.tokens[n] for n in path] + [token], tested, token, Outcome.BONUS, node,
                               float(u[0]), None)
        if greedy:
            best = int(p.argmax())
            u = draw_uniform(len(kids), generator, p.device).tolist()
            hit = next((c for c in kids if tree.tokens[c] == best), None)
            for c, uc in zip(kids, u):
                tested.append(PositionVerdict(c, tree.tokens[c], float(c == hit), 1.0, float(c == hit), uc,
                                          Outcome.ACCEPTED if c == hit else Outcome.REJECTED))
                if c == hit:
                    break
            if hit is None:
                final_u = draw_uniform(1, generator, p.device)
                residual = torch.zeros_like(p, dtype=torch.float32).index_fill_(0, torch.tensor([best]), 1.0)
                return Verdict(path, [tree.tokens[n] for n in path] + [best], tested, best, Outcome.CORRECTED,
                                   node, float(final_u[0]), residual)
            node = hit
            path.append(node)
            continue
        q = tree.q_rows[node].double().clone()
        accepted = None
        for c in kids:
            token = tree.tokens[c]
            q_i = torch.zeros_like(q).index_fill_(0, torch.tensor([token]), 1.0) if tree.copied(c) else q / q.sum()
            alpha = float(acceptance_probability(p[token], q_i[token]))   # the chain's rule, one home
            u = float(draw_uniform(1, generator, p.device)[0])
            ok = u < alpha
            tested.append(PositionVerdict(c, token, float(p[token]), float(q_i[token]), alpha, u,
                                      Outcome.ACCEPTED if ok else Outcome.REJECTED))
            if ok:
                accepted = c
                break
            p = after_rejection(p, q_i)
            q[token] = 0.0   # without replacement: the next child was drawn from q without this one
        if accepted is None:
            u = draw_uniform(1, generator, p.device)
            token = int(sample_from(p[None], u)[0])
            return Verdict(path, [tree.tokens[n] for n in path] + [token], tested, token, Outcome.CORRECTED,
                               node, float(u[0]), p.float().cpu())
        node = accepted
        path.append(node)

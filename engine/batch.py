"""B sequences decoded at once: one target forward a round over every sequence's fed rows.

Each sequence is a `SpeculativeEngine` of its own (its KV pools and rollbacks, its seed, its K, its stop);
the batch runs each round's three parts (`begin_round`, the forward, `finish_round`) with the middle one shared:
`engine.runner.forward_many` stacks the B sequences' rows (1 each target-only, K + 1 each speculative) into
one product per matrix, so the weights are read once a round for all of them, and attends sequence by
sequence. Sequences of different prompt lengths sit side by side; a finished one leaves the batch and frees
its KV. Drafting is batched the same way: every sequence's drafter advances step by step together
(`draft_together`), and each draft step of a draft model or an EAGLE head runs as one forward for all the
sequences waiting at it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from engine.clock import Now
from engine.config import SpecConfig
from engine.drafters.base import Proposal, TreeProposal
from engine.drafters.eagle import EagleStep
from engine.kv_cache import KVPool
from engine.pair import ModelPair
from engine.records import RoundRecord
from engine.runner import ForwardRequest, forward_many, pool_blocks
from engine.speculative import SpeculativeEngine, kv_bytes, kv_capacity


class BatchTooLarge(ValueError):
    """The batch's KV pools would not fit the memory free on its device."""


@dataclass(frozen=True, slots=True)
class BatchRequest:
    """One sequence of a batch: a name to report it by, its prompt's ids, and its seed (None: the config's
    seed + its index in the batch)."""

    name: str
    prompt_ids: list[int]
    seed: int | None = None


@dataclass(frozen=True, slots=True)
class BatchFailure:
    """A sequence that left the batch with an error; the rest went on."""

    name: str
    message: str


@dataclass(frozen=True, slots=True)
class BatchRound:
    """One round of a batch: who took part, how many rows each fed the shared target forward, where the time
    went (ms: every sequence's drafting, the one forward, every sequence's verify and commit), and each
    sequence's own round record."""

    index: int
    names: list[str]
    rows: list[int]
    draft_ms: float
    forward_ms: float
    finish_ms: float
    records: list[RoundRecord]

    @property
    def total_ms(self) -> float:
        return self.draft_ms + self.forward_ms + self.finish_ms

    @property
    def emitted(self) -> int:
        return sum(len(r.emitted) for r in self.records)


def available_bytes(device: torch.device | str) -> int | None:
    """Memory free for new tensors on the device: MemAvailable on a CPU (Linux), the free bytes on a GPU; None
    where it cannot be read."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def draft_together(engines: dict[str, SpeculativeEngine]) -> dict[str, Proposal | TreeProposal | None]:
    """Every engine's drafting for this round, in lockstep: each engine's steps (`draft_steps`) advance
    together, and the steps waiting at the same time run as one forward per model (`run_steps`). A sequence
    that copies (prompt lookup) or drafts a tree needs no step; one that drafts fewer tokens leaves early."""
    done: dict[str, Proposal | TreeProposal | None] = {}
    waiting = {}
    for name, engine in engines.items():
        steps = engine.draft_steps()
        try:
            waiting[name] = (steps, next(steps))
        except StopIteration as finished:
            done[name] = finished.value
    while waiting:
        batch = list(waiting.items())
        results = run_steps([step for _, (_, step) in batch])
        for (name, (steps, _)), result in zip(batch, results):
            try:
                waiting[name] = (steps, steps.send(result))
            except StopIteration as finished:
                done[name] = finished.value
                del waiting[name]
    return done


def run_steps(steps: list) -> list:
    """Draft steps of several sequences, each group of one kind and one model as one forward: a draft model's
    (ForwardRequest) through `forward_many`, an EAGLE head's (EagleStep) through its runtime's `draft_many`;
    results in the steps' order."""
    groups: dict[tuple, list[int]] = {}
    for i, step in enumerate(steps):
        model = step.runner.loaded if isinstance(step, ForwardRequest) else \
            step.drafter.runtime if isinstance(step, EagleStep) else step
        groups.setdefault((type(step), id(model)), []).append(i)
    results: list = [None] * len(steps)
    for (kind, _), indices in groups.items():
        group = [steps[i] for i in indices]
        if kind is ForwardRequest:
            out = forward_many(group, features=False)
        elif kind is EagleStep:
            out = group[0].drafter.runtime.draft_many(group)
        else:
            out = [s.run() for s in group]
        for i, result in zip(indices, out):
            results[i] = result
    return results


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


class BatchEngine:
    """B sequences of one pair and one configuration, decoded round by round together.

    A request the engine refuses (an empty prompt, token ids outside the vocabulary, a prompt over the
    context) is reported in `failures` by its name and the others run. Before anything is allocated, the KV
    the whole batch needs is compared with the memory free on the target's device (`memory` overrides what
    was read): a batch that does not fit raises BatchTooLarge with both figures."""

    def __init__(self, pair: ModelPair, requests: list[BatchRequest], config: SpecConfig, eos_id: int | None = None,
                 now: Now = time.perf_counter, memory: int | None = None) -> None:
        if not requests:
            raise ValueError("a batch needs at least one sequence")
        names = [r.name for r in requests]
        if len(set(names)) != len(names):
            raise ValueError("every sequence of a batch needs its own name")
        fits = [r for r in requests if 0 < len(r.prompt_ids) <= pair.target.max_context]   # the rest are refused
        need = sum(kv_bytes(pair, len(r.prompt_ids), config) for r in fits)
        free = memory if memory is not None else available_bytes(pair.target.device)
        if free is not None and need > free:
            raise BatchTooLarge(
                f"A batch of {len(requests)} sequences needs {_size(need)} of KV cache, and {_size(free)} is free "
                f"on {pair.target.device}. Use fewer sequences, shorter prompts or fewer new tokens.")
        self.pair, self.config, self._now = pair, config, now
        self.engines: dict[str, SpeculativeEngine] = {}
        self.failures: list[BatchFailure] = []
        # one pool for the target's KV, each sequence its own blocks in it: attention runs as one product
        target = pair.target
        blocks = max(1, sum(pool_blocks(kv_capacity(len(r.prompt_ids), config), config.block_size) for r in fits))
        self.pool = KVPool(target.kv_shape, blocks, config.block_size, target.device, target.dtype)
        for i, r in enumerate(requests):
            seed = r.seed if r.seed is not None else config.seed + i
            try:
                self.engines[r.name] = SpeculativeEngine(pair, r.prompt_ids, replace(config, seed=seed),
                                                         eos_id=eos_id, now=now, target_pool=self.pool)
            except ValueError as exc:   # PromptError included: this sequence only
                self.failures.append(BatchFailure(r.name, str(exc)))
        self.rounds: list[BatchRound] = []
        self._closed: set[str] = set()

    @property
    def active(self) -> list[str]:
        return [name for name, e in self.engines.items() if not e.finished and not self._failed(name)]

    @property
    def finished(self) -> bool:
        return not self.active

    def _failed(self, name: str) -> bool:
        return any(f.name == name for f in self.failures)

    def _fail(self, name: str, exc: Exception) -> None:
        self.failures.append(BatchFailure(name, str(exc)))
        self._close(name)

    def _close(self, name: str) -> None:
        if name not in self._closed:
            self._closed.add(name)
            self.engines[name].close()

    @torch.inference_mode()
    def step(self) -> BatchRound:
        """One round for every unfinished sequence: all draft together (`draft_together`), one target forward,
        each verifies and commits."""
        names = self.active
        if not names:
            raise RuntimeError("every sequence of the batch is finished")
        now = self._now
        t0 = now()
        drafted = draft_together({n: self.engines[n] for n in names if self.engines[n].started})
        t1 = now()
        pending = {}
        for name in names:
            engine = self.engines[name]
            try:
                pending[name] = engine.begin_round((drafted[name], (t1 - t0) * 1000) if engine.started else None)
            except (ValueError, RuntimeError) as exc:
                self._fail(name, exc)
        stepping = list(pending)
        first = self.engines[stepping[0]] if stepping else None
        results = forward_many([pending[n].request for n in stepping],
                               features=first.needs_features if first else False,
                               taps=first.taps if first else ()) if stepping else []
        t2 = now()
        records = []
        for name, (logits, features) in zip(stepping, results):
            engine = self.engines[name]
            records.append(engine.finish_round(pending[name], logits, features))
            if engine.finished:
                self._close(name)
        t3 = now()
        done = BatchRound(len(self.rounds), stepping, [len(pending[n].request.token_ids) for n in stepping],
                          (t1 - t0) * 1000, (t2 - t1) * 1000, (t3 - t2) * 1000, records)
        self.rounds.append(done)
        return done

    def run(self) -> list[BatchRound]:
        while not self.finished:
            self.step()
        return self.rounds

    def generated(self) -> dict[str, list[int]]:
        """Each sequence's new tokens, by name (failed ones hold what they had)."""
        return {name: list(e.generated) for name, e in self.engines.items()}

    def close(self) -> None:
        """Free every sequence's KV blocks."""
        for name in self.engines:
            self._close(name)

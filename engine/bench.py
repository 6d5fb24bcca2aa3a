"""The benchmark: `python -m engine bench` — this engine against target-only and Hugging Face, side by side.

Every method decodes the same prompts greedily in one process on one pair. Runs are interleaved
(each repeat visits every prompt, and each prompt every method, in a rotating order) so that
background load hits all methods alike, and each (method, prompt) keeps the median of its repeats.

Methods
- `hf-generate`: `model.generate(do_sample=False)` on the target; `target`: this engine, Mode.TARGET;
  `target-transformers`: the same with the transformers forward instead of the fused one.
- `hf-assisted`: `generate(assistant_model=draft)` with K assistant tokens, a constant schedule and
  the confidence early-stop switched off, so every round drafts exactly K like ours.
- `hf-prompt-lookup`: `generate(prompt_lookup_num_tokens=K)`, n-grams up to the n-gram drafter's.
- `v2`, `v1`: this engine with the model drafter and constant K; `v2-heuristic`, `v1-heuristic`:
  the K+2 / K-1 schedule from K=4; `ngram`: v2 with the prompt-lookup drafter; `hybrid`: v2 with the
  hybrid drafter (a copy of up to 2K tokens when the last 2+ tokens occurred before, else K from the
  draft model); `hybrid-heuristic`: the same with the K+2 / K-1 schedule from K=4.

Measures (what the JSON records and the table show)
- tokens/s = exact generated tokens / wall time of the whole call (engine construction and KV
  allocation included, like `generate`'s cache set-up), summed over prompts.
- TTFT: the engine's is the time until its first round returns; for `generate` it is a separate
  call with max_new_tokens=1 right after each timed call. TPOT = (wall - TTFT) / (tokens - 1).
- c = median draft-model forward / median single-token target forward, and r(K) = median target
  forward over K+1 new tokens / the same single-token forward. Forwards are timed by hooks on the
  models (each run's first, prefill, forward excluded), and the single-token reference is the
  same implementation's target-only run (engine `target` for engine methods, `hf-generate` for
  Hugging Face ones). The n-gram drafters have no draft forward: c = 0.
- predicted speed-up (Leviathan et al.): sum over rounds of E(alpha, k_i) / sum of (c*k_i + r(k_i)),
  with E(alpha, k) = (1 - alpha^(k+1)) / (1 - alpha) and E = r = 1 for a round that drafted nothing.
  With a constant K this is exactly E(alpha, K) / (cK + r). Target-only methods predict 1. The model
  has no term for v1's commit forward, sampling, verification or Python around the forwards: those
  show up as measured / predicted < 1.
- speed-up = tokens/s over the fastest target-only baseline; efficiency = measured / predicted.
- identical_tokens: every repeat of every prompt equals `hf-generate`'s tokens (all methods are greedy).
"""
from __future__ import annotations

import argparse
import cProfile
import copy
import io
import json
import math
import platform
import pstats
import random
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, fields, replace
from datetime import datetime, timezone
from pathlib import Path

import torch

from engine import metrics
from engine.cli import DTYPES, check_device
from engine.config import K_BOUND, DrafterKind, KSchedule, Mode, SpecConfig
from engine.fused_llama import FusedLlama, fused_for
from engine.models import BUILTIN, LoadedModel, ModelLoadError, default_devices, load_model
from engine.speculative import K_SLACK, PromptError, SpeculativeEngine

DEFAULT_KS = (1, 2, 3, 4, 6, 8)
HEURISTIC_START_K = 4
BASELINES = ("hf-generate", "target")      # always run: the speed-up reference and the token reference
REFERENCE = "hf-generate"
METHOD_NAMES = ("hf-generate", "target", "target-transformers", "hf-assisted", "hf-prompt-lookup",
                "v2", "v1", "v2-heuristic", "v1-heuristic", "ngram", "hybrid", "hybrid-heuristic")
UNDRAFTED = ("hf-generate", "target", "target-transformers")  # target-only: no K
NGRAM_MAX = 4
# Code prompts keep the last 192 tokens of each file's first half: the built-in pair was trained on
# 256-token windows, so 192 + 64 new tokens stay inside what it learned. Past that both models are
# out of distribution (at 512 tokens the draft's acceptance at K=2 falls from 0.73 to 0.44).
CODE_PROMPT_TOKENS = 192


# ---------------------------------------------------------------------------- methods and prompts

@dataclass(frozen=True, slots=True)
class Method:
    """One way of decoding. `k` is the (starting) K; None for target-only decoding."""

    name: str
    k: int | None = None

    @property
    def label(self) -> str:
        return self.name if self.k is None else f"{self.name} K={self.k}"

    @property
    def family(self) -> str:
        return "hf" if self.name.startswith("hf-") else "engine"

    @property
    def drafter(self) -> str:
        if self.k is None:
            return "none"
        base = self.name.removesuffix("-heuristic")
        if base == "hybrid":
            return "hybrid"
        return "ngram" if base in ("ngram", "hf-prompt-lookup") else "model"

    @property
    def uses_draft_model(self) -> bool:
        return self.drafter in ("model", "hybrid")

    @property
    def schedule(self) -> str:
        if self.k is None:
            return "none"
        return "heuristic" if self.name.endswith("-heuristic") else "constant"

    def spec_config(self, new_tokens: int) -> SpecConfig:
        """The engine config of an engine method: greedy, no EOS stop (exact token counts), no UI records."""
        base = self.name.removesuffix("-heuristic")
        mode = {"target": Mode.TARGET, "target-transformers": Mode.TARGET, "v1": Mode.V1}.get(base, Mode.V2)
        drafter = {"ngram": DrafterKind.NGRAM, "hybrid": DrafterKind.HYBRID}.get(base, DrafterKind.MODEL)
        schedule = KSchedule.HEURISTIC if self.schedule == "heuristic" else KSchedule.CONSTANT
        return SpecConfig(mode=mode, drafter=drafter, k=self.k or 1, k_schedule=schedule, k_max=max(8, self.k or 1),
                          max_new_tokens=new_tokens, stop_at_eos=False, record=False, ngram_max=NGRAM_MAX,
                          fused_forward=self.name != "target-transformers")


def build_methods(names: Sequence[str], ks: Sequence[int]) -> list[Method]:
    """The baselines first, then each selected method at each K (heuristic ones once, from K=4)."""
    out = [Method(n) for n in BASELINES]
    for name in METHOD_NAMES:
        if name in BASELINES or name not in names:
            continue
        if name in UNDRAFTED:
            out.append(Method(name))
        elif name.endswith("-heuristic"):
            out.append(Method(name, HEURISTIC_START_K))
        else:
            out.extend(Method(name, k) for k in ks)
    return out


@dataclass(frozen=True, slots=True)
class Prompt:
    name: str          # where it came from: "<file>@<token offset>" or "<file> (first half)"
    ids: list[int]


def heldout_prompts(tokenizer, count: int, length: int, seed: int) -> list[Prompt]:
    """`count` windows of `length` tokens from distinct held-out stdlib test files (seeded choice)."""
    from engine.corpus import list_sources

    files = list_sources("heldout")
    rng = random.Random(seed)
    rng.shuffle(files)
    out = []
    for f in files:
        ids = tokenizer(f.text, add_special_tokens=False)["input_ids"]
        if len(ids) > length:
            start = rng.randrange(len(ids) - length)
            out.append(Prompt(f"{f.path.name}@{start}", list(ids[start:start + length])))
        if len(out) == count:
            return out
    raise PromptError(f"found only {len(out)} held-out files longer than {length} tokens")


def code_prompts(tokenizer, count: int, max_tokens: int, seed: int) -> list[Prompt]:
    """Code continuation: the first half (by lines) of held-out test files, cut from the left to
    `max_tokens` so it fits the context. The continuation is what the file really says next."""
    from engine.corpus import list_sources

    files = [f for f in list_sources("heldout") if 120 <= f.text.count("\n") <= 1500]
    random.Random(seed).shuffle(files)
    out = []
    for f in files[:count]:
        lines = f.text.splitlines(keepends=True)
        ids = list(tokenizer("".join(lines[: len(lines) // 2]))["input_ids"])
        out.append(Prompt(f"{f.path.name} (first half)", ids[-max_tokens:]))
    if len(out) < count:
        raise PromptError(f"found only {len(out)} held-out files of 120-1500 lines for code prompts")
    return out


# ---------------------------------------------------------------------------- one timed run

@dataclass(frozen=True, slots=True)
class ForwardTime:
    """One model forward: new tokens fed (q), logits rows kept (0 = all), seconds."""

    q: int
    rows: int
    seconds: float

    @property
    def all_rows(self) -> bool:
        return self.rows in (0, self.q)


class ForwardClock:
    """Times every forward of one model through hooks, while active (`with clock:`).

    On CUDA each forward is synchronized at both ends, so the times are the device's, at the price
    of losing the overlap of CPU launch work with the previous forward.
    """

    def __init__(self, loaded: LoadedModel | None) -> None:
        self.loaded, self.times, self._handles, self._t0 = loaded, [], [], 0.0
        self._fused: FusedLlama | None = None
        self._shadowed = None

    def _sync(self) -> None:
        if self.loaded.device.type == "cuda":
            torch.cuda.synchronize(self.loaded.device)

    def _pre(self, module, args, kwargs) -> None:
        self._sync()
        self._t0 = time.perf_counter()

    def _post(self, module, args, kwargs, output) -> None:
        self._sync()
        ids = kwargs.get("input_ids", args[0] if args else None)
        rows = kwargs.get("logits_to_keep", 0)
        self.times.append(ForwardTime(int(ids.shape[-1]), rows if isinstance(rows, int) else -1,
                                      time.perf_counter() - self._t0))

    def _timed(self, forward):
        """The fused forward, timed like the hooked module (it never calls the module)."""
        def timed(cache, ids, last_only=False):
            self._pre(None, (), {})
            logits = forward(cache, ids, last_only)
            self._post(None, (), {"input_ids": ids, "logits_to_keep": 1 if last_only else 0}, logits)
            return logits
        return timed

    def __enter__(self) -> "ForwardClock":
        if self.loaded is not None:
            m = self.loaded.model
            self._handles = [m.register_forward_pre_hook(self._pre, with_kwargs=True),
                             m.register_forward_hook(self._post, with_kwargs=True)]
            self._fused = fused_for(m)
            if self._fused is not None:
                self._shadowed = self._fused.__dict__.get("forward")  # another clock's, when nested
                self._fused.forward = self._timed(self._fused.forward)  # an instance attribute shadows the method
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.loaded is not None and self._fused is not None:
            if self._shadowed is None:
                del self._fused.forward
            else:
                self._fused.forward = self._shadowed


@dataclass(frozen=True, slots=True)
class Phases:
    """Where an engine run's wall time went, ms (summed RoundTimings; `outside` = set-up and close)."""

    prefill: float
    draft: float
    verify: float
    commit: float
    other: float
    outside: float

    def scaled(self, factor: float) -> "Phases":
        return Phases(*(getattr(self, f.name) * factor for f in fields(self)))


@dataclass(frozen=True, slots=True)
class RunSample:
    """One method on one prompt, once."""

    prompt: int
    tokens: list[int]
    wall_s: float
    ttft_s: float
    rounds_k: list[int]             # tokens drafted in each round
    accepted: int
    target_fwd: list[ForwardTime]   # every forward, in order; the first is the prefill
    draft_fwd: list[ForwardTime]    # likewise (empty without a draft model)
    phases: Phases | None           # engine methods only
    rounds_draft_forwards: list[int] | None = None  # draft-model forwards per round (engine); None: rounds_k

    @property
    def decode_forwards(self) -> tuple[list[ForwardTime], list[ForwardTime]]:
        """(target, draft) forwards after each model's first (prefill) one: the ones c and r come from."""
        return self.target_fwd[1:], self.draft_fwd[1:]


def run_engine(method: Method, target: LoadedModel, draft: LoadedModel | None, prompt: list[int],
               new_tokens: int) -> RunSample:
    """Decode with SpeculativeEngine; the clock starts before the engine (and its KV pools) exist."""
    uses_draft = method.uses_draft_model
    with ForwardClock(target) as tc, ForwardClock(draft if uses_draft else None) as dc:
        t0 = time.perf_counter()
        engine = SpeculativeEngine(target, draft if uses_draft else None, prompt, method.spec_config(new_tokens))
        engine.step()
        ttft = time.perf_counter() - t0
        engine.run()
        engine.close()
        wall = time.perf_counter() - t0
    rounds = engine.rounds
    busy = sum(r.timings.total_ms for r in rounds)
    phases = Phases(*(sum(getattr(r.timings, f"{p}_ms") for r in rounds)
                      for p in ("prefill", "draft", "verify", "commit", "other")), wall * 1000 - busy)
    return RunSample(-1, list(engine.generated), wall, ttft, [r.k for r in rounds], sum(r.accepted for r in rounds),
                     tc.times, dc.times, phases, [r.draft_forwards for r in rounds])


@contextmanager
def assistant_settings(draft: LoadedModel, k: int) -> Iterator[None]:
    """HF reads the assisted-generation knobs from the *assistant's* generation_config: swap in a
    copy with K tokens, a constant schedule and no confidence early-stop; restore the original after."""
    original = draft.model.generation_config
    patched = copy.deepcopy(original)
    patched.num_assistant_tokens, patched.num_assistant_tokens_schedule = k, "constant"
    patched.assistant_confidence_threshold = 0.0
    draft.model.generation_config = patched
    try:
        yield
    finally:
        draft.model.generation_config = original


def hf_config(target: LoadedModel, method: Method, new_tokens: int):
    """Greedy, exactly `new_tokens` tokens (no EOS stop), plus prompt lookup for that method."""
    gc = copy.deepcopy(target.model.generation_config)
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else target.tokenizer.eos_token_id
    gc.update(do_sample=False, num_beams=1, temperature=None, top_p=None, top_k=None, max_new_tokens=new_tokens,
              min_new_tokens=None, max_length=None, pad_token_id=pad,
              # generate() fills a None eos from the model's config, so EOS would stop it early (and
              # min_new_tokens would ban EOS instead). An id past the vocabulary never matches: exactly
              # new_tokens tokens, the same as the engine's stop_at_eos=False.
              eos_token_id=target.vocab_size)
    if method.name == "hf-prompt-lookup":
        gc.update(prompt_lookup_num_tokens=method.k, max_matching_ngram_size=NGRAM_MAX)
    return gc


def _hf_generate(target: LoadedModel, ids: torch.Tensor, config, assistant: LoadedModel | None) -> torch.Tensor:
    extra = {"assistant_model": assistant.model} if assistant is not None else {}
    with torch.inference_mode():
        return target.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, **extra)


def run_hf(method: Method, target: LoadedModel, draft: LoadedModel | None, prompt: list[int],
           new_tokens: int) -> RunSample:
    """Decode with `generate`. Each target forward is one round that checked (rows - 1) drafts and
    emitted accepted + 1 tokens, so accepted = tokens - target forwards. TTFT: a max_new_tokens=1 call."""
    ids = torch.tensor([prompt], dtype=torch.long, device=target.device)
    assistant = draft if method.name == "hf-assisted" else None
    full, first = hf_config(target, method, new_tokens), hf_config(target, method, 1)
    with assistant_settings(draft, method.k) if assistant else nullcontext():
        with ForwardClock(target) as tc, ForwardClock(assistant) as dc:
            t0 = time.perf_counter()
            out = _hf_generate(target, ids, full, assistant)
            wall = time.perf_counter() - t0
        t0 = time.perf_counter()
        _hf_generate(target, ids, first, assistant)
        ttft = time.perf_counter() - t0
    tokens = out[0, len(prompt):].tolist()
    rounds_k = [max(0, t.rows - 1) for t in tc.times]
    return RunSample(-1, tokens, wall, ttft, rounds_k, len(tokens) - len(tc.times), tc.times, dc.times, None)


def run_once(method: Method, target: LoadedModel, draft: LoadedModel | None, prompt: Prompt, index: int,
             new_tokens: int) -> RunSample:
    run = run_hf if method.family == "hf" else run_engine
    return replace(run(method, target, draft, prompt.ids, new_tokens), prompt=index)


# ---------------------------------------------------------------------------- results

@dataclass(frozen=True, slots=True)
class MethodResult:
    """One method at one K, over all prompts and repeats (the JSON record)."""

    method: str
    label: str
    family: str                  # "engine" or "hf"
    drafter: str                 # "model", "ngram", "hybrid" or "none"
    schedule: str                # "constant", "heuristic" or "none"
    k: int | None                # constant K, or the heuristic's starting K; None for target-only
    mean_k: float                # tokens drafted per round, on average
    prompts: int
    repeats: int
    tokens: int                  # generated tokens over all prompts (one repeat)
    rounds: int
    drafted: int
    accepted: int
    tokens_per_s: float
    ttft_ms: float
    tpot_ms: float
    acceptance_rate: float
    mean_accepted_length: float  # tokens per round, the final (correction/bonus) token included
    target_forwards_per_token: float
    target_forward_ms: float     # the single-token reference forward of this method's implementation
    c: float
    r: float                     # at K (heuristic: at the rounded mean K)
    speedup: float               # over the fastest target-only baseline
    predicted_speedup: float
    efficiency: float            # speedup / predicted_speedup
    identical_tokens: bool
    mismatched_prompts: list[int]
    phases_ms_per_token: Phases | None  # engine methods only


def _median(xs: Sequence[float], default: float = math.nan) -> float:
    return statistics.median(xs) if xs else default


def reference_forward_s(samples: Sequence[RunSample]) -> float:
    """Median single-token forward (q == 1, all rows) of a target-only method's runs."""
    return _median([t.seconds for s in samples for t in s.decode_forwards[0] if t.q == 1 and t.all_rows])


def cost_ratios(method: Method, samples: Sequence[RunSample], t1: float) -> tuple[float, dict[int, float]]:
    """(c, {k: r(k)}) from this method's hooked forward times, relative to `t1` seconds."""
    draft = [t.seconds for s in samples for t in s.decode_forwards[1]]
    c = _median(draft, 0.0) / t1 if method.uses_draft_model else 0.0
    by_k: dict[int, list[float]] = {}
    for s in samples:
        for t in s.decode_forwards[0]:
            if t.all_rows:
                by_k.setdefault(t.q - 1, []).append(t.seconds)
    return c, {k: _median(v) / t1 for k, v in by_k.items()}


def r_at(r: dict[int, float], k: int) -> float:
    """r(k) measured, else at the nearest measured K; 1 for a round that drafted nothing."""
    if k == 0 or not r:
        return 1.0
    return r.get(k, r[min(r, key=lambda j: (abs(j - k), j))])


def predicted(alpha: float, rounds_k: Sequence[int], c: float, r: dict[int, float],
              draft_forwards: Sequence[int] | None = None) -> float:
    """Leviathan et al.'s speed-up generalised to rounds of varying K (see the module docstring).
    `draft_forwards` per round, when not one per drafted token (the hybrid's copied rounds cost none)."""
    tokens = sum(metrics.expected_tokens_per_round(alpha, k) if k else 1.0 for k in rounds_k)
    forwards = rounds_k if draft_forwards is None else draft_forwards
    cost = sum(c * f + r_at(r, k) for k, f in zip(rounds_k, forwards, strict=True))
    return tokens / cost if cost > 0 else math.nan


def by_prompt(samples: Sequence[RunSample]) -> dict[int, list[RunSample]]:
    """Samples grouped by prompt index, repeats in run order."""
    out: dict[int, list[RunSample]] = {}
    for s in samples:
        out.setdefault(s.prompt, []).append(s)
    return out


def tokens_per_s(samples: Sequence[RunSample]) -> float:
    """Generated tokens over all prompts / the sum of each prompt's median wall time."""
    groups = by_prompt(samples).values()
    return sum(len(runs[0].tokens) for runs in groups) / sum(_median([s.wall_s for s in runs]) for runs in groups)


def phases_per_token(samples: Sequence[RunSample]) -> Phases:
    """Engine phase times summed over the samples, per generated token."""
    tokens = sum(len(s.tokens) for s in samples)
    total = Phases(*(sum(getattr(s.phases, f.name) for s in samples) for f in fields(Phases)))
    return total.scaled(1 / max(tokens, 1))


def summarize(method: Method, samples: Sequence[RunSample], t1: float, fastest_tps: float,
              reference: dict[int, list[int]]) -> MethodResult:
    """Medians over repeats per prompt, then totals over prompts. Token counts, rounds and
    acceptance come from each prompt's first repeat (greedy runs repeat exactly)."""
    groups = by_prompt(samples)
    first = [runs[0] for runs in groups.values()]
    tokens = sum(len(s.tokens) for s in first)
    ttfts = {p: _median([s.ttft_s for s in runs]) for p, runs in groups.items()}
    tpots = [(_median([s.wall_s for s in runs]) - ttfts[p]) / (len(runs[0].tokens) - 1)
             for p, runs in groups.items() if len(runs[0].tokens) > 1]
    rounds_k = [k for s in first for k in s.rounds_k]
    drafted, accepted = sum(rounds_k), sum(s.accepted for s in first)
    alpha = metrics.acceptance_rate(accepted, drafted)
    c, r = cost_ratios(method, samples, t1)
    tps = tokens_per_s(samples)
    per_round = [s.rounds_draft_forwards for s in first]
    forwards = None if any(f is None for f in per_round) else [f for fs in per_round for f in fs]
    pred = predicted(alpha, rounds_k, c, r, forwards) if method.k is not None else 1.0
    mean_k = drafted / len(rounds_k) if rounds_k else 0.0
    mismatched = sorted({s.prompt for s in samples if s.tokens != reference[s.prompt]})
    speedup = tps / fastest_tps
    return MethodResult(
        method=method.name, label=method.label, family=method.family, drafter=method.drafter,
        schedule=method.schedule, k=method.k, mean_k=mean_k, prompts=len(groups),
        repeats=max(len(v) for v in groups.values()), tokens=tokens, rounds=len(rounds_k),
        drafted=drafted, accepted=accepted, tokens_per_s=tps, ttft_ms=_median(list(ttfts.values())) * 1000,
        tpot_ms=_median(tpots, 0.0) * 1000, acceptance_rate=alpha,
        mean_accepted_length=tokens / len(rounds_k) if rounds_k else 0.0,
        target_forwards_per_token=len(rounds_k) / max(tokens, 1), target_forward_ms=t1 * 1000, c=c,
        r=r_at(r, method.k if method.schedule == "constant" else max(1, round(mean_k))) if method.k else 1.0,
        speedup=speedup, predicted_speedup=pred, efficiency=speedup / pred if pred else math.nan,
        identical_tokens=not mismatched, mismatched_prompts=mismatched,
        phases_ms_per_token=phases_per_token(samples) if method.family == "engine" else None)


def summarize_all(methods: Sequence[Method], samples: dict[Method, list[RunSample]]) -> list[MethodResult]:
    """Results for every method: the reference forward per implementation, the fastest baseline."""
    t1 = {"hf": reference_forward_s(samples[Method("hf-generate")]),
          "engine": reference_forward_s(samples[Method("target")])}
    reference: dict[int, list[int]] = {}
    for s in samples[Method(REFERENCE)]:
        reference.setdefault(s.prompt, s.tokens)
    fastest = max(tokens_per_s(samples[m]) for m in methods if m.name in UNDRAFTED)
    return [summarize(m, samples[m], t1[m.family], fastest, reference) for m in methods]


# ---------------------------------------------------------------------------- the interleaved loop

@dataclass(frozen=True, slots=True)
class BenchSettings:
    prompt_set: str = "heldout"        # "heldout" or "code"
    num_prompts: int = 8
    prompt_tokens: int = 128           # heldout: window length; code: the most prompt tokens kept
    new_tokens: int = 64
    repeats: int = 3
    warmup: int = 1                    # untimed runs of every method before timing
    ks: tuple[int, ...] = DEFAULT_KS
    methods: tuple[str, ...] = METHOD_NAMES
    seed: int = 0

    def __post_init__(self) -> None:
        if self.prompt_set not in ("heldout", "code"):
            raise ValueError(f"--prompts must be heldout or code, not {self.prompt_set!r}")
        for name in ("num_prompts", "prompt_tokens", "new_tokens", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if not self.ks or any(not 1 <= k <= K_BOUND for k in self.ks):
            raise ValueError(f"every K must lie in 1..{K_BOUND}, got {list(self.ks)}")
        unknown = sorted(set(self.methods) - set(METHOD_NAMES))
        if unknown:
            raise ValueError(f"unknown method(s) {unknown}; choose from {list(METHOD_NAMES)}")


def make_prompts(settings: BenchSettings, target: LoadedModel) -> list[Prompt]:
    """The prompt set, cut so that prompt + new tokens + a round's slack fit the target's context."""
    room = target.max_context - settings.new_tokens - K_SLACK
    if room < 2:
        raise PromptError(f"{settings.new_tokens} new tokens leave no room for a prompt in a "
                          f"{target.max_context}-token context")
    length = min(settings.prompt_tokens, room)
    if settings.prompt_set == "code":
        return code_prompts(target.tokenizer, settings.num_prompts, length, settings.seed)
    return heldout_prompts(target.tokenizer, settings.num_prompts, length, settings.seed)


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="bench", unit="run", file=sys.stderr, disable=not enabled, leave=False)


def run_bench(settings: BenchSettings, target: LoadedModel, draft: LoadedModel | None, prompts: Sequence[Prompt],
              progress: bool = True) -> dict[Method, list[RunSample]]:
    """Every method on every prompt, `repeats` times: repeat -> prompt -> methods in a rotating order."""
    methods = build_methods(settings.methods, settings.ks)
    samples: dict[Method, list[RunSample]] = {m: [] for m in methods}
    total = len(methods) * (settings.warmup + settings.repeats * len(prompts))
    with _progress(total, progress) as bar:
        for _ in range(settings.warmup):
            for m in methods:
                run_once(m, target, draft, prompts[0], 0, min(settings.new_tokens, 16))
                bar.update()
        for rep in range(settings.repeats):
            for i, prompt in enumerate(prompts):
                shift = (rep * len(prompts) + i) % len(methods)
                for m in methods[shift:] + methods[:shift]:
                    samples[m].append(run_once(m, target, draft, prompt, i, settings.new_tokens))
                    bar.update()
    return samples


# ---------------------------------------------------------------------------- output

@dataclass(frozen=True, slots=True)
class BenchMeta:
    """The command, machine, models and settings behind a set of results."""

    command: str
    date: str
    machine: str
    torch: str
    transformers: str
    threads: int
    target: str
    draft: str
    target_device: str
    draft_device: str
    dtype: str
    forward: str                     # the engine's forward for the target: "fused" or "transformers"
    prompt_set: str
    prompt_names: list[str]
    prompt_lengths: list[int]
    new_tokens: int
    repeats: int
    warmup: int
    ks: list[int]
    fastest_baseline: str
    fastest_baseline_tokens_per_s: float
    all_identical: bool
    wall_s: float


def make_meta(argv: Sequence[str], settings: BenchSettings, target: LoadedModel, draft: LoadedModel | None,
              prompts: Sequence[Prompt], results: Sequence[MethodResult], wall_s: float) -> BenchMeta:
    import transformers

    fastest = max((r for r in results if r.method in UNDRAFTED), key=lambda r: r.tokens_per_s)
    cpu = platform.processor() or platform.machine()
    return BenchMeta(
        command="python -m engine bench " + " ".join(argv), date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        machine=f"{platform.system()} {cpu}, {torch.get_num_threads()} torch threads"
                + (f", {torch.cuda.get_device_name(target.device)}" if target.device.type == "cuda" else ""),
        torch=torch.__version__, transformers=transformers.__version__, threads=torch.get_num_threads(),
        target=target.name, draft=draft.name if draft else "", target_device=str(target.device),
        draft_device=str(draft.device) if draft else "", dtype=str(target.dtype).replace("torch.", ""),
        forward="fused" if fused_for(target.model) else "transformers",
        prompt_set=settings.prompt_set, prompt_names=[p.name for p in prompts], prompt_lengths=[len(p.ids) for p in prompts],
        new_tokens=settings.new_tokens, repeats=settings.repeats, warmup=settings.warmup, ks=list(settings.ks),
        fastest_baseline=fastest.label, fastest_baseline_tokens_per_s=fastest.tokens_per_s,
        all_identical=all(r.identical_tokens for r in results), wall_s=wall_s)


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


COLUMNS = (("method", 22, lambda r: r.label), ("tok/s", 8, lambda r: _fmt(r.tokens_per_s, ".1f")),
           ("TTFT ms", 8, lambda r: _fmt(r.ttft_ms, ".1f")), ("TPOT ms", 8, lambda r: _fmt(r.tpot_ms, ".2f")),
           ("alpha", 6, lambda r: _fmt(r.acceptance_rate, ".3f") if r.k else "-"),
           ("tau", 5, lambda r: _fmt(r.mean_accepted_length, ".2f")),
           ("fwd/tok", 7, lambda r: _fmt(r.target_forwards_per_token, ".3f")),
           ("c", 6, lambda r: _fmt(r.c, ".3f") if r.k else "-"), ("r", 5, lambda r: _fmt(r.r, ".2f") if r.k else "-"),
           ("speed-up", 8, lambda r: _fmt(r.speedup, ".2f") + "x"),
           ("predicted", 9, lambda r: _fmt(r.predicted_speedup, ".2f") + "x"),
           ("meas/pred", 9, lambda r: _fmt(r.efficiency, ".2f")),
           ("same tokens", 11, lambda r: "yes" if r.identical_tokens else f"NO {r.mismatched_prompts}"))


def headlines(results: Sequence[MethodResult]) -> list[str]:
    """The comparisons the project's targets are stated in: best of each method, v2 against
    Hugging Face assisted generation and v1 at the same K, the engine's target-only against `generate`."""
    by_label = {r.label: r for r in results}
    lines = []
    for name in ("v2", "v1", "v2-heuristic", "ngram", "hybrid", "hybrid-heuristic", "hf-assisted", "hf-prompt-lookup"):
        best = max((r for r in results if r.method == name), key=lambda r: r.speedup, default=None)
        if best:
            lines.append(f"best {name}: {best.label} at {best.speedup:.2f}x (predicted {best.predicted_speedup:.2f}x)")
    for r in (r for r in results if r.method == "v2"):
        others = [(o, by_label.get(f"{o} K={r.k}")) for o in ("hf-assisted", "v1")]
        ratios = [f"{r.tokens_per_s / o.tokens_per_s:.2f}x {name}" for name, o in others if o]
        if ratios:
            lines.append(f"v2 K={r.k} is " + ", ".join(ratios))
    if "target" in by_label and "hf-generate" in by_label:
        ratio = by_label["target"].tokens_per_s / by_label["hf-generate"].tokens_per_s
        lines.append(f"engine target-only is {ratio:.2f}x hf-generate")
    if "target" in by_label and "target-transformers" in by_label:
        ratio = by_label["target"].tokens_per_s / by_label["target-transformers"].tokens_per_s
        lines.append(f"the fused forward makes target-only {ratio:.2f}x the transformers forward")
    return lines


def format_table(results: Sequence[MethodResult], meta: BenchMeta) -> str:
    """The stdout report: one row per method and K, then the headline comparisons."""
    head = " ".join(name.rjust(w) if i else name.ljust(w) for i, (name, w, _) in enumerate(COLUMNS))
    rows = [" ".join(f(r).rjust(w) if i else f(r).ljust(w) for i, (_, w, f) in enumerate(COLUMNS)) for r in results]
    lines = [f"{meta.target} <- {meta.draft or '(no draft)'} on {meta.machine}; {meta.prompt_set} prompts "
             f"x{len(meta.prompt_names)}, {meta.new_tokens} new tokens, greedy, median of {meta.repeats}",
             head, "-" * len(head), *rows, ""]
    lines.append(f"speed-up is over the fastest target-only baseline: {meta.fastest_baseline} "
                 f"({meta.fastest_baseline_tokens_per_s:.1f} tokens/s)")
    lines += headlines(results)
    bad = [r.label for r in results if not r.identical_tokens]
    lines.append("identical tokens: all methods" if not bad else f"identical tokens: NO for {', '.join(bad)}")
    return "\n".join(lines)


def _jsonable(value):
    """asdict output with NaN/inf as null, so the file is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


def write_json(path: Path, meta: BenchMeta, results: Sequence[MethodResult]) -> None:
    doc = {"meta": asdict(meta), "records": [asdict(r) for r in results]}
    path.write_text(json.dumps(_jsonable(doc), indent=2, allow_nan=False) + "\n")


def write_plot(results: Sequence[MethodResult], meta: BenchMeta, path: Path) -> Path:
    """Speed-up against K, measured (solid) beside predicted (dotted), one colour per method.

    A .png needs kaleido; without it the figure is written as .html next to the asked path.
    Returns the path actually written.
    """
    import importlib.util

    import plotly.graph_objects as go

    fig = go.Figure()
    palette = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2")
    swept = [m for m in METHOD_NAMES if any(r.method == m and r.schedule == "constant" for r in results)]
    for colour, name in zip(palette, swept):
        rs = sorted((r for r in results if r.method == name), key=lambda r: r.k)
        ks = [r.k for r in rs]
        fig.add_scatter(x=ks, y=[r.speedup for r in rs], name=f"{name} measured", mode="lines+markers",
                        line={"color": colour})
        fig.add_scatter(x=ks, y=[r.predicted_speedup for r in rs], name=f"{name} predicted", mode="lines+markers",
                        line={"color": colour, "dash": "dot"}, marker={"symbol": "circle-open"})
    for r in results:
        if r.schedule == "heuristic":
            fig.add_scatter(x=[r.mean_k], y=[r.speedup], name=f"{r.method} (mean K)", mode="markers",
                            marker={"symbol": "star", "size": 12})
    fig.add_hline(y=1.0, line={"color": "grey", "dash": "dash"}, annotation_text=meta.fastest_baseline)
    fig.update_layout(title=f"Speed-up over {meta.fastest_baseline}: {meta.target} <- {meta.draft}, "
                            f"{meta.prompt_set} prompts, {meta.new_tokens} new tokens",
                      xaxis_title="K (draft tokens per round)", yaxis_title="speed-up (x)", template="plotly_white")
    if path.suffix == ".png" and importlib.util.find_spec("kaleido") is not None:
        fig.write_image(str(path), width=1000, height=600)
        return path
    out = path.with_suffix(".html")
    fig.write_html(str(out), include_plotlyjs=True)  # self-contained: works offline
    return out


# ---------------------------------------------------------------------------- --profile

def parse_method(spec: str, default_k: int) -> Method:
    """'v2', 'v2:4', 'target', 'hf-assisted:2', ... -> Method."""
    name, _, k = spec.partition(":")
    if name not in METHOD_NAMES:
        raise ValueError(f"unknown method {name!r}; choose from {list(METHOD_NAMES)}")
    if name in UNDRAFTED:
        return Method(name)
    if name.endswith("-heuristic"):
        return Method(name, HEURISTIC_START_K)
    try:
        return Method(name, int(k) if k else default_k)
    except ValueError:
        raise ValueError(f"bad K in {spec!r}; write METHOD:K, e.g. v2:4") from None


def profile(method: Method, settings: BenchSettings, target: LoadedModel, draft: LoadedModel | None,
            prompts: Sequence[Prompt], top: int) -> str:
    """Where one method's time goes: per-phase ms/token (engine RoundTimings), time inside model
    forwards against the Python around them, and cProfile's top functions by own time."""
    run_once(method, target, draft, prompts[0], 0, min(settings.new_tokens, 16))  # warm-up
    prof = cProfile.Profile()
    samples = []
    prof.enable()
    for _ in range(settings.repeats):
        samples.extend(run_once(method, target, draft, p, i, settings.new_tokens) for i, p in enumerate(prompts))
    prof.disable()
    tokens = sum(len(s.tokens) for s in samples)
    wall_ms = sum(s.wall_s for s in samples) * 1000
    fwd_ms = sum(t.seconds for s in samples for t in (*s.target_fwd, *s.draft_fwd)) * 1000
    lines = [f"profile of {method.label}: {len(samples)} runs, {tokens} tokens, {wall_ms / tokens:.2f} ms/token "
             f"({tokens / wall_ms * 1000:.1f} tokens/s; cProfile on, so slower than the bench)", ""]
    if method.family == "engine":
        per_token = phases_per_token(samples)
        lines.append("phase (RoundTimings)        ms/token   share")
        for f in fields(Phases):
            ms = getattr(per_token, f.name)
            lines.append(f"  {f.name:<24}{ms:>10.3f}  {ms * tokens / wall_ms:>6.1%}")
    lines.append(f"  {'model forwards (hooks)':<24}{fwd_ms / tokens:>10.3f}  {fwd_ms / wall_ms:>6.1%}"
                 "   (target and draft, prefill included)")
    lines.append(f"  {'everything else':<24}{(wall_ms - fwd_ms) / tokens:>10.3f}  {1 - fwd_ms / wall_ms:>6.1%}")
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    lines += ["", f"cProfile, top {top} functions by own time:", out.getvalue().split("\n", 4)[-1].rstrip()]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- command line

class UsageError(ValueError):
    """Bad command-line input: printed as one `error:` line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        raise UsageError(message)


QUICK = {"num_prompts": 1, "prompt_tokens": 32, "new_tokens": 8, "repeats": 1, "warmup": 0, "ks": "2"}


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m engine bench",
                description="Benchmark speculative decoding (v2, v1, heuristic K, n-gram) against target-only "
                            "decoding and Hugging Face assisted generation, interleaved, medians over repeats.")
    p.add_argument("--target", default=BUILTIN, help="target: 'builtin', a Hugging Face id or a path (default: builtin)")
    p.add_argument("--draft", default=BUILTIN, help="draft model, sharing the target's tokenizer (default: builtin)")
    p.add_argument("--draft-device", default=None, help="default: cuda:0 if present, else cpu")
    p.add_argument("--target-device", default=None, help="default: cuda:1 with 2+ GPUs, cuda:0 with one, else cpu")
    p.add_argument("--dtype", choices=DTYPES, default="auto", help="weights dtype; auto = fp32 on CPU, bf16 on CUDA")
    p.add_argument("--prompts", choices=("heldout", "code"), default="heldout",
                   help="heldout: windows of held-out stdlib test files; code: their first halves, to continue")
    p.add_argument("--num-prompts", type=int, default=None, help="prompts (default: 8)")
    p.add_argument("--prompt-tokens", type=int, default=None,
                   help=f"heldout: window length (default 128); code: most prompt tokens kept (default {CODE_PROMPT_TOKENS})")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens generated per prompt (default: 64)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats; medians are reported (default: 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed warm-up runs per method (default: 1)")
    p.add_argument("--ks", default=None, help="comma-separated K values (default: 1,2,3,4,6,8)")
    p.add_argument("--methods", default=None,
                   help=f"comma-separated subset of {','.join(METHOD_NAMES)} (the target-only baselines always run)")
    p.add_argument("--seed", type=int, default=0, help="prompt selection seed (default: 0)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="write one record per method and K")
    p.add_argument("--plot", type=Path, default=None, metavar="PATH",
                   help="speed-up against K, measured beside predicted: .png if kaleido is installed, else .html")
    p.add_argument("--profile", default=None, metavar="METHOD[:K]",
                   help="instead of the bench, show where one method's time goes (phases and cProfile)")
    p.add_argument("--profile-top", type=int, default=25, help="cProfile functions listed (default: 25)")
    p.add_argument("--quick", action="store_true", help="a tiny run (1 prompt of 32 tokens, 8 new, K=2, 1 repeat)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def _int_list(text: str, what: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"{what} must be comma-separated integers, got {text!r}") from None


def settings_from_args(a: argparse.Namespace) -> BenchSettings:
    """Explicit flags win; otherwise --quick's tiny values; otherwise the defaults."""
    base = {**asdict(BenchSettings()), "ks": ",".join(map(str, DEFAULT_KS))}
    if a.prompts == "code":
        base["prompt_tokens"] = CODE_PROMPT_TOKENS
    pick = lambda name: getattr(a, name) if getattr(a, name) is not None else (QUICK if a.quick else base).get(name, base[name])
    methods = tuple(m.strip() for m in a.methods.split(",")) if a.methods else METHOD_NAMES
    try:
        return BenchSettings(prompt_set=a.prompts, num_prompts=pick("num_prompts"), prompt_tokens=pick("prompt_tokens"),
                             new_tokens=pick("new_tokens"), repeats=pick("repeats"), warmup=pick("warmup"),
                             ks=_int_list(pick("ks"), "--ks"), methods=methods, seed=a.seed)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def load_pair(a: argparse.Namespace, needs_draft: bool) -> tuple[LoadedModel, LoadedModel | None]:
    for spec in (a.draft_device, a.target_device):
        if spec is not None:
            check_device(spec)
    draft_dev, target_dev = default_devices(a.draft_device, a.target_device)
    target = load_model(a.target, "target", device=target_dev, dtype=a.dtype)
    return target, load_model(a.draft, "draft", device=draft_dev, dtype=a.dtype) if needs_draft else None


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """Assisted generation warns on every call about its own internal kwargs; keep the report readable."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def bench(argv: Sequence[str], a: argparse.Namespace) -> str:
    """Run the bench (or --profile) and return the report text; writes --json and --plot."""
    settings = settings_from_args(a)
    if a.threads:
        torch.set_num_threads(a.threads)
    try:
        chosen = parse_method(a.profile, settings.ks[0]) if a.profile else None
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    drafters = [chosen] if chosen else build_methods(settings.methods, settings.ks)
    target, draft = load_pair(a, needs_draft=any(m.uses_draft_model for m in drafters))
    if draft is not None:
        from engine.models import check_same_tokenizer
        check_same_tokenizer(draft, target)
    with quiet_transformers():
        prompts = make_prompts(settings, target)
        if chosen:
            return profile(chosen, settings, target, draft, prompts, a.profile_top)
        t0 = time.perf_counter()
        samples = run_bench(settings, target, draft, prompts, progress=not a.no_progress)
    results = summarize_all(list(samples), samples)
    meta = make_meta(argv, settings, target, draft, prompts, results, time.perf_counter() - t0)
    report = format_table(results, meta)
    if a.json:
        write_json(a.json, meta, results)
        report += f"\nwrote {a.json}"
    if a.plot:
        report += f"\nwrote {write_plot(results, meta, a.plot)}"
    return report


def main(argv: list[str] | None = None) -> int:
    """`python -m engine bench [options]`: 0 on success, 2 on bad input."""
    from engine.block_manager import KVPoolExhausted

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        a = build_parser().parse_args(argv)
        report = bench(argv, a)
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except (UsageError, PromptError, ModelLoadError, KVPoolExhausted) as exc:
        print(f"error: {' '.join(str(exc).split()) or type(exc).__name__}", file=sys.stderr)
        return 2
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

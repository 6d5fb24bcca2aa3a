"""One timed run of one method on one prompt, and the interleaved loop over all of them."""
from __future__ import annotations

import copy
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, fields, replace

import torch

from engine.bench.clock import ForwardClock, ForwardTime
from engine.bench.methods import NGRAM_MAX, BenchSettings, Method, build_methods
from engine.bench.prompts import Prompt
from engine.models import LoadedModel
from engine.speculative import SpeculativeEngine


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

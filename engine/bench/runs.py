"""One timed run of one method on one prompt, and the interleaved loop over all of them."""
from __future__ import annotations

import copy
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

import torch

from engine.bench.clock import ForwardClock, ForwardTime
from engine.bench.methods import NGRAM_MAX, BenchSettings, Method, build_methods
from engine.bench.prompts import Prompt
from engine.models import LoadedModel
from engine.pair import ModelPair
from engine.speculative import SpeculativeEngine
from engine.tree import Confidences


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
    verified: int | None            # positions verified (engine runs; `generate` does not say)
    target_fwd: list[ForwardTime]   # every forward, in order; the first is the prefill
    draft_fwd: list[ForwardTime]    # likewise (empty without a draft model)
    phases: Phases | None           # engine methods only
    rounds_draft_forwards: list[int] | None = None  # draft-model forwards per round (engine); None: rounds_k
    checks: list[list[bool]] = field(default_factory=list)  # per drafted round, its verified accepts (engine)
    rounds_depth: list[int] | None = None   # the most tokens each round could accept (a tree: its depth)

    @property
    def decode_forwards(self) -> tuple[list[ForwardTime], list[ForwardTime]]:
        """(target, draft) forwards after each model's first (prefill) one: the ones c and r come from."""
        return self.target_fwd[1:], self.draft_fwd[1:]


@dataclass
class BenchModels:
    """The models every run of a bench shares: the engine's checked pair, and one assistant per K for
    `generate` (built once, see `assistant_for`)."""

    pair: ModelPair
    assistants: dict[int, torch.nn.Module] = field(default_factory=dict)
    eagle3: ModelPair | None = None   # the same target with its second head, for the "eagle3" methods

    def pair_for(self, method: Method) -> ModelPair:
        if method.head == "eagle3":
            if self.eagle3 is None:
                raise ValueError(f"{method.name} needs the target's second head (--eagle3)")
            return self.eagle3
        return self.pair

    @property
    def target(self) -> LoadedModel:
        return self.pair.target

    @property
    def draft(self) -> LoadedModel | None:
        return self.pair.draft

    def assistant(self, k: int) -> torch.nn.Module:
        if k not in self.assistants:
            self.assistants[k] = assistant_for(self.draft, k)
        return self.assistants[k]


def assistant_for(draft: LoadedModel, k: int) -> torch.nn.Module:
    """The draft module as `generate` needs it for assisted generation at K: a shallow copy sharing the
    draft's weights, with its own generation_config asking for K assistant tokens, a constant schedule
    and no confidence early-stop (generate reads these from the assistant's config, so every round
    drafts exactly K like the engine's). The draft itself is left as it was loaded."""
    assistant = copy.copy(draft.model)
    config = copy.deepcopy(draft.model.generation_config)
    config.num_assistant_tokens, config.num_assistant_tokens_schedule = k, "constant"
    config.assistant_confidence_threshold = 0.0
    assistant.generation_config = config
    return assistant


def _forward_times(rounds: list, prompt_len: int) -> tuple[list[ForwardTime], list[ForwardTime]]:
    """The engine's own per-forward times (its round records), as the bench's ForwardTimes: the target's
    prefill, then one verify forward per round over K + 1 rows; every draft-model forward."""
    target = [ForwardTime(prompt_len if r.is_prefill else r.k + 1, 1 if r.is_prefill else 0,
                          r.timings.target_forward_ms / 1000) for r in rounds]
    target += [ForwardTime(r.accepted, 1, r.timings.commit_forward_ms / 1000) for r in rounds
               if r.timings.commit_forward_ms]  # v1's commit forwards, after the verify forwards
    draft = [ForwardTime(1, 1, ms / 1000) for r in rounds for ms in r.timings.draft_forward_ms]
    return target, draft


def run_engine(method: Method, models: BenchModels, prompt: list[int], new_tokens: int,
               learned: Confidences | None = None) -> RunSample:
    """Decode with SpeculativeEngine; the clock starts before the engine (and its KV pools) exist. A greedy
    tree grows by the confidence table in `learned` (the method's own, kept across its runs), else a fresh one."""
    t0 = time.perf_counter()
    config = method.spec_config(new_tokens)
    engine = SpeculativeEngine(models.pair_for(method), prompt, config,
                               confidence=learned.for_run(config) if learned else None)
    engine.step()
    ttft = time.perf_counter() - t0
    engine.run()
    engine.close()
    wall = time.perf_counter() - t0
    rounds = engine.rounds
    busy = sum(r.timings.total_ms for r in rounds)
    phases = Phases(*(sum(getattr(r.timings, f"{p}_ms") for r in rounds)
                      for p in ("prefill", "draft", "verify", "commit", "other")), wall * 1000 - busy)
    target_fwd, draft_fwd = _forward_times(rounds, len(prompt))
    return RunSample(-1, list(engine.generated), wall, ttft, [r.k for r in rounds], sum(r.accepted for r in rounds),
                     sum(r.verified for r in rounds), target_fwd, draft_fwd, phases, [r.draft_forwards for r in rounds],
                     [r.checks() for r in rounds if r.k], [r.depth for r in rounds])


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


def _hf_generate(target: LoadedModel, ids: torch.Tensor, config, assistant: torch.nn.Module | None) -> torch.Tensor:
    extra = {"assistant_model": assistant} if assistant is not None else {}
    with torch.inference_mode():
        return target.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, **extra)


def run_hf(method: Method, models: BenchModels, prompt: list[int], new_tokens: int) -> RunSample:
    """Decode with `generate`. Each target forward is one round that checked (rows - 1) drafts and
    emitted accepted + 1 tokens, so accepted = tokens - target forwards. TTFT: a max_new_tokens=1 call."""
    target = models.target
    ids = torch.tensor([prompt], dtype=torch.long, device=target.device)
    assistant = models.assistant(method.k) if method.name == "hf-assisted" else None
    full, first = hf_config(target, method, new_tokens), hf_config(target, method, 1)
    with ForwardClock(target) as tc, ForwardClock(None, assistant) as dc:
        t0 = time.perf_counter()
        out = _hf_generate(target, ids, full, assistant)
        wall = time.perf_counter() - t0
    t0 = time.perf_counter()
    _hf_generate(target, ids, first, assistant)
    ttft = time.perf_counter() - t0
    tokens = out[0, len(prompt):].tolist()
    rounds_k = [max(0, t.rows - 1) for t in tc.times]
    return RunSample(-1, tokens, wall, ttft, rounds_k, len(tokens) - len(tc.times), None, tc.times, dc.times, None)


def run_once(method: Method, models: BenchModels, prompt: Prompt, index: int, new_tokens: int,
             learned: Confidences | None = None) -> RunSample:
    sample = run_hf(method, models, prompt.ids, new_tokens) if method.family == "hf" else \
        run_engine(method, models, prompt.ids, new_tokens, learned)
    return replace(sample, prompt=index)


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="bench", unit="run", file=sys.stderr, disable=not enabled, leave=False)


def run_bench(settings: BenchSettings, models: BenchModels, prompts: Sequence[Prompt],
              progress: bool = True) -> dict[Method, list[RunSample]]:
    """Every method on every prompt, `repeats` times: repeat -> prompt -> methods in a rotating order. Each
    method keeps its own confidence tables across its runs (warm-up included), so no method's trees
    depend on which methods ran before it."""
    methods = build_methods(settings.methods, settings.ks)
    samples: dict[Method, list[RunSample]] = {m: [] for m in methods}
    learned = {m: Confidences() for m in methods}
    total = len(methods) * (settings.warmup + settings.repeats * len(prompts))
    with _progress(total, progress) as bar:
        for _ in range(settings.warmup):
            for m in methods:
                run_once(m, models, prompts[0], 0, min(settings.new_tokens, 16), learned[m])
                bar.update()
        for rep in range(settings.repeats):
            for i, prompt in enumerate(prompts):
                shift = (rep * len(prompts) + i) % len(methods)
                for m in methods[shift:] + methods[:shift]:
                    samples[m].append(run_once(m, models, prompt, i, settings.new_tokens, learned[m]))
                    bar.update()
    return samples

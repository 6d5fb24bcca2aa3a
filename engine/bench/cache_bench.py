"""`python -m engine cache-bench`: the cost of one decode forward, by forward and by cache.

For each model (default: the built-in target, then the built-in draft): interleaved repeats of 32
single-token decodes after a 256-token prefill, medians in ms per forward, for
- the engine's fused forward over PagedCache (what the engine runs),
- the transformers forward over PagedCache, on its contiguous fast path and on its gather path,
- the transformers forward over transformers' DynamicCache (what `generate` runs).
"""
from __future__ import annotations

import statistics
import sys

import torch

from engine.clock import ForwardTimer


def _decode_ms(forward, prompt: torch.Tensor, steps: int) -> tuple[float, int]:
    """(ms per decode step, the greedy next token after the last step)."""
    forward(prompt)
    x = torch.tensor([[5]], device=prompt.device)
    timer, total = ForwardTimer(prompt.device), []
    with timer.time(total):
        for _ in range(steps):
            out = forward(x)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return total[0] / steps, int(logits.reshape(-1, logits.shape[-1])[-1].argmax())


def bench_model(loaded, context: int, repeats: int) -> dict[str, float]:
    """Median ms per decode forward, by path. ValueError when the paths do not all decode the same next
    token (a faster path that computes something else is no faster path)."""
    from transformers import DynamicCache

    from engine.kv_cache import KVPool

    model, fused = loaded.model, loaded.fused
    prompt = torch.randint(0, loaded.vocab_size, (1, context), generator=torch.Generator().manual_seed(0)).to(
        loaded.device)
    pool = KVPool(loaded.kv_shape, -(-(context + 64) // 16), 16, loaded.device, loaded.dtype)
    times: dict[str, list[float]] = {}
    tokens: dict[str, int] = {}

    def record(name: str, measured: tuple[float, int]) -> None:
        times.setdefault(name, []).append(measured[0])
        tokens[name] = measured[1]

    def paged(name: str, contiguous: bool, use_fused: bool) -> None:
        cache = pool.new_sequence(fast_path=contiguous)
        if use_fused:
            forward = lambda ids: fused.forward(cache, ids)  # noqa: E731
        else:
            forward = lambda ids: model(input_ids=ids, cache=cache, use_cache=True)  # noqa: E731
        record(name, _decode_ms(forward, prompt, 32))
        cache.free()

    with torch.inference_mode():
        for _ in range(repeats):
            if fused is not None:
                paged("fused forward, PagedCache", True, True)
            dynamic = DynamicCache(config=model.config)
            record("transformers, DynamicCache",
                   _decode_ms(lambda ids: model(input_ids=ids, cache=dynamic, use_cache=True), prompt, 32))
            paged("transformers, PagedCache (view)", True, False)
            paged("transformers, PagedCache (gather)", False, False)
    if len(set(tokens.values())) > 1:
        raise ValueError(f"the paths decode different next tokens on {loaded.name}: {tokens}")
    return {name: statistics.median(xs) for name, xs in times.items()}


def main(argv: list[str] | None = None) -> int:
    import argparse

    from engine.models import load_model
    from engine.sources import BUILTIN

    ap = argparse.ArgumentParser(prog="python -m engine cache-bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=BUILTIN, help="model id or path (default: the built-in target)")
    ap.add_argument("--draft", default=BUILTIN, help="a second model, or 'none' (default: the built-in draft)")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--context", type=int, default=256)
    a = ap.parse_args(argv)
    models = [(a.target, "target")] + ([(a.draft, "draft")] if a.draft != "none" else [])
    for source, role in models:
        loaded = load_model(source, role)
        print(f"{loaded.name}: one decode forward after {a.context} tokens, median of {a.repeats}")
        for name, ms in bench_model(loaded, a.context, a.repeats).items():
            print(f"  {name:36s} {ms:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())

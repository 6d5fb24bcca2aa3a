"""`python -m engine cache-bench`: one decode forward through PagedCache vs transformers' DynamicCache.

Interleaved repeats of 32 single-token decodes after a 256-token prefill, medians in ms per
forward: the paged cache on its contiguous fast path, on its gather path, and DynamicCache.
"""
from __future__ import annotations

import statistics
import sys
import time

import torch


def _decode_ms(model, cache, prompt: torch.Tensor, steps: int) -> float:
    model(input_ids=prompt, cache=cache, use_cache=True)
    x = torch.tensor([[5]])
    t0 = time.perf_counter()
    for _ in range(steps):
        model(input_ids=x, cache=cache, use_cache=True)
    return (time.perf_counter() - t0) / steps * 1000


def main(argv: list[str] | None = None) -> int:
    import argparse

    from transformers import DynamicCache

    from engine.kv_cache import KVPool
    from engine.models import BUILTIN, load_model

    ap = argparse.ArgumentParser(prog="python -m engine cache-bench", description=__doc__)
    ap.add_argument("--target", default=BUILTIN, help="model id or path (default: the built-in target)")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--context", type=int, default=256)
    a = ap.parse_args(argv)
    loaded = load_model(a.target, "target")
    model = loaded.model
    prompt = torch.randint(0, loaded.vocab_size, (1, a.context), generator=torch.Generator().manual_seed(0))
    pool = KVPool(loaded.kv_shape, -(-(a.context + 64) // 16), 16, loaded.device, loaded.dtype)
    times: dict[str, list[float]] = {"DynamicCache": [], "PagedCache (view)": [], "PagedCache (gather)": []}
    with torch.inference_mode():
        for _ in range(a.repeats):
            times["DynamicCache"].append(_decode_ms(model, DynamicCache(config=model.config), prompt, 32))
            for name, contiguous in (("PagedCache (view)", True), ("PagedCache (gather)", False)):
                cache = pool.new_sequence()
                if not contiguous:
                    cache._contiguous_span = lambda: None  # force the index_select path
                times[name].append(_decode_ms(model, cache, prompt, 32))
                cache.free()
    for name, xs in times.items():
        print(f"{name:22s} {statistics.median(xs):.3f} ms/forward")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Runs inside vLLM's own virtualenv (`python -m engine peer-bench` starts it): decodes the bench's token ids
with vLLM's offline engine and writes what it measured as JSON. It imports vLLM and the standard library
only, never the engine (the two environments pin different transformers).

Input (argv[1], JSON): {"model": folder, "prompts": [[ids]], "new_tokens": n, "repeats": r,
"methods": [{"label", "speculative": null | {...vLLM speculative_config...}}], "enforce_eager": bool,
"batches": [B, ...] (optional)}.
Output (argv[2], JSON): per method, the wall seconds of each timed repeat, the tokens, and vLLM's own
speculative-decoding counters (drafts, draft tokens, accepted tokens, accepted per position). With "batches",
each repeat instead hands vLLM the first B prompts in one `generate` call per batch size (vLLM batches them),
exactly new_tokens each (EOS ignored, as the engine's batch study runs), and the output holds per batch size
the walls, the tokens and the counters.
"""
from __future__ import annotations

import json
import sys
import time


def counters(llm) -> dict:
    out = {}
    for metric in llm.get_metrics():
        name = metric.name
        if not (name.startswith("vllm:spec_decode") or name == "vllm:generation_tokens"):
            continue
        if hasattr(metric, "values"):
            out[name] = [float(v) for v in metric.values]
        elif hasattr(metric, "value"):
            out[name] = float(metric.value)
    return out


def delta(after: dict, before: dict) -> dict:
    out = {}
    for k, v in after.items():
        b = before.get(k)
        if isinstance(v, list):
            b = b or [0.0] * len(v)
            out[k] = [x - y for x, y in zip(v, b + [0.0] * (len(v) - len(b)))]
        else:
            out[k] = v - (b or 0.0)
    return out


def batch_runs(llm, prompts: list, params, repeats: int) -> dict:
    """The prompts as one batch, `repeats` times: walls, the tokens, and the counters over the repeats."""
    walls, tokens, before = [], None, counters(llm)
    for _ in range(repeats):
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        walls.append(time.perf_counter() - t)
        tokens = tokens or [list(o.outputs[0].token_ids) for o in outs]
    return {"walls": walls, "tokens": tokens, "counters": delta(counters(llm), before)}


def main() -> int:
    spec = json.loads(open(sys.argv[1]).read())
    from vllm import LLM, SamplingParams, TokensPrompt

    batches = spec.get("batches")
    params = SamplingParams(temperature=0.0, max_tokens=spec["new_tokens"], ignore_eos=bool(batches))
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    results = []
    for method in spec["methods"]:
        t0 = time.perf_counter()
        llm = LLM(model=spec["model"], dtype="float32", enforce_eager=spec.get("enforce_eager", True),
                  speculative_config=method["speculative"], max_model_len=spec.get("max_model_len", 2048),
                  disable_log_stats=False, seed=0)
        start_s = time.perf_counter() - t0
        for p in prompts[:2]:   # warm-up, untimed
            llm.generate([p], params, use_tqdm=False)
        if batches:
            results.append({"label": method["label"], "start_s": start_s,
                            "batches": {str(b): batch_runs(llm, prompts[:b], params, spec["repeats"])
                                        for b in batches}})
            del llm
            print(f"peer: {method['label']} done", file=sys.stderr, flush=True)
            continue
        walls, tokens, before = [], None, counters(llm)
        for _ in range(spec["repeats"]):
            run_tokens = []
            t = time.perf_counter()
            for p in prompts:   # one request at a time: batch 1, as the engine decodes
                out = llm.generate([p], params, use_tqdm=False)[0]
                run_tokens.append(list(out.outputs[0].token_ids))
            walls.append(time.perf_counter() - t)
            tokens = tokens or run_tokens
        results.append({"label": method["label"], "start_s": start_s, "walls": walls, "tokens": tokens,
                        "counters": delta(counters(llm), before)})
        del llm
        print(f"peer: {method['label']} done", file=sys.stderr, flush=True)
    with open(sys.argv[2], "w") as f:
        json.dump({"results": results}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())

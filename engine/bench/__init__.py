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
- speed-up = tokens/s over the fastest target-only baseline; decode speed-up the same after each run's first
  token (the prefill is the TTFT column's); efficiency = meas/pred = decode speed-up / predicted, which the
  report takes apart: tokens counted against E(alpha, K), the calibrated r against the rounds' own r, and
  the rest (time outside the forwards).
- identical_tokens: every repeat of every prompt equals `hf-generate`'s tokens (all methods are greedy).
"""

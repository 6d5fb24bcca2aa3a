"""Known-wrong verification rules, for checking that a losslessness test can tell them from the right one.

Real engines have shipped each of these; acceptance rates and tokens/s look normal under all three, and only
the distribution of the tokens shows them. An engine built with `fault=` verifies every drafted chain with it
(the prefill's token and a round that drafted nothing are sampled as usual, as the engines that shipped these
did); `engine.audit` serves such an engine to show that an audit catches each one.

- NO_RESIDUAL: after a rejection the correction is drawn from p itself, not from the residual max(0, p - q),
  so the rejected draft can come back and draft-like tokens are over-produced.
- ARGMAX: the verify treats the target's rows as greedy whatever the temperature: a draft survives only if
  it is p's argmax, and the correction or bonus is the argmax.
- RAW_P: the target's probabilities in the verify are the plain softmax of its logits, without the request's
  temperature, top-k and top-p (the drafts still come from the processed q).
"""
from __future__ import annotations

from enum import Enum

import torch

from engine.config import SpecConfig
from engine.sampling import SamplingParams, greedy_ids, logits_to_probs, one_hot_rows, sample_from
from engine.verify import Verdict, verify


class Fault(str, Enum):
    NO_RESIDUAL = "no-residual"
    ARGMAX = "argmax"
    RAW_P = "raw-p"

    @property
    def description(self) -> str:
        return {Fault.NO_RESIDUAL: "a correction drawn from p instead of the residual max(0, p - q)",
                Fault.ARGMAX: "the verify takes the argmax whatever the temperature",
                Fault.RAW_P: "the target's p without the request's temperature, top-k and top-p"}[self]


def faulty_verify(fault: Fault, q_draft: torch.Tensor, draft_tokens: list[int], logits: torch.Tensor,
                  config: SpecConfig, generator: torch.Generator) -> tuple[torch.Tensor, Verdict]:
    """A chain's (p rows, verdict) under `fault`, drawing the same K + 1 uniforms `verify` draws."""
    sampling = config.sampling
    if fault is Fault.ARGMAX:
        p_rows = one_hot_rows(greedy_ids(logits), logits.shape[1])
    elif fault is Fault.RAW_P:
        p_rows = logits_to_probs(logits, SamplingParams(temperature=1.0))
    else:
        p_rows = logits_to_probs(logits, sampling)
    verdict = verify(q_draft, p_rows, draft_tokens, generator, validate=False)
    if fault is Fault.NO_RESIDUAL and verdict.rejected:
        row = p_rows[verdict.final_row]
        token = int(sample_from(row.unsqueeze(0), torch.tensor([verdict.final_u], dtype=torch.float64))[0])
        verdict = Verdict(verdict.path, verdict.tokens[:-1] + [token], verdict.tested, token, verdict.final_outcome,
                          verdict.final_row, verdict.final_u, row.detach().float().cpu())
    return p_rows, verdict

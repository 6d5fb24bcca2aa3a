"""`python -m engine audit URL`: is a server's speculative sampling lossless? and `python -m engine serve`: this
project's engine behind the same API (with a known-wrong rule on request, to see an audit catch it).

audit, one sample: with the served model's weights here (--model), the first m tokens' joint distribution is
computed exactly and the server's completions are tested against it. Two samples: --reference URL is the same
model served without speculation, and the two servers' completions are tested against each other.
Bad input prints one `error: ...` line and exits 2.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading

from engine.audit.client import AuditError, Endpoint, Stop
from engine.audit.exact import ExactError, exact_joint, floor_for
from engine.audit.run import DEFAULT_PROMPT, AuditPlan, AuditReport, audit_exact, audit_reference
from engine.cli import Parser, UsageError, quiet_transformers
from engine.models import ModelLoadError, load_model
from engine.prompts import ChatPrompt, PromptError, encode_chat, encode_prompt
from engine.sampling import SamplingParams


def audit_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m engine audit", description="Test whether an OpenAI-compatible server's sampling "
               "(with speculative decoding) is lossless: its first tokens' distribution against the model's own, "
               "computed here, or against the same model served without speculation.")
    p.add_argument("url", help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="the served model's weights here (smollm2, builtin, a folder): the one-sample "
                                   "test against its exact distribution (with --reference: its tokenizer only)")
    p.add_argument("--reference", help="the same model served without speculation: the two-sample test")
    p.add_argument("--served-model", help="the model name to request (default: the first /v1/models lists)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="the prompt text (default: a repeating list, so that "
                   "prompt lookup drafts too)")
    p.add_argument("--chat", action="store_true", help="wrap --prompt in the model's chat template")
    p.add_argument("--tokens", type=int, default=3, help="m, the first tokens tested jointly (1-4; default 3)")
    p.add_argument("--samples", type=int, default=2000, help="completions to ask for (default 2000)")
    p.add_argument("--per-request", type=int, default=50, help="completions per request, the API's n (default 50)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=8, help="top-k (default 8; 0: off; vLLM 0.32's CPU build fails "
                   "top-k requests with speculation on, so use 0 there)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="the first request's seed (-1: unseeded)")
    p.add_argument("--level", type=float, default=1e-3, help="the verdict's significance level (default 0.001)")
    p.add_argument("--concurrency", type=int, default=2, help="requests in flight (default 2)")
    p.add_argument("--time-limit", type=float, default=600.0, help="seconds for collecting (default 600)")
    p.add_argument("--allow-host", action="append", default=[], metavar="HOST",
                   help="a host other than loopback that may be audited (repeat for more)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def plan_from(a: argparse.Namespace) -> AuditPlan:
    try:
        params = SamplingParams(a.temperature, a.top_k, a.top_p)
        return AuditPlan(a.tokens, a.samples, params, a.per_request, None if a.seed == -1 else a.seed, a.level,
                         a.concurrency, a.time_limit)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def run_audit(a: argparse.Namespace, stop: Stop) -> AuditReport:
    if not a.model and not a.reference:
        raise UsageError("give --model (the weights here: the exact test) or --reference (the same model served "
                         "without speculation: the two-sample test)")
    plan = plan_from(a)
    allowed = tuple(a.allow_host)
    endpoint = Endpoint.of(a.url, a.served_model, allowed)

    def progress(name: str, done: int, total: int) -> None:
        shown.append(name)
        print(f"\r{name}: {done}/{total} completions", end="\n" if done >= total else "", file=sys.stderr, flush=True)

    shown: list[str] = []

    if a.reference:
        reference = Endpoint.of(a.reference, a.served_model, allowed)
        if a.model:
            with quiet_transformers():
                tok = load_model(a.model).tokenizer
            prompt: list[int] | str = encode_chat(tok, ChatPrompt(a.prompt)) if a.chat else encode_prompt(tok, a.prompt)
            label = (lambda k: k if isinstance(k, str) else tok.decode(k))
        else:
            if a.chat:
                raise UsageError("--chat needs --model: the chat template is the model's tokenizer's")
            prompt, label = a.prompt, (lambda k: k if isinstance(k, str) else " ".join(map(str, k)))
        report = audit_reference(endpoint, reference, prompt, label, plan, progress, stop)
    else:
        with quiet_transformers():
            model = load_model(a.model)
        tok = model.tokenizer
        ids = encode_chat(tok, ChatPrompt(a.prompt)) if a.chat else encode_prompt(tok, a.prompt)
        joint = exact_joint(model, ids, plan.m, plan.params, min_prob=floor_for(plan.samples))
        report = audit_exact(endpoint, ids, joint, model.name, lambda s: tok.decode(s), plan, progress, stop)
    return report


def report_json(report: AuditReport) -> str:
    a = report.analysis
    return json.dumps({
        "url": report.url, "reference": report.reference, "model": report.model, "exact_model": report.exact_model,
        "tokens": report.plan.m, "temperature": report.plan.params.temperature, "top_k": report.plan.params.top_k,
        "top_p": report.plan.params.top_p, "seed": report.plan.seed, "n": a.n, "reference_n": a.reference_n,
        "passed": a.passed, "p_value": a.p_value, "level": a.level,
        "tests": [{"tokens": t.depth, "chi_square": t.fit.statistic, "dof": t.fit.dof, "p_value": t.fit.p_value}
                  for t in a.tests],
        "outside_support": a.outside,
        "most_different": [{"label": c.label, "observed": c.observed, "expected": c.expected}
                           for c in a.most_different()],
        "power": None if a.power is None else {"cohens_w": a.power.w, "moved_points": a.power.moved_pp,
                                               "dof": a.power.dof},
        "seconds": report.seconds, "requests": report.requests, "cut_short": report.cut_short,
        "margin": report.margin}, indent=2)


def audit_main(argv: list[str] | None = None) -> int:
    stop = Stop()
    try:
        a = audit_parser().parse_args(argv)
        report = run_audit(a, stop)
    except KeyboardInterrupt:
        stop.set()
        print("\nerror: interrupted", file=sys.stderr)
        return 130
    except (UsageError, AuditError, ExactError, PromptError, ModelLoadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report_json(report) if a.json else "\n".join(report.lines()))
    return 0 if report.analysis.passed else 1


def serve_parser() -> argparse.ArgumentParser:
    from engine.config import DrafterKind
    from engine.faults import Fault

    p = Parser(prog="python -m engine serve", description="Serve this project's engine through an OpenAI-"
               "compatible completions API (and /metrics in vLLM's names) on a loopback address.")
    p.add_argument("--target", default="builtin", help="the target (builtin, smollm2, a folder; default builtin)")
    p.add_argument("--draft", help="the draft model (default: the built-in pair's draft with the builtin target)")
    p.add_argument("--drafter", default="model", choices=[d.value for d in DrafterKind],
                   help="who drafts (default: the draft model)")
    p.add_argument("--k", type=int, default=3, help="drafts per round (default 3)")
    p.add_argument("--name", help="the served model's name (default: the target's)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--fault", choices=[f.value for f in Fault],
                   help="verify with a known-wrong rule (an audit must catch it): " +
                        "; ".join(f"{f.value}: {f.description}" for f in Fault))
    return p


def serve_main(argv: list[str] | None = None) -> int:
    from engine.audit.server import EngineService, make_server
    from engine.config import DrafterKind, SpecConfig
    from engine.faults import Fault
    from engine.pair import load_pair
    from engine.sources import BUILTIN, SMOLLM2

    try:
        a = serve_parser().parse_args(argv)
        drafter = DrafterKind(a.drafter)
        config = SpecConfig(drafter=drafter, k=a.k)
        draft = a.draft or (BUILTIN if a.target == BUILTIN and drafter.value in ("model", "hybrid") else None)
        eagle = a.target if drafter.uses_eagle else None
        with quiet_transformers():
            pair = load_pair(a.target, draft, eagle)
        service = EngineService(pair, config, a.name or (SMOLLM2 if a.target == SMOLLM2 else a.target),
                                Fault(a.fault) if a.fault else None)
        server = make_server(service, a.host, a.port)
    except (UsageError, ValueError, ModelLoadError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    where = f"http://{a.host}:{server.server_address[1]}"
    print(f"serving {service.name} ({drafter.value}, K={a.k}" + (f", fault {a.fault}" if a.fault else "")
          + f") at {where}/v1/completions; Ctrl-C stops", flush=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        thread.join()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        server.server_close()
    return 0

"""The audit of a server's speculative sampling, end to end through HTTP: this project's engine served through
the OpenAI completions API (engine.audit.server) with the correct rule passes, and with each known-wrong rule
(engine.faults) fails, against the exact distribution and against a reference server; the statistics, the
exact enumeration, the request checks and every failure's sentence."""
from __future__ import annotations

import http.server
import json
import math
import threading
from collections import Counter

import pytest
import torch

from engine.audit import cli
from engine.audit.client import AuditError, Endpoint, Stop, parse_choices, sample
from engine.audit.exact import ExactError, exact_joint
from engine.audit.run import DEFAULT_PROMPT, AuditPlan, collect, keys_of
from engine.audit.server import EngineService, make_server
from engine.audit.verdict import against_exact, against_reference
from engine.config import DrafterKind, SpecConfig
from engine.faults import Fault
from engine.pair import ModelPair
from engine.prompts import encode_prompt
from engine.sampling import SamplingParams, logits_to_probs
from engine.stats import chi_square_quantile, detectable_noncentrality, homogeneity, noncentral_survival
from engine.watch import counters, parse_prometheus

# The built-in pair's code model, prompt lookup drafting (K = 3) after a repeating list: the first speculative
# round drafts whenever the first sampled token occurred in the prompt, which the wrong rules need to show.
PROMPT = DEFAULT_PROMPT
PARAMS = SamplingParams(1.0, 8, 1.0)
M = 3
PASS_LEVEL, FAIL_LEVEL = 1e-3, 1e-6


# -- statistics -------------------------------------------------------------------------------------------
def test_chi_square_quantile_and_power_match_tabulated_values():
    assert chi_square_quantile(1e-3, 1) == pytest.approx(10.8276, abs=1e-3)
    assert chi_square_quantile(0.05, 10) == pytest.approx(18.3070, abs=1e-3)
    # noncentral chi-square: the textbook's 80% power at 0.05 with one dof needs noncentrality 7.849
    assert detectable_noncentrality(1, 0.05, 0.8) == pytest.approx(7.849, abs=1e-2)
    assert noncentral_survival(3.8415, 1, 0.0) == pytest.approx(0.05, abs=1e-4)


def test_homogeneity_against_a_hand_computed_table():
    # 2x2: (60, 40) against (40, 60); expected 50 everywhere: chi-square 4 * 100 / 50 = 8, one dof
    fit = homogeneity(torch.tensor([60, 40]), torch.tensor([40, 60]))
    assert fit.statistic == pytest.approx(8.0) and fit.dof == 1 and fit.p_value == pytest.approx(0.004678, rel=1e-3)
    same = homogeneity(torch.tensor([30, 20, 1]), torch.tensor([60, 40, 2]))   # proportional: no evidence at all
    assert same.statistic == pytest.approx(0.0, abs=1e-9) and same.p_value == pytest.approx(1.0)
    with pytest.raises(ValueError, match="both samples"):
        homogeneity(torch.tensor([0, 0]), torch.tensor([1, 2]))


# -- the exact distribution ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pair(builtin_pair) -> ModelPair:
    draft, target = builtin_pair
    return ModelPair(target, draft)


@pytest.fixture(scope="module")
def prompt_ids(pair) -> list[int]:
    return encode_prompt(pair.target.tokenizer, PROMPT)


def test_exact_joint_is_the_chain_of_the_models_own_processed_rows(pair, prompt_ids):
    joint = exact_joint(pair.target, prompt_ids, 2, PARAMS, min_prob=1e-9)
    assert joint.probs.sum().item() == pytest.approx(1.0, abs=1e-6) and joint.tail(2) < 1e-6
    assert all(len(s) in (1, 2) for s in joint.sequences) and len(set(joint.sequences)) == len(joint.sequences)
    # P(t1, t2) = p(t1 | prompt) p(t2 | prompt, t1), each row through temperature and top-k (at most 8 each)
    model = pair.target.model
    with torch.inference_mode():
        first = logits_to_probs(model(torch.tensor([prompt_ids])).logits[:, -1].float(), PARAMS)[0].double()
    by_first = joint.levels[0]
    assert len(by_first) == 8
    for (t1,), p in by_first.items():
        assert p == pytest.approx(float(first[t1]), rel=1e-5)
    (t1, t2), p12 = max(((s, p) for s, p in zip(joint.sequences, joint.probs.tolist()) if len(s) == 2),
                        key=lambda sp: sp[1])
    with torch.inference_mode():
        second = logits_to_probs(model(torch.tensor([prompt_ids + [t1]])).logits[:, -1].float(), PARAMS)[0].double()
    assert p12 == pytest.approx(float(first[t1] * second[t2]), rel=1e-5)
    # a floor leaves the unlikely prefixes to the tail, and `probability` still gives any sequence its own
    floored = exact_joint(pair.target, prompt_ids, 2, PARAMS, min_prob=1e-2)
    rare = min(joint.levels[1], key=joint.levels[1].get)
    assert rare not in floored.levels[1] and floored.tail(2) > 0
    assert sum(floored.levels[1].values()) + floored.tail(2) == pytest.approx(1.0)
    assert floored.probability([rare])[rare][-1] == pytest.approx(joint.levels[1][rare], rel=1e-5)
    outside = (t1, int(second.argmin()))
    assert floored.probability([outside])[outside] == [pytest.approx(float(first[t1]), rel=1e-5), 0.0]


def test_a_sequence_that_ends_at_the_end_token_is_shorter(pair, prompt_ids):
    # make the likeliest first token the end token: sequences through it stop there
    model = pair.target.model
    with torch.inference_mode():
        likeliest = int(model(torch.tensor([prompt_ids])).logits[0, -1].argmax())
    joint = exact_joint(pair.target, prompt_ids, 3, PARAMS, eos_id=likeliest, min_prob=1e-9)
    assert (likeliest,) in joint.sequences
    assert not any(s[0] == likeliest and len(s) > 1 for s in joint.sequences)
    assert joint.probs.sum().item() == pytest.approx(1.0, abs=1e-6)


def test_exact_refuses_what_it_cannot_enumerate(pair, prompt_ids):
    with pytest.raises(ExactError, match="temperature above 0"):
        exact_joint(pair.target, prompt_ids, 2, SamplingParams(0.0))
    with pytest.raises(ExactError, match="set a top-k"):
        exact_joint(pair.target, prompt_ids, 3, SamplingParams(1.0, 0, 1.0), min_prob=1e-6, max_prefixes=100)


# -- the served engine ----------------------------------------------------------------------------------------
class Served:
    """The engine served on a free loopback port, in a thread, until close()."""

    def __init__(self, pair: ModelPair, fault: Fault | None = None, drafter: DrafterKind = DrafterKind.NGRAM):
        self.service = EngineService(pair, SpecConfig(drafter=drafter, k=3), "builtin", fault)
        self.server = make_server(self.service, "127.0.0.1", 0)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def servers(pair):
    made: dict[Fault | None, Served] = {}

    def get(fault: Fault | None) -> Served:
        if fault not in made:
            made[fault] = Served(pair, fault)
        return made[fault]
    yield get
    for s in made.values():
        s.close()


@pytest.fixture(scope="module")
def joint(pair, prompt_ids):
    return exact_joint(pair.target, prompt_ids, M, PARAMS, min_prob=1e-3)


@pytest.fixture(scope="module")
def collected(servers, prompt_ids):
    """Completions from a server (seeded: request i has seed i * 50), collected once per (rule, count)."""
    made: dict = {}

    def get(fault: Fault | None, samples: int) -> list:
        if (fault, samples) not in made:
            plan = AuditPlan(M, samples, PARAMS, per_request=50, seed=0)
            got = collect(Endpoint.of(servers(fault).url), "builtin", prompt_ids, plan)
            assert got.requests == samples // 50 and got.cut_short is None
            made[fault, samples] = keys_of(got.completions)
        return made[fault, samples]
    return get


def test_the_correct_rule_passes_the_audit(servers, collected, pair, joint):
    a = against_exact(collected(None, 200), joint, pair.target.tokenizer.decode, PASS_LEVEL)
    assert a.n == 200 and [t.depth for t in a.tests] == [1, 2, 3]
    assert a.passed and a.p_value > PASS_LEVEL, [(t.depth, t.fit) for t in a.tests]
    assert a.outside == 0 and a.power is not None and 0 < a.power.w < 1
    # the server really speculated: its counters, read as the watch page reads vLLM's
    [(model, c)] = counters(parse_prometheus(servers(None).service.metrics()), at=0.0).items()
    assert model == "builtin" and c.drafts > 100 and 0 < c.accepted < c.draft_tokens


@pytest.mark.parametrize("fault, samples", [(Fault.NO_RESIDUAL, 400), (Fault.ARGMAX, 150), (Fault.RAW_P, 150)])
def test_each_wrong_rule_fails_the_audit(collected, pair, joint, fault, samples):
    a = against_exact(collected(fault, samples), joint, pair.target.tokenizer.decode, PASS_LEVEL)
    assert not a.passed and a.p_value < FAIL_LEVEL, [(t.depth, t.fit) for t in a.tests]
    # the first token comes from the prefill, before any speculation: it is right under every rule
    assert a.tests[0].fit.p_value > PASS_LEVEL
    if fault is Fault.RAW_P:   # p without top-k: tokens outside the top 8 come back
        assert a.outside > 0


def test_the_two_sample_test_passes_two_halves_of_one_server_and_fails_a_wrong_one(collected, pair):
    right, label = collected(None, 200), pair.target.tokenizer.decode
    same = against_reference(right[:100], right[100:], label)          # requests seeded apart: independent
    assert same.passed and (same.n, same.reference_n) == (100, 100), [(t.depth, t.fit) for t in same.tests]
    wrong = against_reference(collected(Fault.ARGMAX, 150), right, label)
    assert not wrong.passed and wrong.p_value < FAIL_LEVEL, [(t.depth, t.fit) for t in wrong.tests]


def test_seeds_repeat_a_collection_and_the_ith_of_n_is_seed_plus_i(servers, prompt_ids):
    endpoint = Endpoint.of(servers(None).url)
    batch = sample(endpoint, "builtin", prompt_ids, M, PARAMS, 4, seed=7)
    single = [sample(endpoint, "builtin", prompt_ids, M, PARAMS, 1, seed=7 + i)[0] for i in range(4)]
    assert [c.ids for c in batch] == [c.ids for c in single]
    assert all(c.ids is not None and len(c.ids) <= M for c in batch)


def test_a_stopped_collection_ends_between_requests(servers, prompt_ids):
    stop = Stop()
    seen = []

    def progress(name, done, total):
        seen.append(done)
        stop.set()
    plan = AuditPlan(M, 400, PARAMS, per_request=50, concurrency=1)
    got = collect(Endpoint.of(servers(None).url), "builtin", prompt_ids, plan, progress=progress, stop=stop)
    assert got.cut_short == "stopped" and len(got.completions) == 50 and seen == [50]


# -- what the server refuses, what the client refuses ------------------------------------------------------------
@pytest.mark.parametrize("body, message", [
    ({"prompt": [1, 2], "n": 0}, "n must be an integer from 1"),
    ({"prompt": [1, 2], "stream": True}, "streaming is not served"),
    ({"prompt": [1, 2], "model": "gpt-9"}, "serves 'builtin', not 'gpt-9'"),
    ({"prompt": [10**9]}, "list of ids in"),
    ({"prompt": [1, 2], "temperature": -1}, "Temperature must be finite and >= 0"),
    ({"prompt": 5}, "prompt must be a string or a list of token ids"),
])
def test_the_server_answers_bad_requests_with_a_sentence(servers, body, message):
    with pytest.raises(AuditError, match=message) as caught:
        from engine.audit.client import post
        post(servers(None).url + "/v1/completions", body)
    assert "HTTP 400" in str(caught.value)


def test_the_client_names_malformed_and_truncated_replies():
    with pytest.raises(AuditError, match="sent 1 choices for n=2"):
        parse_choices({"choices": [{"text": "a"}]}, 2, 3, "u")
    with pytest.raises(AuditError, match="at most 3 ids"):
        parse_choices({"choices": [{"text": "a", "token_ids": [1, 2, 3, 4]}]}, 1, 3, "u")
    with pytest.raises(AuditError, match="without text"):
        parse_choices({"choices": [{"token_ids": [1]}]}, 1, 3, "u")
    with pytest.raises(AuditError, match="answered an error"):
        parse_choices({"error": {"message": "boom"}}, 1, 3, "u")
    assert parse_choices({"choices": [{"index": 1, "text": "b"}, {"index": 0, "text": "a", "token_ids": [5]}]},
                         2, 3, "u")[0].ids == (5,)


class Canned(http.server.BaseHTTPRequestHandler):
    reply = b""

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.end_headers()
        self.wfile.write(self.reply)

    do_GET = do_POST

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("reply, message", [(b"<html>hello</html>", "did not answer JSON"),
                                            (b'{"choices": [{"text": "a"', "did not answer JSON"),
                                            (b"[1, 2]", "where a JSON object was expected")])
def test_a_reply_that_is_not_an_answer_gets_a_sentence(reply, message):
    handler = type("H", (Canned,), {"reply": reply})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(AuditError, match=message):
            sample(Endpoint.of(f"http://127.0.0.1:{server.server_address[1]}", "m"), "m", [1], 2, PARAMS, 1, 0)
    finally:
        server.shutdown()
        server.server_close()


def test_only_loopback_is_audited_unless_allowed():
    with pytest.raises(AuditError, match="only loopback addresses are audited.*--allow-host 10.1.2.3"):
        Endpoint.of("http://10.1.2.3:8000")
    assert Endpoint.of("http://10.1.2.3:8000/v1/completions", allowed=("10.1.2.3",)).base == "http://10.1.2.3:8000"


def test_the_command_prints_a_verdict_and_one_line_errors(servers, capsys):
    url = servers(Fault.ARGMAX).url
    rc = cli.audit_main([url, "--model", "builtin", "--samples", "50", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1 and out["passed"] is False and out["n"] == 50 and math.isfinite(out["power"]["cohens_w"])
    assert cli.audit_main([url, "--model", "builtin", "--samples", "50"]) == 1
    text = capsys.readouterr().out
    assert "NOT lossless" in text and "tokens 1..3: chi-square" in text and "differs most" in text
    assert cli.audit_main([url, "--model", "builtin", "--samples", "10"]) == 2
    assert "samples must be from 50" in capsys.readouterr().err
    assert cli.audit_main([url, "--samples", "100"]) == 2
    assert "give --model" in capsys.readouterr().err


def test_against_exact_counts_impossible_outcomes_as_such(joint):
    likeliest = max(joint.levels[-1], key=joint.levels[-1].get)
    impossible = (10**6, 1, 2)
    keys = [likeliest] * 60 + [impossible] * 3
    a = against_exact(keys, joint, str)
    assert a.outside == 3 and a.p_value == 0.0 and not a.passed
    assert a.most_different(1)[0].label == str(impossible)
    assert Counter(c.label for c in a.cells)[str(likeliest)] == 1


# -- the Live engine page's audit ---------------------------------------------------------------------------------
def test_the_page_audits_a_server_and_draws_its_counts(handlers, servers):
    from types import SimpleNamespace

    import gradio as gr

    visitor = SimpleNamespace(session_hash="v1")
    verdict, figure = handlers.audit(servers(Fault.ARGMAX).url, "builtin", "", PROMPT, 1.0, 8, 1.0, 3, 60, visitor,
                                     gr.Progress())
    assert verdict.startswith("**Not lossless**") and "| 1..3 |" in verdict and "60 completions" in verdict
    observed, expected = figure.data[1], figure.data[0]
    assert sum(observed.y) <= 60 and max(observed.y) > 2 * max(expected.y[list(observed.y).index(max(observed.y))],
                                                                   1)
    assert "fails" in figure.layout.title.text and handlers._audits == {}
    verdict, figure = handlers.audit("http://203.0.113.9:8000", "builtin", "", PROMPT, 1.0, 8, 1.0, 3, 100, visitor,
                                     gr.Progress())
    assert "could not run" in verdict and "203.0.113.9 is not allowed" in verdict and figure is not None
    verdict, _ = handlers.audit(servers(None).url, "reference", servers(None).url, PROMPT, 1.0, 8, 1.0, 2, 50,
                                visitor, gr.Progress())
    assert verdict.startswith("**Consistent with lossless sampling**") and "from the reference" in verdict


def test_a_fault_applies_to_sampled_chains_only(pair, prompt_ids):
    from engine.config import Mode, TreeSpec
    from engine.speculative import SpeculativeEngine

    for config in (SpecConfig(drafter=DrafterKind.NGRAM, k=3),                                   # greedy
                   SpecConfig(mode=Mode.TARGET, sampling=PARAMS),
                   SpecConfig(drafter=DrafterKind.MODEL, sampling=PARAMS, tree=TreeSpec(widths=(2, 1)))):
        with pytest.raises(ValueError, match="sampled .T > 0. chain"):
            SpeculativeEngine(pair, prompt_ids, config, fault=Fault.ARGMAX)

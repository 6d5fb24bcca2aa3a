"""engine.watch on a real vLLM /metrics body (tests/data; its README says how it was captured): its parser, the
figures over an interval, restarts, several models, every failure's sentence, and the terminal command against a
local server."""
from __future__ import annotations

import http.server
import re
import threading
from pathlib import Path

import pytest

from engine import watch
from engine.watch import WatchError, counters, interval, parse_prometheus

# vLLM 0.32.0 (CPU build) serving SmolLM2-135M-Instruct with n-gram speculation, K = 4, after five greedy
# completions; its speculative counters: 37 drafts, 148 draft tokens, 28 accepted, per position 17, 6, 3, 2
FIXTURE = Path(__file__).resolve().parent / "data" / "vllm-0.32.0-cpu-metrics-ngram.txt"


def body() -> str:
    return FIXTURE.read_text()


def scaled(text: str, factor: float, model: str = "smollm2") -> str:
    """The fixture with every speculative and generation counter of `model` multiplied by `factor`."""
    def scale(m: re.Match) -> str:
        return f"{m.group(1)} {float(m.group(2)) * factor}"
    names = r"(?:vllm:spec_decode_num_\w+_total|vllm:generation_tokens_total)"
    pattern = rf'^({names}\{{[^}}]*model_name="{model}"[^}}]*\}}) (\S+)$'
    return re.sub(pattern, scale, text, flags=re.M)


def test_the_real_body_parses_into_one_models_counters():
    [(model, c)] = counters(parse_prometheus(body()), at=10.0).items()
    # the capture's counters, as its vllm:spec_decode_* and vllm:generation_tokens lines give them
    assert model == "smollm2" and (c.drafts, c.draft_tokens, c.accepted) == (37.0, 148.0, 28.0)
    assert c.per_position == (17.0, 6.0, 3.0, 2.0) and c.generated == 193.0


def test_an_interval_gives_the_figures_from_the_counters_increases():
    before = counters(parse_prometheus(scaled(body(), 0.5)), at=10.0)["smollm2"]
    after = counters(parse_prometheus(body()), at=14.0)["smollm2"]
    iv = interval(before, after)
    # half the capture's counters to all of them: Δdrafts 18.5, Δdraft tokens 74, Δaccepted 14,
    # Δper position 8.5, 3, 1.5, 1, Δgenerated 96.5
    assert (iv.drafts, iv.seconds, iv.restarted) == (18.5, 4.0, False)
    assert iv.acceptance_rate == pytest.approx(14 / 74)                 # Δaccepted / Δdraft tokens
    assert iv.mean_acceptance_length == pytest.approx(1 + 14 / 18.5)    # 1 + Δaccepted / Δdrafts
    assert iv.position_rates == pytest.approx((8.5 / 18.5, 3 / 18.5, 1.5 / 18.5, 1 / 18.5))  # Δper position / Δdrafts
    assert (iv.drafted_per_s, iv.accepted_per_s) == (pytest.approx(74 / 4), pytest.approx(14 / 4))
    assert iv.generated_per_s == pytest.approx(96.5 / 4)
    # vLLM's rate at i counts every draft; conditioned on reaching i it is Δper position i / Δper position i-1
    assert iv.conditional_rates == pytest.approx((8.5 / 18.5, 3 / 8.5, 1.5 / 3, 1 / 1.5))
    assert iv.predicted_speedup(0.1, 1.2) == pytest.approx(iv.mean_acceptance_length / (0.1 * 4 + 1.2))
    assert iv.predicted_speedup(0.1, 1.1, k=2) == pytest.approx((1 + 8.5 / 18.5 + 3 / 18.5) / (0.1 * 2 + 1.1))


def test_a_restarted_server_counts_from_zero_and_says_so():
    before = counters(parse_prometheus(body()), at=0.0)["smollm2"]
    after = counters(parse_prometheus(scaled(body(), 0.25)), at=5.0)["smollm2"]   # lower: a restart
    iv = interval(before, after)
    assert iv.restarted and iv.drafts == 9.25 and iv.acceptance_rate == pytest.approx(7 / 37)   # a quarter of 28 / 148
    assert "restarted" in watch.line(iv, None, None)


def test_several_models_on_one_server_are_kept_apart():
    other = "\n".join(line.replace('model_name="smollm2"', 'model_name="other"')
                      for line in body().splitlines() if 'model_name="smollm2"' in line)
    readings = counters(parse_prometheus(body() + "\n" + scaled(other, 2.0, "other")), at=1.0)
    assert set(readings) == {"smollm2", "other"}
    assert readings["other"].drafts == 2 * readings["smollm2"].drafts


# llama.cpp build 11434's llama-server serving the same weights (F32) with ngram-simple, n=2, m=4, after five greedy
# completions: 35 drafts (verify steps), 118 draft tokens, 26 accepted, per position 17, 5, 2, 2; 193 predicted
LLAMACPP = Path(__file__).resolve().parent / "data" / "llamacpp-b11434-cpu-metrics-ngram.txt"


def test_a_real_llamacpp_body_reads_as_one_unlabelled_model():
    [(model, c)] = counters(parse_prometheus(LLAMACPP.read_text()), at=3.0).items()
    assert model == "llama.cpp" and (c.drafts, c.draft_tokens, c.accepted) == (35.0, 118.0, 26.0)
    assert c.per_position == (17.0, 5.0, 2.0, 2.0) and c.generated == 193.0


def test_a_llamacpp_interval_reads_like_vllms():
    def halved(m: re.Match) -> str:
        return f"{m.group(1)} {float(m.group(2)) / 2}"
    text = LLAMACPP.read_text()
    half = re.sub(r"^(llamacpp:(?:spec_decode_num_\w+_total(?:\{[^}]*\})?|tokens_predicted_total)) (\S+)$", halved,
                  text, flags=re.M)
    iv = interval(counters(parse_prometheus(half), at=0.0)["llama.cpp"],
                  counters(parse_prometheus(text), at=2.0)["llama.cpp"])
    # half the capture's counters to all of them: Δdrafts 17.5, Δdraft tokens 59, Δaccepted 13, Δgenerated 96.5
    assert not iv.restarted and iv.acceptance_rate == pytest.approx(13 / 59)
    assert iv.mean_acceptance_length == pytest.approx(1 + 13 / 17.5)
    assert iv.position_rates == pytest.approx((8.5 / 17.5, 2.5 / 17.5, 1 / 17.5, 1 / 17.5))
    assert iv.generated_per_s == pytest.approx(96.5 / 2)


@pytest.mark.parametrize("text, words", [
    ("<!doctype html><html><body>Hello</body></html>", "not Prometheus metrics text"),
    ('{"detail": "Not Found"}', "not Prometheus metrics text"),
    ("\n".join(line for line in FIXTURE.read_text().splitlines() if "spec_decode" not in line), "speculation is off"),
])
def test_what_is_not_speculative_metrics_gets_its_own_sentence(text, words):
    with pytest.raises(WatchError, match=words):
        counters(parse_prometheus(text), at=0.0)


class Serving:
    """A local HTTP server on 127.0.0.1 answering GET with `text` (what a /metrics route would send); set
    `text` to change what the next GET gets."""

    def __init__(self, text: str) -> None:
        self.text = text
        serving = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                self.wfile.write(serving.text.encode())

            def log_message(self, *args):
                pass
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_fetching_is_bounded_and_each_failure_says_what_happened(capsys, monkeypatch):
    from playground.loadtest import HungEndpoint, free_port

    monkeypatch.setattr(watch, "FETCH_TIMEOUT_S", 0.5)   # the command's own bound, as the hung endpoint meets it

    served = Serving(body())
    hung = HungEndpoint()
    try:
        assert watch.read(served.url)["smollm2"].drafts == 37.0
        with pytest.raises(WatchError, match="more than 0 MiB"):
            watch.fetch(served.url, max_bytes=1000)
        with pytest.raises(WatchError, match="did not answer within 0.5 s"):
            watch.fetch(f"http://127.0.0.1:{hung.port}/metrics", timeout=0.5)
        with pytest.raises(WatchError, match="connection refused"):
            watch.fetch(f"http://127.0.0.1:{free_port('127.0.0.1')}/metrics")
        with pytest.raises(WatchError, match=r"example.org is not allowed.*--allow-host example.org"):
            watch.fetch("http://example.org/metrics")
        with pytest.raises(WatchError, match="not an http"):
            watch.fetch("file:///etc/passwd")
        assert watch.main([served.url, "--interval", "0.2", "--count", "1", "--c", "0.05", "--r", "1.1"]) == 0
        out = capsys.readouterr().out
        assert out.startswith("smollm2: 0 drafts") and "predicted speed-up" in out   # nothing decoded meanwhile
        assert watch.main([f"http://127.0.0.1:{hung.port}/metrics", "--count", "1"]) == 2
        assert "did not answer within 0.5 s" in capsys.readouterr().err
    finally:
        served.close()
        hung.close()

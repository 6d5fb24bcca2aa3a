"""The Live engine page: a visitor's watch of a real /metrics body served on loopback (tests/data), its
figures against the counters' own increases, restarts, the allow-list, the page's handlers headless, the
switch that keeps it off on a Space, and specplay's run of the same K beside it."""
from __future__ import annotations

import json
from types import SimpleNamespace

import gradio as gr
import pytest

from engine import metrics
from engine.watch import Watcher, WatchError
from playground.pages import live as page_live
from playground.render import live as render_live
from playground.settings import AppSettings, live_engine_default
from tests.test_watch import Serving, body, scaled


@pytest.fixture()
def served():
    s = Serving(scaled(body(), 0.5))
    yield s
    s.close()


def test_a_watch_keeps_each_interval_and_the_whole_watch(served):
    w = Watcher(served.url)
    assert w.poll(at=0.0) == {} and w.total("smollm2") is None    # one reading: no interval yet
    served.text = scaled(body(), 0.75)
    first = w.poll(at=2.0)["smollm2"]
    served.text = body()
    second = w.poll(at=4.0)["smollm2"]
    # each interval is a quarter of the capture's counters (37 drafts, 148 draft tokens, 28 accepted)
    assert first.drafts == second.drafts == 9.25 and first.acceptance_rate == pytest.approx(7 / 37)
    assert [p.t for p in w.points["smollm2"]] == [2.0, 4.0]
    total = w.total("smollm2")
    # the whole watch: half the capture's counters, Δdrafts 18.5 and Δper position 8.5, 3, 1.5, 1
    assert total.drafts == 18.5 and total.seconds == 4.0
    assert total.position_rates == pytest.approx((8.5 / 18.5, 3 / 18.5, 1.5 / 18.5, 1 / 18.5))
    served.text = scaled(body(), 0.25)                      # the counters went down: a restart
    assert w.poll(at=6.0)["smollm2"].restarted and w.restarts == {"smollm2": 1}
    assert w.total("smollm2").drafts == 9.25                  # the whole watch counts from the restart


def test_a_watch_keeps_only_its_last_points_and_refuses_other_hosts(served):
    w = Watcher(served.url, keep=2)
    for t in range(5):
        served.text = scaled(body(), 1 + t)
        w.poll(at=float(t))
    assert [p.t for p in w.points["smollm2"]] == [3.0, 4.0]
    with pytest.raises(WatchError, match="not allowed"):
        Watcher("http://10.1.2.3:8000/metrics")
    assert Watcher("http://10.1.2.3:8000/metrics", allowed=("10.1.2.3",)).url.startswith("http://10.1.2.3")


def test_the_page_is_off_on_a_space_unless_its_operator_turns_it_on():
    assert live_engine_default({}) and not live_engine_default({"SPACE_ID": "me/specplay"})
    assert live_engine_default({"SPACE_ID": "me/specplay", "SPECPLAY_LIVE_ENGINE": "1"})
    assert not live_engine_default({"SPECPLAY_LIVE_ENGINE": "off"})
    with pytest.raises(ValueError, match="SPECPLAY_LIVE_ENGINE"):
        live_engine_default({"SPECPLAY_LIVE_ENGINE": "maybe"})
    from app import parse_args
    assert not parse_args([], {"SPACE_ID": "me/specplay"}).live_engine
    assert parse_args(["--live-engine", "--watch-host", "gpu-box"], {"SPACE_ID": "x"}).watch_hosts == ("gpu-box",)
    ctx = SimpleNamespace(settings=AppSettings(live_engine=False))
    with gr.Blocks():
        assert page_live.build(ctx) is None


def test_before_a_watch_each_chart_says_what_it_will_show(handlers):
    with gr.Blocks():
        page = page_live.build(handlers.ctx)
    figures = [page.acceptance, page.per_position, page.throughput, page.prediction]
    texts = [plot.value and json.loads(plot.value["plot"])["layout"]["annotations"][0]["text"] for plot in figures]
    assert all(t and t.endswith("press Watch.") for t in texts) and len(set(texts)) == 4, texts


def test_the_pages_figures_are_the_counters_own(handlers, served):
    live, timer, summary, model, *figures = handlers.start(None, served.url, 1.0, None, 0.1, 1.2)
    assert timer.active and live.watcher is not None and "waiting for a second reading" in summary
    served.text = body()
    live, _, summary, model, acceptance, per_position, throughput, prediction = handlers.tick(live, None, 0.1, 1.2)
    total = live.watcher.total("smollm2")
    assert model.value == "smollm2" and f"acceptance rate {total.acceptance_rate:.3f}" in summary
    assert list(per_position.data[0].y) == pytest.approx(list(total.position_rates))
    assert acceptance.data[0].y[-1] == pytest.approx(total.acceptance_rate)      # one interval: the same figures
    assert throughput.data[0].y[-1] == pytest.approx(total.generated_per_s, rel=1e-3)
    k = len(total.position_rates)
    expected = metrics.expected_tokens_from_rates(list(total.conditional_rates), k) / (0.1 * k + 1.2)
    assert prediction.data[1].x[0] == k and prediction.data[1].y[0] == pytest.approx(expected)
    served.close()                                                   # the server goes away: keep watching, say so
    live, timer, summary, *_ = handlers.tick(live, None, 0.1, 1.2)
    assert "last reading failed" in summary and "connection refused" in summary and live.watcher is not None


def test_the_page_watches_a_llamacpp_server_as_it_watches_vllm(handlers):
    from tests.test_watch import LLAMACPP

    text = LLAMACPP.read_text()
    halved = "\n".join(f"{line.rsplit(' ', 1)[0]} {float(line.rsplit(' ', 1)[1]) / 2}"
                        if line.startswith("llamacpp:") else line for line in text.splitlines())
    served = Serving(halved)
    try:
        live, *_ = handlers.start(None, served.url, 1.0, None, 0.05, 1.1)
        served.text = text
        live, _, summary, model, acceptance, per_position, *_ = handlers.tick(live, None, 0.05, 1.1)
    finally:
        served.close()
    # the capture's counters from half to all: 17.5 verify steps, 59 drafted, 13 accepted, per position 8.5, 2.5, 1, 1
    assert model.value == "llama.cpp" and "acceptance rate 0.220" in summary    # 13 / 59
    assert list(per_position.data[0].y) == pytest.approx([8.5 / 17.5, 2.5 / 17.5, 1 / 17.5, 1 / 17.5])


def test_a_refused_address_gets_its_sentence_and_no_timer(handlers):
    live, timer, summary, *_ = handlers.start(None, "http://203.0.113.9:8000/metrics", 1.0, None, None, None)
    assert not timer.active and "203.0.113.9 is not allowed" in summary and live.watcher is None
    live, timer, summary, *_ = handlers.start(None, "http://127.0.0.1:8000/metrics", 0.1, None, None, None)
    assert "interval" in summary and not timer.active


def test_specplay_runs_beside_with_the_servers_k(handlers, served):
    live, *_ = handlers.start(None, served.url, 1.0, None, None, None)
    served.text = body()
    live, *_ = handlers.tick(live, None, None, None)
    live, c, r, summary, _, _, per_position, _, prediction = handlers.run_beside(
        live, "def fibonacci(n):\n", "model", None, None, None)
    side = live.side
    assert side.k == 4 and len(side.rates) == 4 and all(0 <= a <= 1 for a in side.rates)
    assert list(side.rates) == sorted(side.rates, reverse=True)      # accepted at i implies accepted before i
    assert float(c) == pytest.approx(side.c, abs=1e-4) and float(r) == pytest.approx(side.r, abs=1e-3)
    assert 0 < side.c < 1
    assert [t.name for t in per_position.data] == ["smollm2 (watched)", side.label]
    assert "measured here" in summary and prediction.data   # c and r filled in: the prediction is drawn
    assert render_live.summary_markdown(None, None, None).startswith("Not watching")


def test_c_and_r_boxes_read_empty_until_measured_and_a_word_is_no_number(handlers, served):
    """The boxes start empty (a number box would show 0, read as a measured c); what is typed is read as a number
    or, where it is none, the prediction asks for one instead of failing."""
    from playground.inputs import as_optional_number

    assert [as_optional_number(v) for v in ("", "  ", None, "abc", "inf", "nan", " 0.05 ", "1.2", 0.3)] == \
        [None, None, None, None, None, None, 0.05, 1.2, 0.3]
    live, *_ = handlers.start(None, served.url, 1.0, None, "", "")
    served.text = body()
    for c, r in (("", ""), ("abc", "1.1"), ("0.05", "")):
        *_, prediction = handlers.tick(live, None, c, r)
        assert "Enter c" in prediction.layout.annotations[0].text, (c, r)
    *_, prediction = handlers.tick(live, None, "0.05", "1.1")
    assert prediction.data and "c = 0.05, r = 1.1" in prediction.layout.title.text

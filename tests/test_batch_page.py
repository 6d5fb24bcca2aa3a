"""The Batch tab: a study measured through the page's own handler on the built-in pair, the lesson's
sentences read from that study, the shipped studies, and what the page says to bad input."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from engine.bench.batch import BatchStudy, read_study
from playground.pages import batch as page
from playground.teach.batch import batch_lesson


@pytest.fixture(scope="module")
def registry(builtin_pair):
    from playground.registry import ModelRegistry

    draft, target = builtin_pair
    registry = ModelRegistry(loader=lambda source, role, device: draft if role == "draft" else target)
    yield registry
    registry.close()


@pytest.fixture(scope="module")
def handlers(registry):
    from playground.settings import AppSettings

    return page.BatchHandlers(SimpleNamespace(settings=AppSettings(), registry=registry), page.shipped_studies())


@pytest.fixture(scope="module")
def measured(handlers, registry) -> tuple[BatchStudy, tuple]:
    key = registry.choices()[0][1]
    seen = []
    out = handlers.measure(key, ["1", "2"], 8, None, progress=lambda *a, **k: seen.append(a))
    assert seen   # the progress bar moved
    return out[0], out


def test_a_study_measured_on_the_page_is_shown_with_its_lesson(measured):
    study, (state, picker, goodput, lesson, costs, summary) = measured
    assert isinstance(study, BatchStudy) and study.batches == [1, 2]
    assert picker.value == page.HERE
    assert [p.method for p in study.points if p.batch == 1] == ["target", "ngram K=3", "v2 K=2", "v2 K=4"]
    assert all(p.same_tokens for p in study.points)
    names = {t.name for t in goodput.data}
    assert {"target", "ngram K=3", "v2 K=2 predicted"} <= names
    assert [t.name for t in costs.data] == ["B = 1", "B = 2"]
    assert "predicted · measured" in summary and study.machine in summary


def test_every_number_in_the_lesson_is_the_studys(measured):
    study, _ = measured
    text = "\n".join(batch_lesson(study))
    one, two = study.point(1, "target"), study.point(2, "target")
    assert f"{one.tokens_per_s:.1f} tokens/s" in text and f"{two.tokens_per_s:.1f} tokens/s" in text
    assert f"{two.tokens_per_s / one.tokens_per_s:.2f}×" in text
    best = study.best_speculative(1)
    assert f"the best method, {best.method}, ran {best.speedup:.2f}×" in text
    for method in study.methods()[1:]:
        assert f"**{method}**" in text
    for b in study.best_k:
        assert f"B = {b.batch}: K = {b.measured_k}" in text


def test_the_page_refuses_bad_input_with_a_sentence(handlers, registry):
    key = registry.choices()[0][1]
    for sizes, tokens, words in ((["4"], 8, "two batch sizes"), ([], 8, "at least one"), (["1", "2"], 500, "8 to 64")):
        with pytest.warns(UserWarning, match=words):
            out = handlers.measure(key, sizes, tokens, None, progress=lambda *a, **k: None)
        assert out[0] is None


def test_a_stopped_study_keeps_nothing(handlers, registry, monkeypatch):
    key = registry.choices()[0][1]
    stopped = threading.Event()
    stopped.set()
    monkeypatch.setattr(page.threading, "Event", lambda: stopped)
    out = handlers.measure(key, ["1", "2"], 8, "previous", progress=lambda *a, **k: None)
    assert out[0] == "previous" and handlers._stop is None and not handlers._lock.locked()


def test_shipped_studies_are_listed_and_drawn(handlers, tmp_path):
    for label, path in page.shipped_studies().items():
        study = read_study(path)
        assert study.target in label
        goodput, lesson, costs, summary = handlers.show(label, None)
        assert len(goodput.data) >= 3 and lesson.startswith("**")
    (tmp_path / "batch-broken.json").write_text("{")
    assert page.shipped_studies(tmp_path) == {}
    goodput, lesson, _, _ = handlers.show("no such study", None)
    assert "Pick a measured study" in lesson

"""`python -m engine bench --batch`: the goodput study on the built-in pair, its report, JSON and figure, and
its refusals. Timings are printed, never asserted; what is checked is what the study computes from them."""
from __future__ import annotations

import json

import pytest

from engine.bench.batch import BatchStudy, format_study, read_study
from engine.bench.cli import main
from engine.bench.plot import batch_figure


@pytest.fixture(scope="module")
def study(tmp_path_factory) -> tuple[BatchStudy, str]:
    out = tmp_path_factory.mktemp("batch") / "study.json"
    status = main(["--quick", "--batch", "1,2,4", "--methods", "v2:2,ngram:2,ngram:3", "--num-prompts", "3",
                   "--new-tokens", "10", "--repeats", "1", "--warmup", "0", "--no-progress", "--json", str(out),
                   "--plot", str(out.with_suffix(".html"))])
    assert status == 0
    return read_study(out), out.with_suffix(".html").read_text()


def test_the_study_covers_every_method_at_every_batch_size(study):
    s, _ = study
    assert s.batches == [1, 2, 4]
    assert s.methods() == ["target", "v2 K=2", "ngram K=2", "ngram K=3"]
    for b in s.batches:
        base = s.point(b, "target")
        assert base.speedup == 1.0 and base.r == 1.0 and base.rows_per_sequence == 1.0 and base.predicted is None
        for method in s.methods()[1:]:
            p = s.point(b, method)
            assert p.speedup == pytest.approx(p.tokens_per_s / base.tokens_per_s)
            assert p.rows_per_sequence > 1.0 and p.rows_per_sequence <= p.k + 1   # K + 1 rows when drafting
            assert p.predicted is not None and p.predicted > 0
            assert 0.0 <= p.alpha <= 1.0
    # greedy: every sequence of every run emitted what its prompt emits alone, target-only
    assert all(p.same_tokens for p in s.points)
    assert set(s.single_tokens_per_s) == set(s.methods()) == set(s.b1_cost)
    assert all(0 < s.batched_over_single(m) == s.b1_cost[m] for m in s.methods())
    assert [c.batch for c in s.costs] == [1, 2, 4] and all(c.ns == list(range(1, 10)) for c in s.costs)
    # the best K per drafter and batch size, K among those measured for the measured one
    assert {(b.drafter, b.batch) for b in s.best_k} == {(d, b) for d in ("model", "ngram") for b in (1, 2, 4)}
    assert all(b.measured_k in ((2,) if b.drafter == "model" else (2, 3)) and 1 <= b.predicted_k <= 8
               for b in s.best_k)


def test_the_report_and_the_figure_say_what_the_study_holds(study):
    s, html = study
    text = format_study(s)
    assert "Goodput against batch size" in text and "stops paying" in text
    for b in s.batches:
        assert f"{s.point(b, 'ngram K=3').tokens_per_s:>8.1f}" in text
    assert "Best K per batch size" in text and "single-sequence engine" in text
    fig = batch_figure(s)
    spec = [t for t in fig.data if t.name == "ngram K=3"]
    assert list(spec[0].y) == [s.point(b, "ngram K=3").tokens_per_s for b in s.batches]
    assert "Goodput against batch size" in html


def test_crossover_is_the_first_batch_size_where_speculation_stops_paying(study):
    from dataclasses import replace

    s, _ = study
    for speedups, first in (({1: 1.3, 2: 1.1, 4: 1.05}, None), ({1: 1.3, 2: 0.9, 4: 1.05}, 2),
                            ({1: 1.3, 2: 1.1, 4: 0.7}, 4)):
        points = [replace(p, speedup=speedups[p.batch], predicted=speedups[p.batch] + 0.2)
                  if p.method == "ngram K=2" else p for p in s.points]
        study = replace(s, points=points)
        assert study.crossover("ngram K=2") == first
        assert study.crossover("ngram K=2", predicted=True) == (4 if first == 4 else None)


def test_a_study_file_is_read_back_checked(tmp_path, study):
    s, _ = study
    path = tmp_path / "bad.json"
    data = json.loads(json.dumps(__import__("dataclasses").asdict(s)))
    data["points"][0]["tokens_per_s"] = "fast"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="tokens_per_s"):
        read_study(path)


@pytest.mark.parametrize("argv, words", [
    (["--batch", "0,2"], "from 1 to 64"),
    (["--batch", "two"], "comma-separated integers"),
    (["--batch", "2", "--methods", "hf-assisted:2"], "constant K"),
    (["--batch", "2", "--methods", "tree-static:3"], "constant K"),
    (["--batch", "2", "--profile", "v2:2"], "do not go together"),
])
def test_bad_batch_arguments_get_one_line(argv, words, capsys):
    assert main([*argv, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err and "Traceback" not in err

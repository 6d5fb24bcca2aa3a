"""engine.bench.cache_bench: every forward and cache it compares decodes the same next token."""
from __future__ import annotations

import pytest

from engine.bench.cache_bench import bench_model, main


def test_bench_model_reports_every_path(builtin_pair):
    draft, _ = builtin_pair
    times = bench_model(draft, context=32, repeats=1)   # it checks that every path decodes the same token
    assert set(times) == {"fused forward, PagedCache", "transformers, DynamicCache", "transformers, PagedCache (view)",
                          "transformers, PagedCache (gather)"}


def test_a_path_that_computes_something_else_is_refused(builtin_pair, monkeypatch):
    draft, _ = builtin_pair
    real = draft.fused.forward
    monkeypatch.setattr(draft.fused, "forward", lambda cache, ids: real(cache, ids).roll(1, dims=-1))
    with pytest.raises(ValueError, match="different next tokens"):
        bench_model(draft, context=32, repeats=1)


def test_the_command_prints_one_line_per_path(capsys):
    assert main(["--draft", "none", "--repeats", "1", "--context", "16"]) == 0
    out = capsys.readouterr().out
    assert out.count(" ms") == 4 and "builtin:target" in out

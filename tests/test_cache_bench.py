"""engine.bench.cache_bench: every forward and cache it compares decodes the same next token."""
from __future__ import annotations

from engine.bench.cache_bench import bench_model, main


def test_bench_model_reports_every_path(builtin_pair):
    draft, _ = builtin_pair
    times = bench_model(draft, context=32, repeats=1)
    assert set(times) == {"fused forward, PagedCache", "transformers, DynamicCache", "transformers, PagedCache (view)",
                          "transformers, PagedCache (gather)"}
    assert all(ms > 0 for ms in times.values())


def test_the_command_prints_one_line_per_path(capsys):
    assert main(["--draft", "none", "--repeats", "1", "--context", "16"]) == 0
    out = capsys.readouterr().out
    assert out.count(" ms") == 4 and "builtin:target" in out

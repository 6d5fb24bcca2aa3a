"""`python -m engine generate`, run in-process on the built-in pair."""
from __future__ import annotations

import json

import pytest

from engine import cli
from engine.trace import load_trace

PROMPT = "def is_even(n):\n    return n % 2 == 0\n\n\ndef is_odd(n):\n"
NEW = 8


@pytest.fixture(scope="module", autouse=True)
def builtin_present(builtin_pair) -> None:
    """The CLI loads the built-in pair itself; the fixture makes a missing pair fail loudly here once."""


def run_json(capsys, *extra: str) -> dict:
    rc = cli.main(["--prompt", PROMPT, "--max-new-tokens", str(NEW), "--json", *extra])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out)


def test_json_output_greedy(capsys, builtin_pair) -> None:
    result = run_json(capsys, "--k", "3")
    tokenizer = builtin_pair[1].tokenizer
    assert set(result) == {"text", "token_ids", "prompt_ids", "metrics", "baseline_metrics", "speedup",
                           "identical_to_baseline", "eagle"}
    assert result["eagle"] is None                     # the draft model drafted
    ids = result["token_ids"]
    assert 0 < len(ids) <= NEW and result["text"] == tokenizer.decode(ids)
    assert result["prompt_ids"] == tokenizer(PROMPT)["input_ids"]
    m, b = result["metrics"], result["baseline_metrics"]
    assert (m["mode"], m["drafter"], m["tokens"]) == ("v2", "model", len(ids))
    assert (b["mode"], b["drafter"], b["tokens"]) == ("target", None, len(ids))
    assert m["drafted"] >= m["verified"] >= m["accepted"] >= 0
    assert m["draft_acceptance_rate"] == pytest.approx(m["accepted"] / m["drafted"])
    assert m["alpha"] == pytest.approx(m["accepted"] / m["verified"])
    assert result["identical_to_baseline"] is True
    assert result["speedup"] == pytest.approx(m["tokens_per_s"] / b["tokens_per_s"])


def test_no_compare_ngram(capsys) -> None:
    result = run_json(capsys, "--drafter", "ngram", "--mode", "v1", "--no-compare")
    assert result["metrics"]["drafter"] == "ngram" and result["metrics"]["mode"] == "v1"
    assert result["baseline_metrics"] is None and result["identical_to_baseline"] is None and result["speedup"] is None


def test_trace_file_is_loadable(capsys, tmp_path) -> None:
    path = tmp_path / "out.jsonl"
    result = run_json(capsys, "--trace", str(path), "--k", "2", "--seed", "5")
    t = load_trace(path)
    assert t.complete and t.header.prompt == PROMPT and t.header.seed == 5 and t.header.config["k"] == 2
    assert (t.header.target, t.header.draft) == ("builtin:target", "builtin:draft")
    assert len(t.rounds) == result["metrics"]["rounds"]
    assert [tok for r in t.rounds for tok in r.emitted] == result["token_ids"]


def test_an_eagle_run_names_its_head_and_a_target_drafts_with_its_eagle3_head_where_one_ships(capsys) -> None:
    from engine.sources import default_head, eagle_folder

    assert default_head("builtin") == "builtin" and not eagle_folder("builtin-eagle3").exists()
    assert eagle_folder("smollm2-eagle3").is_dir() and default_head("smollm2") == "smollm2-eagle3"
    result = run_json(capsys, "--drafter", "eagle", "--no-compare")
    assert result["eagle"] == "eagle:builtin" and result["metrics"]["drafter"] == "eagle"
    assert cli.main(["--prompt", PROMPT, "--max-new-tokens", str(NEW), "--drafter", "eagle", "--no-compare"]) == 0
    assert "--- v2 / eagle (head builtin):" in capsys.readouterr().out


def test_text_output(capsys) -> None:
    rc = cli.main(["--prompt", PROMPT, "--max-new-tokens", str(NEW)])
    out, _ = capsys.readouterr()
    assert rc == 0
    assert "acceptance" in out and "mean accepted length" in out and "tokens/s" in out
    assert "speed-up" in out and "identical to baseline: yes" in out


def test_help_explains_every_flag(capsys) -> None:
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    flags = [a.option_strings[-1] for a in cli.build_parser()._actions]
    assert len(flags) > 20 and all(f in out for f in flags)
    assert all(a.help for a in cli.build_parser()._actions)


@pytest.mark.parametrize("argv, message", [
    (["--prompt", ""], "prompt is empty"),
    (["--prompt", "   "], "prompt is empty"),
    (["--prompt", "x", "--k", "0"], "K must be an integer between 1 and 32"),
    (["--prompt", "x", "--k", "33"], "K must be an integer between 1 and 32"),
    (["--prompt", "x", "--k", "four"], "invalid int value"),
    (["--prompt", "x", "--temperature", "-1"], "Temperature must be finite and >= 0"),
    (["--prompt", "x", "--top-p", "1.5"], "Top-p must be in"),
    (["--prompt", "x", "--top-k", "-3"], "Top-k must be >= 0"),
    (["--prompt", "x", "--max-new-tokens", "0"], "max_new_tokens must be a positive integer"),
    (["--prompt", "x", "--mode", "v3"], "invalid choice"),
    (["--prompt", "x", "--target", "/no/such/model"], "Could not load target model '/no/such/model'"),
    (["--prompt", "x", "--draft", "specplay-tests/no-such-draft"], "Could not load draft model"),
    (["--prompt", "x", "--target-device", "cuda:7"], "cuda:7 is not available"),
    (["--prompt", "x", "--draft-device", "warp-drive"], "unknown device"),
    (["--prompt", "a = 1\n" * 400], "exceed the target's context"),
    (["--prompt", "x", "--kv-blocks", "0"], "--kv-blocks must be >= 1"),
    (["--prompt", "x", "--trace", "/no/such/dir/t.jsonl"], "cannot write /no/such/dir/t.jsonl"),
    (["--prompt", "x", "--bogus"], "unrecognized arguments: --bogus"),
    (["--prompt", "x", "--seed", str(2**70)],
     "argument --seed: Seed must be a whole number from 0 to 9223372036854775807, got 1180591620717411303424."),
    (["--prompt", "x", "--seed", "abc"],
     "argument --seed: Seed must be a whole number from 0 to 9223372036854775807, got 'abc'."),
    (["--prompt", "x", "--temperature", "nan"], "Temperature must be finite and >= 0 (0 = greedy), got nan"),
    (["--prompt", "x", "--top-p", "inf"], "Top-p must be in (0, 1] (1 = off), got inf"),
    (["--prompt", "def f():\ud800\n"], "The prompt contains '\\ud800' at character 9, which is not valid Unicode text"),
    ([], "the following arguments are required: --prompt"),
])
def test_bad_input_exits_2_with_one_error_line(capsys, monkeypatch, argv: list[str], message: str) -> None:
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: ") and err.count("\n") == 1
    assert message in err and "Traceback" not in err


def test_kv_pool_exhaustion_is_a_clean_error(capsys) -> None:
    assert cli.main(["--prompt", PROMPT * 3, "--kv-blocks", "1", "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: KV pool exhausted") and err.count("\n") == 1

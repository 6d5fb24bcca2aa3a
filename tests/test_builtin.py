"""The built-in pair: loads with plain transformers, shares one exact tokenizer, stays small, learns."""
from __future__ import annotations

import json
import shutil

import pytest

from engine.models import ModelLoadError, load_model
from engine.sources import BUILTIN, BUILTIN_DIR
from engine.sources import BUILTIN_REBUILD as REBUILD_COMMAND
from engine.train import corpus

# Held-out loss (nats/token) the built-in target must stay under, on 16 windows of the stdlib's
# test folders. A model that learned nothing sits near ln(4096) = 8.3; the shipped target measures
# about 3.9 (see assets/builtin/MODEL_CARD.md).
HELDOUT_LOSS_CEILING = 4.5


def test_pair_loads_with_plain_transformers():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for role in ("draft", "target"):
        path = BUILTIN_DIR / role
        model = AutoModelForCausalLM.from_pretrained(path)
        tok = AutoTokenizer.from_pretrained(path)
        assert type(model).__name__ == "LlamaForCausalLM"
        assert model.config.vocab_size == len(tok) == 4096
        out = model.generate(**tok("import os\n", return_tensors="pt"), max_new_tokens=3, do_sample=False)
        assert out.shape[1] > 3


def test_models_share_one_tokenizer():
    a = (BUILTIN_DIR / "draft" / "tokenizer.json").read_bytes()
    b = (BUILTIN_DIR / "target" / "tokenizer.json").read_bytes()
    assert a == b


def test_weights_stay_under_60_mb():
    total = sum(f.stat().st_size for f in BUILTIN_DIR.glob("*/*.safetensors"))
    assert 1e6 < total <= 60e6


@pytest.mark.parametrize("name", ["json/decoder.py", "textwrap.py", "unicodedata_test", "tabs_and_crlf"])
def test_tokenizer_round_trips_source_exactly(builtin_tokenizer, name):
    if name == "unicodedata_test":
        text = "# ünïcødé → λ, 中文, emoji 🐍\ns = 'naïve café'\n"
    elif name == "tabs_and_crlf":
        text = "def f():\r\n\tif x:\r\n\t\treturn  '  '\r\n\n\n   \n"
    else:
        text = (corpus.stdlib_root() / name).read_text(encoding="utf-8")
    ids = builtin_tokenizer(text)["input_ids"]
    assert ids[0] == builtin_tokenizer.eos_token_id  # prompts start like files do in training
    assert builtin_tokenizer.decode(ids, skip_special_tokens=True) == text


def test_heldout_loss_below_ceiling(builtin_pair):
    from engine.train.builtin import heldout_loss
    from engine.train.builtin_eval import heldout_windows

    _, target = builtin_pair
    loss = heldout_loss(target.model, heldout_windows(16, 257, seed=7))
    assert loss < HELDOUT_LOSS_CEILING


def test_target_writes_python(builtin_pair):
    _, target = builtin_pair
    tok = target.tokenizer
    ids = tok("import os\n\n\ndef ", return_tensors="pt")["input_ids"]
    out = target.model.generate(ids, max_new_tokens=40, do_sample=False, pad_token_id=tok.eos_token_id)
    text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "(" in text and ":" in text  # a def line: name, arguments, colon


def test_card_figures_exist_and_meet_the_cost_bound():
    card = json.loads((BUILTIN_DIR / "card.json").read_text())
    assert card["c"] <= 0.2
    assert 0.0 < card["greedy_alpha_k4"] <= 1.0
    assert (BUILTIN_DIR / "MODEL_CARD.md").read_text().count(f"{card['greedy_alpha_k4']:.3f}") >= 1


def test_missing_folder_names_path_and_rebuild_command(tmp_path, monkeypatch):
    import engine.sources as sources

    monkeypatch.setattr(sources, "BUILTIN_DIR", tmp_path / "nowhere")
    with pytest.raises(ModelLoadError) as err:
        load_model(BUILTIN, "target")
    assert str(tmp_path / "nowhere" / "target") in str(err.value)
    assert REBUILD_COMMAND in str(err.value)


def test_corrupt_weights_name_path_and_rebuild_command(tmp_path, monkeypatch):
    import engine.sources as sources

    shutil.copytree(BUILTIN_DIR / "draft", tmp_path / "draft")
    (tmp_path / "draft" / "model.safetensors").write_bytes(b"\x00garbage" * 64)
    monkeypatch.setattr(sources, "BUILTIN_DIR", tmp_path)
    with pytest.raises(ModelLoadError) as err:
        load_model(BUILTIN, "draft")
    assert str(tmp_path / "draft") in str(err.value) and REBUILD_COMMAND in str(err.value)


def test_corpus_split_holds_out_test_folders():
    heldout = corpus.list_sources("heldout")
    train = corpus.list_sources("train")
    assert heldout and train
    assert all(corpus.is_heldout(f.path.relative_to(corpus.stdlib_root())) for f in heldout)
    assert not {f.path for f in heldout} & {f.path for f in train}
    with pytest.raises(ValueError):
        corpus.list_sources("validation")

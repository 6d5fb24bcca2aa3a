"""The written chat prompt sets and the held-out subjects: every held-out prompt is on a subject that no
training prompt of any shipped data pack, nor any templated training prompt, touches."""
from __future__ import annotations

import re

import pytest

from engine.sources import ASSETS
from engine.train.chat_prompts import (
    HELDOUT_SUBJECTS,
    SETS,
    chat_prompts,
    touches_heldout_subject,
    training_prompts,
)
from engine.train.eagle3_data import clean_prompt
from engine.train.eagle3_folder import read_prompts

PACKS = sorted(p for p in (ASSETS / "draft-data").glob("smollm2*") if (p / "prompts.json").exists())


def test_the_sets_are_as_large_as_their_names_say_and_share_no_prompt():
    sizes = {which: len(chat_prompts(which)) for which in SETS}
    assert sizes == {"bench": 32, "heldout": 16, "fresh": 12, "wide": 48}
    seen = {which: {p.strip().lower() for p in chat_prompts(which)} for which in SETS}
    assert all(len(seen[which]) == sizes[which] for which in SETS)
    assert not seen["wide"] & (seen["bench"] | seen["heldout"] | seen["fresh"])
    assert not seen["heldout"] & (seen["bench"] | seen["fresh"])
    # two fresh prompts were also bench prompts when the fresh set was written; neither set is trained on
    assert len(seen["fresh"] & seen["bench"]) == 2
    with pytest.raises(ValueError, match="one of"):
        chat_prompts("train")


@pytest.mark.parametrize("which", ["heldout", "wide"])
def test_every_held_out_prompt_is_on_a_held_out_subject(which):
    off = [p for p in chat_prompts(which) if not touches_heldout_subject(p)]
    assert off == []


def test_every_wide_subject_is_used_by_a_wide_prompt():
    words = {w for p in chat_prompts("wide") for w in re.findall(r"[a-z]+", p.lower())}
    wide_stems = HELDOUT_SUBJECTS[HELDOUT_SUBJECTS.index("dinosaur"):]
    assert [s for s in wide_stems if not any(w.startswith(s) for w in words)] == []


def test_no_training_prompt_of_any_pack_or_template_touches_a_held_out_subject():
    assert len(PACKS) >= 5
    trained = list(training_prompts())
    for pack in PACKS:
        trained += read_prompts(pack)["train"]
    touched = [p for p in trained if touches_heldout_subject(p)]
    assert touched == []
    assert len(trained) > 25_000


def test_a_sampled_user_turn_on_a_held_out_subject_is_dropped():
    assert clean_prompt("How do I teach my parrot to talk?") is not None
    assert clean_prompt("Why do spiders look so leggy?") is not None      # "egg" inside a word is no subject
    for turn in ("Why are flamingos standing on one leg?", "Tell me about the Great Sudoku Championship.",
                 "Can my EGGS go in the fridge?"):
        assert clean_prompt(turn) is None

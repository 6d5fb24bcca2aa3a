"""The EAGLE-3 head's data: the batched forward answers as the target does alone, the features and soft
labels are the target's own, prompts are cleaned and held out, and shards survive being stopped."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from engine.prompts import ChatPrompt, encode_chat
from engine.sources import ASSETS, SMOLLM2_PIP, smollm2_gguf
from engine.train import command, data_pack, eagle3_batch, eagle3_folder
from engine.train import eagle3_data as data
from engine.train.draft_data import SamplingPass
from engine.train.eagle3_folder import DataError, DataFolder, Eagle3DataPlan
from tests.conftest import hf_greedy

pytestmark = pytest.mark.skipif(smollm2_gguf() is None, reason=f"the SmolLM2 wheel is not installed ({SMOLLM2_PIP})")
QUESTIONS = ("Why is the sky blue?", "Name a bird.", "What does a compiler do in one sentence?")



def test_the_recorded_command_keeps_what_changes_the_data():
    typed = ["--target", "smollm2", "--minutes", "15", "--seed", "1", "--threads=2", "--exclude", "a/minutes"]
    assert command.command_line("draft-data", typed) == \
        "python -m engine draft-data --target smollm2 --seed 1 --exclude a/minutes"
    assert command.command_line("train-eagle3", ["--minutes=5", "--epochs", "1"]) == \
        "python -m engine train-eagle3 --epochs 1"
    assert command.command_line("draft-data", ["--rebuild-dtype", "bfloat16", "--seed", "2"]) == \
        "python -m engine draft-data --seed 2"
    assert command.command_line("draft-data", ["--answers-only", "--seed", "2", "--answers-only"]) == \
        "python -m engine draft-data --seed 2"
    assert command.command_line("draft-data", ["--device", "cuda", "--seed", "2"]) == \
        "python -m engine draft-data --seed 2"


@pytest.mark.parametrize("device, words", [("tpu", "unknown device 'tpu'"), ("cuda:7", "cuda:7 is not available")])
def test_a_device_that_is_not_there_gets_a_sentence_before_the_target_loads(device, words, capsys, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("the target was loaded before the device was checked")

    monkeypatch.setattr(data, "command_start", no_loading)
    assert data.main(["--device", device]) == 2
    assert words in capsys.readouterr().err


def tiny_plan(**overrides) -> Eagle3DataPlan:
    base = dict(magpie_prompts=6, prompt_batch=8, prompt_max_tokens=24, answer_batch=2, max_new_tokens=8, top_k=5,
                written_prompts=2)
    return Eagle3DataPlan(**{**base, **overrides}).for_model(30)


@pytest.fixture(scope="module")
def sampled(smol, tmp_path_factory) -> Path:
    """The prompts a tiny plan's folder samples (the slow part of its first phase), sampled once for the module.
    The answer length is not part of what is sampled, so every tiny plan's folder may begin with them: one seeded
    with them (`seeded`) goes on from them as a rerun in that folder would. The stopped-run test samples its own."""
    root = tmp_path_factory.mktemp("sampled")
    with DataFolder(root, tiny_plan(), smol.name) as folder:
        data.build_prompts(folder, smol.fused, smol.tokenizer, 2, lambda line: None, None)
    return root / "prompts"


def seeded(root: Path, sampled: Path) -> Path:
    shutil.copytree(sampled, root / "prompts")
    return root


@pytest.mark.parametrize("layers", [(), (2, 15, 30)], ids=["default-layers", "post-norm-top"])
def test_batched_answers_are_the_targets_own(smol, layers):
    plan = tiny_plan(max_new_tokens=12, layers=layers)
    prompts = [encode_chat(smol.tokenizer, ChatPrompt(q)) for q in QUESTIONS]   # three lengths: left padding
    examples = data.answer_batch(smol.fused, prompts, SamplingPass(), plan, 2, seed=0)
    model = smol.model
    for p, e in zip(prompts, examples):
        assert e.check() is None and e.ids[: len(p)].tolist() == p
        assert e.ids[len(p):].tolist() == hf_greedy(smol, p, 12, eos_id=2)      # token for token
        with torch.inference_mode():
            out = model(input_ids=e.ids[None, :-1].long(), output_hidden_states=True)
        for j, layer in enumerate(plan.layers):   # hidden_states[i] is what enters layer i (30: post-norm)
            ref = out.hidden_states[layer][0]
            assert (e.features[:, j].float() - ref).abs().max() < 2e-3 * ref.abs().max() + 1e-2
        ref_logp = torch.log_softmax(out.logits[0, len(p) - 1:].float(), -1)
        assert torch.equal(e.top_ids[:, 0].long(), ref_logp.argmax(-1))
        picked = ref_logp.gather(1, e.top_ids.long())
        assert (picked - e.top_logp.float()).abs().max() < 2e-2


def test_sampled_answers_follow_their_seed(smol):
    plan = tiny_plan()
    prompts = [encode_chat(smol.tokenizer, ChatPrompt(q)) for q in QUESTIONS[:2]]
    a = data.answer_batch(smol.fused, prompts, SamplingPass(0.7, 0.95), plan, 2, seed=5)
    b = data.answer_batch(smol.fused, prompts, SamplingPass(0.7, 0.95), plan, 2, seed=5)
    c = data.answer_batch(smol.fused, prompts, SamplingPass(1.5, 1.0), plan, 2, seed=6)
    assert [e.ids.tolist() for e in a] == [e.ids.tolist() for e in b]
    assert [e.ids.tolist() for e in a] != [e.ids.tolist() for e in c]


def test_prompts_are_cleaned_deduplicated_and_held_out():
    plan = Eagle3DataPlan(max_per_opening=2, heldout_every=3)
    samples = ["How do I bake bread at home?", "how do I bake bread at home ?", "Tell me <|im_start|> x y",
               "Hi", "Why do eggs float in salt water?", "What is a good name for a cat?",
               "What is a good way to learn chess?", "What is a good book about ships?", "Explain tides to a child."]
    train, heldout = data.select_prompts(samples, plan)
    kept = train + heldout
    assert "how do I bake bread at home ?" not in kept and "Hi" not in kept                  # duplicate, too short
    assert not any("<|" in p for p in kept) and not any("egg" in p for p in kept)          # markup, held-out subject
    assert sum(p.startswith("What is a good") for p in kept) == 2                          # the opening cap
    assert all(data.is_heldout(p, 3) for p in heldout) and not any(data.is_heldout(p, 3) for p in train)
    assert data.select_prompts(samples, plan) == (train, heldout)
    taken = frozenset({data.normalized("Explain tides to a child!")})   # another folder's prompt, as it wrote it
    assert data.select_prompts(samples, plan, taken) == ([p for p in train if "tides" not in p],
                                                         [p for p in heldout if "tides" not in p])


def test_a_second_folder_leaves_out_the_first_ones_prompts_and_keeps_its_own_pack(tmp_path):
    first = tmp_path / "first"
    first.mkdir()
    (first / "prompts.json").write_text(json.dumps({"magpie_target": 2, "train": ["How do tides work?"],
                                                    "heldout": ["Name three rivers, please."]}))
    assert data.other_prompts([first]) == {"how do tides work", "name three rivers please"}
    with pytest.raises(DataError, match="no frozen prompt list"):
        data.other_prompts([tmp_path / "nowhere"])
    pack = tmp_path / "pack"
    with DataFolder(tmp_path / "a", tiny_plan(), "smol") as folder:
        data_pack.check_pack(folder, pack)                     # no pack yet: this folder starts it
        eagle3_folder.write_atomic(folder.root / "command.txt", "python -m engine draft-data --magpie 6\n")
        data_pack.save_pack(folder, pack, print)
        data_pack.check_pack(folder, pack)                     # its own pack
        assert (pack / "command.txt").read_text() == (folder.root / "command.txt").read_text()
    with DataFolder(tmp_path / "b", tiny_plan(seed=1, written_prompts=0), "smol") as folder:
        with pytest.raises(DataError, match="give this folder its own pack"):
            data_pack.check_pack(folder, pack)
        assert eagle3_folder.data_command(folder.root) == "python -m engine draft-data --target smol --magpie 6 --seed 1 --written 0"
    (pack / "plan.json").write_text("{")
    with DataFolder(tmp_path / "a", tiny_plan(), "smol") as folder, pytest.raises(DataError, match="cannot be read"):
        data_pack.check_pack(folder, pack)


def test_a_larger_prompt_list_is_refused_once_answers_index_the_frozen_one(tmp_path):
    root, pack = tmp_path / "data", tmp_path / "pack"
    assert data.frozen_count(root, pack) == Eagle3DataPlan().magpie_prompts       # nothing frozen yet
    pack.mkdir()
    (pack / "prompts.json").write_text(json.dumps({"magpie_target": 3}))
    assert data.frozen_count(root, pack) == 3                                     # the pack's list
    with DataFolder(root, tiny_plan(magpie_prompts=4), "smol") as folder:
        eagle3_folder.write_atomic(root / "prompts.json", json.dumps({"magpie_target": 2, "train": ["a"], "heldout": []}))
        assert data.frozen_count(root, pack) == 2                                 # the folder's own comes first
        (root / "answers" / "shard-p0-00000.pt").write_bytes(b"x")
        with pytest.raises(DataError, match="--magpie 2"):
            data.build_prompts(folder, None, None, 2, print, None)
    with DataFolder(root, tiny_plan(magpie_prompts=2), "smol") as folder:
        assert data.build_prompts(folder, None, None, 2, print, None)["train"] == ["a"]


def test_steered_turns_begin_with_their_opener_and_each_opener_has_its_own_cap(smol, tmp_path):
    plan = tiny_plan(openers=("Write a", "What is the difference between"), prompt_max_tokens=48)
    openers = data.batch_openers(plan, 1)
    assert openers[:3] == ["Write a", "What is the difference between", "Write a"]      # in turn, across batches
    assert data.batch_openers(tiny_plan(), 3) == [""] * 8
    header = data.user_header(smol.tokenizer)
    texts = data.sample_prompts(smol.fused, smol.tokenizer, header, plan, 2, seed=3, openers=openers)
    ended = [(o, t) for o, t in zip(openers, texts) if t]
    assert ended and all(t.startswith(o) and len(t) > len(o) for o, t in ended)        # the target finished them
    # the opening cap counts the words after a (long) opener, so one opener does not use up the others' room
    plan = Eagle3DataPlan(max_per_opening=1, openers=("What is the difference between",))
    samples = ["What is the difference between a lake and a pond?",
               "What is the difference between rain and snow in May?",
               "What is the difference between rain and snow in winter?"]
    assert sum(map(len, data.select_prompts(samples, plan))) == 2
    assert sum(map(len, data.select_prompts(samples, Eagle3DataPlan(max_per_opening=1)))) == 1
    # a steered plan is another plan; a free one keeps the fingerprint folders were made with
    assert plan.fingerprint() != Eagle3DataPlan().fingerprint()
    free = eagle3_folder.asdict_plan(Eagle3DataPlan())
    free.pop("openers")
    assert eagle3_folder.plan_from_dict(free) == Eagle3DataPlan()
    with DataFolder(tmp_path / "s", tiny_plan(openers=("List",)), "smol") as folder:
        assert eagle3_folder.data_command(folder.root).endswith("--steered")


def test_user_header_is_the_template_up_to_the_message(smol):
    header = smol.tokenizer.decode(data.user_header(smol.tokenizer))
    assert header.endswith("<|im_start|>user\n") and "<|im_start|>assistant" not in header


def test_a_stopped_run_resumes_and_never_reads_half_a_shard(smol, tmp_path):
    plan, logs = tiny_plan(), []
    root = tmp_path / "data"
    with DataFolder(root, plan, smol.name) as folder:
        with pytest.raises(DataError, match="another data run"):
            DataFolder(root, plan, smol.name)
        prompts = data.build_prompts(folder, smol.fused, smol.tokenizer, 2, logs.append, None)
        assert prompts["sources"]["magpie"] + prompts["sources"]["magpie_heldout"] >= 6
        assert not set(prompts["heldout"]) & set(prompts["train"])
        data.build_prompts(folder, smol.fused, smol.tokenizer, 2, logs.append, None)      # frozen: nothing more
        assert len(list((root / "prompts").glob("batch-*.json"))) == len(logs) - 1
        first = data.build_answers(folder, smol.fused, smol.tokenizer, 2, 1, logs.append, None)  # one shard
    assert first["shards"] == 1
    shard = next(eagle3_folder.iter_shards(root))
    good = shard.read_bytes()
    shard.write_bytes(good[: len(good) // 2])                    # killed mid-write by something outside
    (root / "answers" / "shard-p0-00001.pt.tmp").write_bytes(b"half")
    with pytest.raises(DataError, match=shard.name):
        eagle3_folder.load_shard(shard, plan.fingerprint())
    with DataFolder(root, plan, smol.name) as folder:
        again = data.build_answers(folder, smol.fused, smol.tokenizer, 2, 10**9, logs.append, None)
    assert any("not whole" in line for line in logs)
    chunks = -(-len(prompts["train"]) // plan.answer_batch)
    assert again["shards"] == chunks * len(plan.passes) and len(list(eagle3_folder.iter_shards(root))) == again["shards"]
    for path in eagle3_folder.iter_shards(root):
        for e in eagle3_folder.load_shard(path, plan.fingerprint()):
            assert e.check() is None
    side = json.loads(shard.with_suffix(".json").read_text())
    assert side["bytes"] == os.path.getsize(shard) and side["tokens"] == sum(
        e.ids.numel() for e in eagle3_folder.load_shard(shard, plan.fingerprint()))
    with pytest.raises(DataError, match="another plan"):
        DataFolder(root, tiny_plan(top_k=7), smol.name)


def test_a_replayed_sequence_gives_the_generated_features_and_soft_labels(smol):
    """Teacher forcing the whole sequence at once (engine.train.data_pack.replay) rebuilds what decoding made."""
    plan = tiny_plan(max_new_tokens=12)
    prompts = [encode_chat(smol.tokenizer, ChatPrompt(q)) for q in QUESTIONS]
    for sampling in (SamplingPass(), SamplingPass(0.7, 0.95)):
        made = data.answer_batch(smol.fused, prompts, sampling, plan, 2, seed=3)
        again = data_pack.replay(smol.fused, [(e.ids, e.prompt_len) for e in made], plan, rows=2)
        for a, b in zip(made, again):
            assert b.check() is None and torch.equal(a.ids, b.ids) and a.prompt_len == b.prompt_len
            scale = a.features.float().abs().max()
            assert (a.features.float() - b.features.float()).abs().max() < 2e-3 * scale + 1e-2
            assert torch.equal(a.top_ids[:, 0], b.top_ids[:, 0])
            assert (a.top_logp[:, 0].float() - b.top_logp[:, 0].float()).abs().max() < 2e-2


def test_a_bf16_replay_rounds_but_keeps_the_labels_and_says_so(smol, sampled, tmp_path):
    """The bfloat16 rebuild (Bf16Weights) differs from fp32 by rounding only: features close, the top-1 label
    kept at nearly every position (measured on the real packs: 98.5%), and its shards are marked."""
    plan, logs, pack = tiny_plan(max_new_tokens=24), [], tmp_path / "pack"
    with DataFolder(seeded(tmp_path / "a", sampled), plan, smol.name) as folder:
        data.build_prompts(folder, smol.fused, smol.tokenizer, 2, logs.append, None)
        keep = lambda path, examples, meta: data_pack.save_entry(pack, path, examples, meta)  # noqa: E731
        data.build_answers(folder, smol.fused, smol.tokenizer, 2, 150, logs.append, None, keep)
        data_pack.save_pack(folder, pack, logs.append)
    with DataFolder(tmp_path / "b", plan, smol.name) as folder:
        rebuilt = data_pack.restore(folder, pack, smol.fused, logs.append, bf16=True)
    assert rebuilt == len(list((pack / "answers").glob("*.npz"))) >= 1
    same = total = 0
    for shard in eagle3_folder.iter_shards(tmp_path / "a"):
        twin = tmp_path / "b" / "answers" / shard.name
        assert json.loads(twin.with_suffix(".json").read_text())["replayed"] == "bfloat16"
        assert "replayed" not in json.loads(shard.with_suffix(".json").read_text())
        for a, b in zip(eagle3_folder.load_shard(shard, plan.fingerprint()), eagle3_folder.load_shard(twin, plan.fingerprint())):
            assert torch.equal(a.ids, b.ids) and not torch.equal(a.features, b.features)   # rounded, not fp32
            fa, fb = a.features.float(), b.features.float()
            assert ((fa - fb).norm(dim=-1) / fa.norm(dim=-1)).mean() < 0.03
            same += int((a.top_ids[:, 0] == b.top_ids[:, 0]).sum())
            total += a.top_ids.shape[0]
    assert same >= 0.9 * total


def test_a_fresh_folder_is_rebuilt_from_the_pack_and_a_damaged_entry_is_refused(smol, sampled, tmp_path):
    plan, logs, pack = tiny_plan(), [], tmp_path / "pack"
    with DataFolder(seeded(tmp_path / "a", sampled), plan, smol.name) as folder:
        data.build_prompts(folder, smol.fused, smol.tokenizer, 2, logs.append, None)
        keep = lambda path, examples, meta: data_pack.save_entry(pack, path, examples, meta)  # noqa: E731
        made = data.build_answers(folder, smol.fused, smol.tokenizer, 2, 200, logs.append, None, keep)
        (folder.root / "command.txt").write_text("the command that made it\n")
        assert data_pack.save_pack(folder, pack, logs.append) == 0      # every shard was packed as it was made
    assert made["shards"] == len(list((pack / "answers").glob("*.npz"))) >= 2
    with DataFolder(tmp_path / "b", plan, smol.name) as folder:
        assert data_pack.restore(folder, pack, smol.fused, logs.append) == made["shards"]
        assert eagle3_folder.read_prompts(folder.root) == eagle3_folder.read_prompts(tmp_path / "a")
        (folder.root / "command.txt").write_text("a command that only rebuilt it\n")
        assert data_pack.save_pack(folder, pack, logs.append, refresh=False) == 0   # it made nothing: the pack keeps
        assert (pack / "command.txt").read_text() == "the command that made it\n"    # the command that made it
    for shard in eagle3_folder.iter_shards(tmp_path / "a"):
        twin = tmp_path / "b" / "answers" / shard.name
        for a, b in zip(eagle3_folder.load_shard(shard, plan.fingerprint()), eagle3_folder.load_shard(twin, plan.fingerprint())):
            assert torch.equal(a.ids, b.ids) and torch.equal(a.top_ids[:, 0], b.top_ids[:, 0])
    entry = sorted((pack / "answers").glob("*.npz"))[0]
    entry.write_bytes(entry.read_bytes()[:100])                        # cut short
    (tmp_path / "b" / "answers" / (entry.stem + ".pt")).unlink()
    with DataFolder(tmp_path / "b", plan, smol.name) as folder:
        with pytest.raises(DataError, match=entry.name):
            data_pack.restore(folder, pack, smol.fused, logs.append)
    with DataFolder(tmp_path / "c", tiny_plan(top_k=4), smol.name) as folder:   # another plan: not used
        assert data_pack.restore(folder, pack, smol.fused, logs.append) == 0
        assert data_pack.packed_tokens(folder, pack, logs.append) == {}
    assert "under another plan" in logs[-1]


def test_answering_on_from_a_pack_without_rebuilding_it(smol, sampled, tmp_path):
    """--answers-only: a fresh folder answers only the chunks the pack lacks, counting the packed ones as held,
    and a later run rebuilds those; together they hold what one run in one folder makes."""
    plan, logs, pack = tiny_plan(), [], tmp_path / "pack"
    keep = lambda path, examples, meta: data_pack.save_entry(pack, path, examples, meta)  # noqa: E731
    with DataFolder(seeded(tmp_path / "a", sampled), plan, smol.name) as folder:
        data.build_prompts(folder, smol.fused, smol.tokenizer, 2, logs.append, None)
        first = data.build_answers(folder, smol.fused, smol.tokenizer, 2, 150, logs.append, None, keep)
        data_pack.save_pack(folder, pack, logs.append)
    packed_before = {p.stem for p in (pack / "answers").glob("*.npz")}
    with DataFolder(tmp_path / "b", plan, smol.name) as folder:
        assert data_pack.restore(folder, pack, smol.fused, logs.append, rebuild=False) == 0
        assert eagle3_folder.read_prompts(folder.root) == eagle3_folder.read_prompts(tmp_path / "a")
        packed = data_pack.packed_tokens(folder, pack, logs.append)
        assert set(packed) == packed_before and sum(packed.values()) == first["tokens"]
        rest = data.build_answers(folder, smol.fused, smol.tokenizer, 2, 10**9, logs.append, None, keep, packed)
    made = {p.stem for p in eagle3_folder.iter_shards(tmp_path / "b")}
    assert made and not made & packed_before                       # nothing packed was answered again
    eagle3_folder.mark_packed_only(tmp_path / "b", sorted(packed))            # as the command does: not training data yet
    with pytest.raises(DataError, match=f"holds {len(packed)} of its shards only as token ids"):
        eagle3_batch.data_folders([tmp_path / "b"])
    prompts = [encode_chat(smol.tokenizer, ChatPrompt(p)) for p in eagle3_folder.read_prompts(tmp_path / "b")["train"]]
    chunks = len(data.chunks_of(prompts, plan.answer_batch, plan.seed))
    assert made | packed_before == {eagle3_folder.shard_path(tmp_path, pi, ci).stem            # every chunk in every pass
                                    for ci in range(chunks) for pi in range(len(plan.passes))}
    new_tokens = sum(eagle3_folder.shard_info(tmp_path / "b" / "answers" / f"{n}.pt", plan.fingerprint())["tokens"]
                     for n in made)
    assert (rest["tokens"], rest["shards"]) == (first["tokens"] + new_tokens, len(made | packed_before))
    with DataFolder(tmp_path / "b", plan, smol.name) as folder:     # a run without the option rebuilds the rest
        assert data_pack.restore(folder, pack, smol.fused, logs.append) == len(packed_before)
    assert eagle3_folder.packed_only(tmp_path / "b") == []
    assert len(eagle3_batch.data_folders([tmp_path / "b"])[0]) == len(made | packed_before)   # now all of it trains
    entry = sorted((pack / "answers").glob("*.npz"))[0]
    entry.write_bytes(entry.read_bytes()[:100])
    with DataFolder(tmp_path / "c", plan, smol.name) as folder:
        with pytest.raises(DataError, match=entry.name):
            data_pack.packed_tokens(folder, pack, logs.append)


@pytest.mark.parametrize("pack", sorted(p.name for p in (ASSETS / "draft-data").iterdir() if p.is_dir()))
def test_every_shipped_pack_is_whole(pack):
    """What a fresh machine rebuilds its data from: each entry readable, made under the pack's own plan, its
    prompts indices inside the frozen list, and no prompt in two packs."""
    root = ASSETS / "draft-data" / pack
    plan = json.loads((root / "plan.json").read_text())
    prompts = eagle3_folder.read_prompts(root)
    entries = sorted((root / "answers").glob("shard-p*-*.npz"))
    assert entries, root
    for entry in entries:
        seqs, meta = data_pack.read_entry(entry)
        assert meta["fingerprint"] == plan["fingerprint"] and entry.stem.endswith(f"-{meta['chunk']:05d}")
        assert len(seqs) == len(meta["prompts"]) and max(meta["prompts"]) < len(prompts["train"])
    others = [p for p in (ASSETS / "draft-data").iterdir() if p.is_dir() and p.name != pack]
    written = set(data.training_prompts(plan["plan"]["seed"]))
    assert not data.other_prompts(others) & {data.normalized(p) for p in prompts["train"] if p not in written}

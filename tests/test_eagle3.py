"""The EAGLE-3-style head: it reads the fused layer inputs the target hands over, training lowers its loss on
the data, its export loads, and the engine with it stays exact (greedy: the target-only tokens)."""
from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.config import DrafterKind, Mode, SpecConfig
from engine.drafters.eagle import EagleConfig, EagleHead, EagleRuntime, load_runtime
from engine.pair import ModelPair
from engine.prompts import ChatPrompt, encode_chat
from engine.runner import ModelRunner
from engine.sources import SMOLLM2_PIP, smollm2_gguf
from engine.speculative import SpeculativeEngine
from engine.train import eagle3, eagle3_batch, eagle3_card, eagle3_data, eagle3_folder, eagle3_loss, eagle3_plan
from engine.train.eagle import target_rope
from engine.train.eagle3_folder import DataFolder, Eagle3DataPlan

pytestmark = pytest.mark.skipif(smollm2_gguf() is None, reason=f"the SmolLM2 wheel is not installed ({SMOLLM2_PIP})")
LAYERS = (2, 15, 27)



def random_head(smol, kept: int = 512, feature_norm: bool = False) -> EagleRuntime:
    config = replace(EagleConfig.for_target(smol, kept), feature_layers=LAYERS, own_head=True,
                     feature_norm=feature_norm)
    head = EagleHead(config)
    head.init_for_training(torch.Generator().manual_seed(0))
    with torch.no_grad():
        head.lm.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
        if feature_norm:   # a different weight for every channel of every layer
            head.fuse_norm.uniform_(0.5, 2.0, generator=torch.Generator().manual_seed(2))
    kept_ids = torch.arange(kept)
    kept_ids[-1] = 2   # the end of turn
    return EagleRuntime(head, kept_ids.sort().values, smol, name="eagle3-test")


@pytest.mark.parametrize("layers", [LAYERS, (30, 2, 15)], ids=["layer-inputs", "post-norm-first"])
def test_the_target_hands_over_the_inputs_of_the_tapped_layers(smol, layers):
    """Tap i is the residual stream entering layer i; tap 30, past SmolLM2's last layer, its post-norm output
    (transformers' hidden_states[30]), in the order asked."""
    ids = encode_chat(smol.tokenizer, ChatPrompt("Name a river."))
    runner = ModelRunner(smol, len(ids) + 8)
    _, taps = runner.forward_features(runner.new_sequence(), ids, last_only=True, taps=layers)
    with torch.inference_mode():
        out = smol.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    ref = torch.cat([out.hidden_states[i][0] for i in layers], dim=-1)
    assert taps.shape == (len(ids), 3 * 576)
    assert (taps - ref).abs().max() < 1e-5 * ref.abs().max() + 1e-4
    plain = ModelRunner(smol, len(ids) + 8, fused=False)
    _, via_hf = plain.forward_features(plain.new_sequence(), ids, last_only=True, taps=layers)
    assert torch.allclose(via_hf, ref)
    if 30 in layers:   # what the LM head reads: its logits are the model's
        post = taps[:, layers.index(30) * 576:][:, :576]
        with torch.inference_mode():
            logits = post[-1] @ smol.model.get_output_embeddings().weight.T
        assert (logits - out.logits[0, -1]).abs().max() < 1e-3 * out.logits[0, -1].abs().max()


def test_a_head_learns_from_layers_past_the_ones_the_data_kept(smol):
    """Layers past the highest kept one are computed from its stored (float16) input by running the target on:
    the engine's own taps of the same tokens, padded rows and any order included; other layers are refused."""
    ids = encode_chat(smol.tokenizer, ChatPrompt("Why is the sea salty?"))
    runner = ModelRunner(smol, 4 * len(ids))
    _, kept = runner.forward_features(runner.new_sequence(), ids, taps=LAYERS)
    wanted = (30, 2, 28)
    _, ref = runner.forward_features(runner.new_sequence(), ids, taps=wanted)
    padded = torch.zeros(2, len(ids) + 5, kept.shape[1])
    padded[:, : len(ids)] = kept.half().float()          # as a shard stores it, right-padded in a batch
    padded[1, len(ids):] = 1e4                            # padding never reaches a real row
    lifted = eagle3_loss.lift_features(smol.fused, padded, LAYERS, wanted)[:, : len(ids)]
    assert lifted.shape == (2, len(ids), 3 * 576)
    assert torch.equal(lifted[0], lifted[1])
    rel = (lifted[0] - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert rel.max() < 2e-3
    assert eagle3_loss.layers_error(LAYERS, (2, 15, 30), 30) is None
    assert eagle3_loss.layers_error(LAYERS, LAYERS, 30) is None
    for bad in [(2, 20), (31,), (2, 2, 30), ()]:
        assert "the data kept the inputs of layers [2, 15, 27]" in eagle3_loss.layers_error(LAYERS, bad, 30)


def test_normed_fusion_starts_from_what_each_layer_reads(smol):
    """With --feature-norm each tapped layer is normalised on its own before the fusion, its weight started from the
    target's norm there: block j of the fusion then reads exactly what layer i's attention reads (transformers'
    input_layernorm of hidden_states[i]), and the post-norm output (30) scaled to unit RMS."""
    layers = (2, 15, 30)
    config = replace(EagleConfig.for_target(smol, 64), feature_layers=layers, feature_norm=True)
    head = EagleHead(config)
    with torch.no_grad():
        head.fuse_norm.copy_(eagle3_loss.target_norms(smol, layers))
    ids = encode_chat(smol.tokenizer, ChatPrompt("Name a river."))
    with torch.inference_mode():
        hidden = smol.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
        taps = torch.cat([hidden[i][0] for i in layers], dim=-1)
        for j, i in enumerate(layers):
            head.fuse.weight.zero_()
            head.fuse.weight[:, j * 576: (j + 1) * 576] = torch.eye(576)
            got = head.real_features(taps)
            h = hidden[i][0]
            want = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + config.rms_eps) if i == 30 else \
                smol.model.model.layers[i].input_layernorm(h)
            assert (got - want).abs().max() < 1e-4 * want.abs().max(), i


def test_greedy_with_an_eagle3_head_is_the_target_alone(smol):
    pair = ModelPair(smol, None, random_head(smol))
    assert pair.eagle.config.style == "EAGLE-3 style"
    ids = encode_chat(smol.tokenizer, ChatPrompt("Why do cats purr?"))
    runs, rounds = {}, {}
    for mode in (Mode.V2, Mode.TARGET):
        engine = SpeculativeEngine(pair, ids, SpecConfig(mode=mode, drafter=DrafterKind.EAGLE, k=4,
                                                         max_new_tokens=20, record=False))
        rounds[mode] = engine.run()
        runs[mode] = list(engine.generated)
        engine.close()
    assert runs[Mode.V2] == runs[Mode.TARGET]
    assert all(r.k for r in rounds[Mode.V2][1:-1])


@pytest.mark.parametrize("feature_norm", [False, True], ids=["raw-layers", "normed-layers"])
def test_the_engine_drafts_what_training_computes(smol, feature_norm):
    """Every draft the engine makes with an EAGLE-3 head (K = 3, greedy) has the logits that training's unrolled
    steps give for the same inputs: the committed tokens' real layer inputs, then the drafts as the chain's
    tokens. A feature, a token or a rotary position fed one place off in either would break this."""
    runtime = random_head(smol, kept=2048, feature_norm=feature_norm)
    captured: list[torch.Tensor] = []
    draft_logits = runtime.logits

    def recording(feats):
        out = draft_logits(feats)
        captured.append(out[0].clone())
        return out

    runtime.logits = recording
    ids = encode_chat(smol.tokenizer, ChatPrompt("Why do cats purr?"))
    k = 3
    engine = SpeculativeEngine(ModelPair(smol, None, runtime), ids,
                               SpecConfig(drafter=DrafterKind.EAGLE, k=k, max_new_tokens=14, record=False))
    engine.step()   # the prefill
    rounds = []
    while not engine.finished:
        n, before = len(engine.tokens), len(captured)
        engine.step()
        rounds.append((n, captured[before:]))
    tokens = list(engine.tokens)
    engine.close()
    with torch.inference_mode():
        hidden = smol.model(input_ids=torch.tensor([tokens]), output_hidden_states=True).hidden_states
    real = torch.cat([hidden[i][0] for i in LAYERS], dim=-1)          # [len, 3d]: feature of each token
    embed = smol.model.get_input_embeddings().weight.detach()
    head = runtime.head
    compared = 0
    for n, logits in rounds:
        assert len(logits) <= k                # the last rounds draft only what is left to generate
        drafts = [int(runtime.kept_ids[row.argmax()]) for row in logits]
        chain = tokens[:n] + drafts
        feats = torch.zeros(1, len(chain) - 1, real.shape[1])
        feats[0, : n - 1] = real[: n - 1]          # only the committed tokens' features are real
        cos, sin = target_rope(smol, head.config.head_dim, len(chain))
        with torch.inference_mode():
            outs = list(eagle3_loss.unrolled(head, torch.nn.functional.embedding(torch.tensor([chain[1:]]), embed),
                                        feats, k, cos[1:], sin[1:]))
        for step, row in enumerate(logits, start=1):
            column = n + step - 3                  # draft position n - 2 + step, column = position - 1
            offline = torch.nn.functional.linear(outs[step - 1][0, column], head.lm).float()
            assert (offline - row).abs().max() < 1e-3 * row.abs().max(), (n, step)
            compared += 1
    assert compared >= 3 * 4


def test_no_pass_over_the_held_out_prompts_is_trained_on():
    paths = sorted(Path(f"shard-p{p}-{c:05d}.pt") for c in range(3) for p in range(2))
    held, train = eagle3_batch.heldout_split(paths)
    assert held.name == "shard-p0-00000.pt"
    assert [p.name for p in train] == ["shard-p0-00001.pt", "shard-p0-00002.pt", "shard-p1-00001.pt",
                                       "shard-p1-00002.pt"]


def test_data_folders_must_keep_the_same_layers(tmp_path):
    for name, layers in (("a", [2, 15, 27]), ("b", [2, 15, 27]), ("c", [3, 15, 27])):
        (tmp_path / name / "answers").mkdir(parents=True)
        (tmp_path / name / "plan.json").write_text(json.dumps({"fingerprint": name, "plan": {"layers": layers}}))
        (tmp_path / name / "answers" / "shard-p0-00000.pt").write_bytes(b"")
        (tmp_path / name / "prompts.json").write_text("{}")
    shards, layers, _ = eagle3_batch.data_folders([tmp_path / "a", tmp_path / "b"])
    assert layers == (2, 15, 27) and shards == {tmp_path / n / "answers" / "shard-p0-00000.pt": n for n in "ab"}
    # a folder whose data was never made (a run that stopped before its prompts or its first shard) is refused
    # before any training, not when the head is exported minutes later
    (tmp_path / "b" / "answers" / "shard-p0-00000.pt").unlink()
    with pytest.raises(eagle3_folder.DataError, match="holds no answers yet .no shards.: finish its data first"):
        eagle3_batch.data_folders([tmp_path / "a", tmp_path / "b"])
    (tmp_path / "a" / "prompts.json").unlink()
    with pytest.raises(eagle3_folder.DataError, match="no frozen prompt list"):
        eagle3_batch.data_folders([tmp_path / "a"])
    (tmp_path / "a" / "prompts.json").write_text("{}")
    with pytest.raises(eagle3_folder.DataError, match="same layers"):
        eagle3_batch.data_folders([tmp_path / "a", tmp_path / "c"])
    with pytest.raises(eagle3_folder.DataError, match="given twice"):
        eagle3_batch.data_folders([tmp_path / "a", tmp_path / "a"])
    with pytest.raises(eagle3_folder.DataError, match="cannot be read"):
        eagle3_batch.data_folders([tmp_path / "nothing"])


@pytest.fixture(scope="module")
def answered(smol, tmp_path_factory) -> tuple[Path, Eagle3DataPlan]:
    """A small data folder the target answered, built once for the training tests (each trains on its own copy)."""
    plan = Eagle3DataPlan(magpie_prompts=4, prompt_batch=8, prompt_max_tokens=32, answer_batch=2, max_new_tokens=12,
                          top_k=8, written_prompts=6).for_model(30)
    data = tmp_path_factory.mktemp("eagle3-answered") / "data"
    with DataFolder(data, plan, smol.name) as folder:
        eagle3_data.build_prompts(folder, smol.fused, smol.tokenizer, 2, lambda m: None, None)
        eagle3_data.build_answers(folder, smol.fused, smol.tokenizer, 2, 10**9, lambda m: None, None)
    return data, plan


def test_training_covers_each_sequences_context_as_the_engine_drafts_it(smol, answered):
    """A head reading the target's LM head trains on the q the engine drafts from: the kept tokens and each
    sequence's tokens outside them once the sequence holds them (engine.drafters.eagle.DraftVocabulary). The
    batch's cover and labels, and step 1's loss, against a recomputation position by position."""
    data, plan = answered
    examples = [e for p in eagle3_folder.iter_shards(data) for e in eagle3_folder.load_shard(p, plan.fingerprint())][:3]
    kept = eagle3_batch.kept_vocabulary(examples, 128, (2,))
    index = torch.full((smol.vocab_size,), -1, dtype=torch.long)
    index[kept] = torch.arange(len(kept))
    batch = eagle3_batch.make_batch(examples, index, 384, context=True)
    plain = eagle3_batch.make_batch(examples, index, 384)
    assert plain.extra_ids.numel() == 0 and (batch.emb_ids == plain.emb_ids).all()
    k_kept, extra = len(kept), batch.extra_ids.tolist()
    cut = [e.ids[: min(e.ids.numel(), 384)].tolist() for e in examples]
    assert extra == sorted({t for ids in cut for t in ids} - set(kept.tolist()))
    for i, ids in enumerate(cut):
        assert batch.first_at[i].tolist() == [ids.index(t) if t in ids else eagle3_batch.NEVER for t in extra]
    columns = torch.arange(batch.emb_ids.shape[1])          # step 2 at column c: a chain whose last commit is x_c
    assert (batch.visible(2) == (batch.first_at[:, None, :] <= columns[None, :, None])).all()

    runtime = random_head(smol, kept=k_kept)
    head = EagleHead(replace(runtime.config, own_head=False, feature_layers=LAYERS))
    head.init_for_training(torch.Generator().manual_seed(3))
    lm_all = smol.model.get_output_embeddings().weight.detach().float()
    n = batch.emb_ids.shape[1]
    cos, sin = target_rope(smol, head.config.head_dim, n + 1)
    embed = smol.model.get_input_embeddings().weight.detach().float()
    one = eagle3.Eagle3Plan(kept=k_kept, depth=1)
    with torch.no_grad():
        loss, _ = eagle3_loss.unrolled_loss(head, batch, embed, one, cos[1:], sin[1:], lm_all[kept], lm_all)
        out = next(eagle3_loss.unrolled(head, torch.nn.functional.embedding(batch.emb_ids, embed), batch.feats.float(), 1,
                                   cos[1:], sin[1:]))
    terms, covered_extra = [], 0
    for i, e in enumerate(examples):
        ids, m = cut[i], len(cut[i]) - 1
        for c in range(e.prompt_len - 2, m - 1):
            row = c + 1 - (e.prompt_len - 1)
            if row < 0:
                continue
            cover = sorted(set(kept.tolist()) | set(ids[: c + 2]))       # x_0 .. x_t, t = c + 1
            tops, p = e.top_ids[row].tolist(), e.top_logp[row].float().exp()
            use = torch.tensor([t in cover for t in tops])
            if not use.any():
                continue
            covered_extra += sum(t in cover and t not in kept.tolist() for t in tops)
            logq = torch.log_softmax(out[i, c] @ lm_all[cover].T, -1)
            col = {t: j for j, t in enumerate(cover)}
            w = p * use / (p * use).sum()
            terms.append(-sum(float(w[j]) * float(logq[col[t]]) for j, t in enumerate(tops) if use[j]))
    assert covered_extra > 0                    # labels the kept set alone would have dropped
    mean = sum(terms) / len(terms)
    assert abs(float(loss) - mean) < 1e-5 * abs(mean), (float(loss), mean)


@pytest.mark.parametrize("own_head, feature_norm", [(True, False), (False, True)],
                         ids=["own-lm-head", "target-lm-head-normed-layers"])
def test_training_lowers_the_loss_and_exports_a_head_the_engine_loads(smol, answered, tmp_path, monkeypatch, own_head,
                                                                     feature_norm):
    data, plan = tmp_path / "data", answered[1]
    shutil.copytree(answered[0], data)
    folders = [data]
    if not own_head:   # a second folder: other prompts, written by another seed, none of the first one's
        second = replace(plan, seed=1, written_prompts=0, magpie_prompts=2)
        with DataFolder(tmp_path / "more", second, smol.name) as folder:
            taken = eagle3_data.other_prompts([data])
            made = eagle3_data.build_prompts(folder, smol.fused, smol.tokenizer, 2, lambda m: None, None, taken)
            assert made["train"] and not {eagle3_data.normalized(p) for p in made["train"]} & taken
            eagle3_data.build_answers(folder, smol.fused, smol.tokenizer, 2, 10**9, lambda m: None, None)
        folders.append(tmp_path / "more")
    examples = [e for p in eagle3_folder.iter_shards(data) for e in eagle3_folder.load_shard(p, plan.fingerprint())]
    kept = eagle3_batch.kept_vocabulary(examples, 256, (2,))
    assert 2 in kept.tolist() and kept.tolist() == sorted(kept.tolist())
    index = torch.full((smol.vocab_size,), -1, dtype=torch.long)
    index[kept] = torch.arange(len(kept))
    batch = eagle3_batch.make_batch(examples[:4], index, 384)
    assert batch.valid.any() and torch.allclose(batch.label_p[batch.valid].sum(-1), torch.ones(int(batch.valid.sum())))

    logs, clock = [], [0.0]

    def tick() -> float:             # every read of the trainer's clock is one second later
        clock[0] += 1.0
        return clock[0]
    monkeypatch.setattr(eagle3, "time", SimpleNamespace(time=tick))
    plan = eagle3.Eagle3Plan(kept=256, depth=5, epochs=4, batch=4, warmup=2, lr=2e-3, log_every_s=0,
                             own_head=own_head, feature_norm=feature_norm, heldout_every=2)
    stopped = eagle3.train(smol, folders, tmp_path / "work", tmp_path / "head", plan, logs.append, deadline=40.0,
                           export_when_stopped=own_head)
    assert not stopped["finished"] and 0 < stopped["cursor"]["step"] and stopped["cursor"]["seconds"] > 0
    if own_head:   # exported as it stood, and its card says where it stopped; the checkpoint still resumes
        assert stopped["stopped"] == {"step": stopped["cursor"]["step"], "of": stopped["stopped"]["of"]}
        assert stopped["stopped"]["step"] < stopped["stopped"]["of"] and (tmp_path / "head" / "eagle.json").exists()
        eagle3_card.write_card(tmp_path / "head", "smollm2", {k: v for k, v in stopped.items() if k != "cursor"}, {},
                          "python -m engine train-eagle3 --minutes 1 --export-when-stopped", 1.0)
        assert f"stopped by its time limit at step {stopped['cursor']['step']:,} of" in \
            (tmp_path / "head" / "MODEL_CARD.md").read_text()
    else:
        assert "stopped" not in stopped and not (tmp_path / "head").exists()
    clock[0] += 1e6                  # a day between the runs: not training time
    if len(folders) > 1:             # a checkpoint is not resumed on other data
        with pytest.raises(eagle3_folder.DataError, match="rerun with the same --data"):
            eagle3.train(smol, folders[::-1], tmp_path / "work", tmp_path / "head", plan, logs.append)
    result = eagle3.train(smol, folders, tmp_path / "work", tmp_path / "head", plan, logs.append)
    shards = {f: sum(1 for _ in eagle3_folder.iter_shards(f)) for f in folders}
    assert [d["shards"] for d in result["data_folders"]] == [shards[data] - 2, *(shards[f] for f in folders[1:])]
    assert result["shards"] == sum(shards.values()) - 2                 # all but the held-out chunk's two passes
    eagle3_card.write_card(tmp_path / "head", "smollm2", {k: v for k, v in result.items() if k != "finished"}, {},
                      "python -m engine train-eagle3 --data x", 1.0)
    card = (tmp_path / "head" / "MODEL_CARD.md").read_text()
    magpie = sum(eagle3_folder.read_prompts(f)["sources"]["magpie"] for f in folders)
    assert f"prompts: {magpie:,} written by the target itself" in card
    for f in folders:                # each folder's command, and a line of its own where there are several
        assert eagle3_folder.data_command(f) in card and (f"`{f}` (seed" in card) == (len(folders) > 1)
    assert any(line.startswith(f"resumed at step {stopped['cursor']['step']}") for line in logs)
    assert result["finished"] and result["feature_layers"] == list(LAYERS)
    assert stopped["cursor"]["seconds"] < result["train_seconds"] < 1e6   # both runs counted, the pause not
    # one batch's loss is noisy (a step's batch may simply be harder): compare the first and last few steps, and
    # the held-out shard, the same sequences each time
    losses, heldout = [p["loss"] for p in result["log"]], [p["loss"] for p in result["heldout_log"]]
    quarter = max(1, len(losses) // 4)
    assert sum(losses[-quarter:]) < sum(losses[:quarter]) and heldout[-1] < heldout[0], (losses, heldout)
    # the held-out shard measured every 2 steps across the stop, then at the end, as the card reports it
    steps = [p["step"] for p in result["heldout_log"]]
    exported_at = {stopped["cursor"]["step"]} if own_head else set()   # an export measures where it stops
    assert steps == sorted({*range(2, result["steps"], 2), result["steps"], *exported_at}), steps
    assert result["heldout_log"][-1]["top1"] == result["heldout_top1_by_step"]
    assert len({round(p["loss"], 6) for p in result["heldout_log"]}) > 1   # measured each time, not copied
    assert "held-out top-1 during training" in "\n".join(eagle3_card.heldout_curve(result["heldout_log"]))
    if not own_head:   # the second folder replayed: a seeded share of its shards, the same on every run
        more = sorted(eagle3_folder.iter_shards(folders[1]))
        sample = eagle3_batch.replay_sample(more, 0.5, 0)
        assert len(sample) == round(0.5 * len(more)) and set(sample) < set(more)
        assert sample == eagle3_batch.replay_sample(more[::-1], 0.5, 0) != eagle3_batch.replay_sample(more, 0.5, 1)
        replayed = eagle3.train(smol, folders[:1], tmp_path / "replay", tmp_path / "replay-head",
                                replace(plan, epochs=0.25, heldout_every=0, replay_share=0.5), logs.append,
                                replay=folders[1:])
        assert [d["shards"] for d in replayed["data_folders"]] == [shards[data] - 2, len(sample)]
        assert replayed["data_folders"][1]["replay"] == 0.5 and "replay" not in replayed["data_folders"][0]
        assert "a 50% sample of its shards" in "\n".join(eagle3_card.folder_lines(replayed["data_folders"]))
        with pytest.raises(eagle3_folder.DataError, match="--replay"):   # its checkpoint resumes only on the same replay
            eagle3.train(smol, folders[:1], tmp_path / "replay", tmp_path / "replay-head",
                         replace(plan, epochs=0.25, heldout_every=0, replay_share=0.25), logs.append,
                         replay=folders[1:])
    if own_head:   # a warm start begins where the saved head ended, not where a random one begins
        warm = eagle3.train(smol, folders, tmp_path / "warm", tmp_path / "warm-head",
                            replace(plan, init=str(tmp_path / "head"), epochs=1, own_head=False,
                                    feature_norm=not feature_norm), logs.append)
        # the same first batch (same data, same seeded order) and the saved head's own options: a random start is
        # the first run itself, ratio 1; the warm one measured 0.68-0.91 (the data the target samples for the test
        # moves with the machine and the order the tests run in)
        assert warm["log"][0]["loss"] < 0.98 * result["log"][0]["loss"], (warm["log"][0], result["log"][0])
        # the saved head's choices win over the options, and the meta (so the card) says so
        assert (warm["plan"]["own_head"], warm["plan"]["feature_norm"]) == (True, feature_norm)
        assert list(warm["plan"]["layers"]) == list(LAYERS)
        # its card carries the saved head's history: what that one was trained on, and its commands first
        lineage = warm["init"]
        assert (lineage["steps"], lineage["tokens"], lineage["folder"]) == (result["steps"], result["tokens"],
                                                                              str(tmp_path / "head"))
        eagle3_card.write_card(tmp_path / "warm-head", "smollm2", {k: v for k, v in warm.items() if k != "finished"}, {},
                          "python -m engine train-eagle3 --init head", 1.0)
        card = (tmp_path / "warm-head" / "MODEL_CARD.md").read_text()
        assert f"`{tmp_path / 'head'}`, not at random: itself {result['steps']:,} steps" in card
        commands = json.loads((tmp_path / "warm-head" / "card.json").read_text())["commands"]
        assert commands[-2:] == ["python -m engine train-eagle3 --data x", "python -m engine train-eagle3 --init head"]
        assert eagle3_card.init_lineage(tmp_path / "nothing") is None
        with pytest.raises(eagle3_folder.DataError, match="fuses layers"):
            eagle3.train(smol, folders, tmp_path / "warm2", tmp_path / "warm-head",
                         replace(plan, init=str(tmp_path / "head"), layers=(2, 15, 30)), logs.append)
        with pytest.raises(eagle3_folder.DataError, match="--init: No usable EAGLE head"):
            eagle3.train(smol, folders, tmp_path / "warm3", tmp_path / "warm-head",
                         replace(plan, init=str(tmp_path / "nothing")), logs.append)
    runtime = load_runtime(tmp_path / "head", smol)
    assert runtime.config.feature_layers == LAYERS and runtime.config.own_head == own_head
    assert runtime.config.feature_norm == feature_norm and hasattr(runtime.head, "fuse_norm") == feature_norm
    if not own_head:   # nothing of the LM head was trained or exported: the drafts read the target's rows
        assert "lm" not in runtime.head.state_dict()
        assert torch.equal(runtime.head_weight, smol.fused.lm_head.index_select(0, runtime.kept_ids))
    ids = encode_chat(smol.tokenizer, ChatPrompt("Name a colour."))
    engine = SpeculativeEngine(ModelPair(smol, None, runtime), ids,
                               SpecConfig(drafter=DrafterKind.EAGLE, k=4, max_new_tokens=12, record=False))
    engine.run()
    alone = SpeculativeEngine(ModelPair(smol, None, runtime), ids,
                              SpecConfig(mode=Mode.TARGET, max_new_tokens=12, record=False))
    alone.run()
    assert engine.generated == alone.generated


def test_the_batch_stream_covers_each_epoch_once_and_resumes_at_its_cursor(tmp_path):
    paths = [tmp_path / f"shard-{i}.pt" for i in range(5)]
    sizes = {p: 2 + i for i, p in enumerate(paths)}   # 2..6 sequences a shard
    reads = []

    def read(path):
        reads.append(path)
        return [f"{path.stem}/{j}" for j in range(sizes[path])]

    plan = eagle3.Eagle3Plan(batch=3, seed=4)
    stream = eagle3_batch.chunks(paths, plan, 0, 0, read)
    items = [next(stream) for _ in range(40)]
    stream.close()
    epoch0 = [seq for seqs, epoch, _ in items if epoch == 0 for seq in seqs]
    assert sorted(epoch0) == sorted(f"{p.stem}/{j}" for p in paths for j in range(sizes[p]))   # each sequence once
    assert all(0 < len(seqs) <= 3 and len({s.split("/")[0] for s in seqs}) == 1 for seqs, _, _ in items)
    epochs = [[seqs for seqs, epoch, _ in items if epoch == e] for e in (0, 1)]
    assert epochs[0] != epochs[1]                       # another seeded order, shard by shard and within shards
    # each shard read once an epoch: the one read ahead is used, not read again (the next one may be read ahead)
    assert len(reads) - len({(e, s) for _, e, s in items}) in (0, 1)
    # a run stopped after any item resumes, from the cursor that item leaves, with the first batch of the next shard
    for i, (_, epoch, shard) in enumerate(items[:-8]):
        nxt = next(j for j in range(i + 1, len(items)) if items[j][1:] != (epoch, shard))
        resumed = eagle3_batch.chunks(paths, plan, epoch, shard, read)
        assert [next(resumed) for _ in range(5)] == items[nxt: nxt + 5]
        resumed.close()


def test_a_shard_damaged_after_it_was_made_stops_training_with_its_name(smol, answered, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(answered[0], data)
    shards = sorted(eagle3_folder.iter_shards(data))
    damaged = shards[-1]                                   # a training shard (the first chunk is held out)
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])   # cut short, its sidecar kept
    plan = eagle3.Eagle3Plan(kept=256, depth=2, epochs=1, batch=4, warmup=1, heldout_every=0, log_every_s=0)
    logs = []
    with pytest.raises(eagle3_folder.DataError, match=f"{damaged.name} cannot be read"):
        eagle3.train(smol, [data], tmp_path / "work", tmp_path / "head", plan, logs.append)
    assert not (tmp_path / "head").exists()


def test_fitted_steps_end_the_schedule_before_the_deadline():
    assert eagle3_plan.fitted_steps(100, 10_000, 10.0, 300.0) == 100 + 2850          # 15 s kept for the export
    assert eagle3_plan.fitted_steps(100, 10_000, 10.0, 600.0) == 100 + 5700          # a twentieth kept
    assert eagle3_plan.fitted_steps(100, 10_000, 10.0, 2000.0) == 10_000              # the plan's, at most
    assert eagle3_plan.fitted_steps(100, 1_000, 10.0, 10.0) == 101                    # no time left: one more step
    assert eagle3_plan.fitted_steps(100, 150, 10.0, 3600.0) == 150                    # it fits already: the plan's


def test_a_schedule_fitted_to_the_time_limit_ends_its_decay_there(smol, answered, tmp_path, monkeypatch):
    """`--fit`: the run measures its rate after the warm-up, shortens the cosine schedule to what it reaches by the
    deadline, and finishes there (not stopped part-way), its last steps at the schedule's floor; a resumed run
    keeps the fitted length, and the card says so."""
    data = tmp_path / "data"
    shutil.copytree(answered[0], data)
    clock = [0.0]

    def tick() -> float:             # every read of the trainer's clock is one second later
        clock[0] += 1.0
        return clock[0]
    monkeypatch.setattr(eagle3, "time", SimpleNamespace(time=tick))
    plan = eagle3.Eagle3Plan(kept=256, depth=2, epochs=40, batch=2, warmup=2, lr=2e-3, log_every_s=0,
                             heldout_every=0)
    lrs = []
    real_step = torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        lrs.append(self.param_groups[0]["lr"])
        return real_step(self, *args, **kwargs)
    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    logs = []
    result = eagle3.train(smol, [data], tmp_path / "work", tmp_path / "head", plan, logs.append, deadline=400.0,
                          export_when_stopped=True, fit=True)
    fitted = result["fitted"]
    assert result["finished"] and "stopped" not in result, result.get("stopped")
    assert 22 < fitted["steps"] < fitted["planned"] and result["steps"] == fitted["steps"] == len(lrs)
    assert lrs[-1] == pytest.approx(0.1 * plan.lr, rel=0.02) and max(lrs) == pytest.approx(plan.lr, rel=0.05)
    assert any(line.startswith("schedule fitted to the time limit") for line in logs)
    eagle3_card.write_card(tmp_path / "head", "smollm2", {k: v for k, v in result.items() if k != "finished"}, {},
                      "python -m engine train-eagle3 --minutes 5 --fit", 1.0)
    assert f"fitted to the time limit (`--fit`): {fitted['steps']:,} steps of the {fitted['planned']:,}" in \
        (tmp_path / "head" / "MODEL_CARD.md").read_text()
    again = eagle3.train(smol, [data], tmp_path / "work", tmp_path / "head", plan, logs.append, deadline=1e9, fit=True)
    assert again["fitted"] == fitted and again["steps"] == fitted["steps"]   # resumed finished: nothing more


def test_the_feature_loss_regresses_step_one_onto_the_next_post_norm_feature(smol, tmp_path):
    """`--feature-weight w` adds w × smooth-L1(step 1's output at t, the top fused layer's input at t + 1) over
    answer positions, and nothing else; `--noise` perturbs the inputs only while training; a top layer that is
    not the post-norm output is refused with a sentence."""
    d, n = smol.model.config.hidden_size, 6
    config = replace(EagleConfig.for_target(smol, 64), feature_layers=(2, 30), own_head=True)
    head = EagleHead(config)
    head.init_for_training(torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        head.fuse.weight.normal_(0, 0.05, generator=gen)   # training starts both near zero: let them count
        head.lm.normal_(0, 0.05, generator=gen)
    valid = torch.tensor([[False, True, True, True, True, False]])
    batch = eagle3_batch.Batch(emb_ids=torch.randint(0, 500, (1, n), generator=gen),
                         feats=torch.randn(1, n, 2 * d, generator=gen), label_ids=torch.randint(0, 64, (1, n, 4), generator=gen),
                         label_p=torch.full((1, n, 4), 0.25), valid=valid)
    embed = smol.model.get_input_embeddings().weight.detach().float()
    cos, sin = target_rope(smol, config.head_dim, n + 1)
    cos, sin = cos[1: n + 1], sin[1: n + 1]
    plan = eagle3.Eagle3Plan(kept=64, depth=2)
    with torch.no_grad():
        plain, _ = eagle3_loss.unrolled_loss(head, batch, embed, plan, cos, sin, head.lm)
        weighted, _ = eagle3_loss.unrolled_loss(head, batch, embed, replace(plan, feature_weight=0.5), cos, sin, head.lm)
        emb = torch.nn.functional.embedding(batch.emb_ids, embed)
        step1 = next(eagle3_loss.unrolled(head, emb, batch.feats, 1, cos, sin))
        rows = torch.tensor([False, True, True, True, False])          # t and t + 1 both answer positions
        by_hand = torch.nn.functional.smooth_l1_loss(step1[0, :-1][rows], batch.feats[0, 1:, -d:][rows])
        assert torch.allclose(weighted - plain, 0.5 * by_hand, rtol=1e-5)
        torch.manual_seed(0)
        noisy, _ = eagle3_loss.unrolled_loss(head, batch, embed, replace(plan, noise=0.05), cos, sin, head.lm)
        assert noisy != plain
    (tmp_path / "plan.json").write_text('{"fingerprint": "f", "plan": {"layers": [2, 15, 27]}}')
    (tmp_path / "prompts.json").write_text("{}")          # a folder with answers: the options are what is refused
    (tmp_path / "answers").mkdir()
    (tmp_path / "answers" / "shard-p0-00000.pt").write_bytes(b"")
    with pytest.raises(eagle3_folder.DataError, match="top fused layer must be 30"):
        eagle3.train(smol, tmp_path, tmp_path / "work", tmp_path / "head",
                     eagle3.Eagle3Plan(layers=(2, 15, 27), feature_weight=0.1), print)


@pytest.mark.parametrize("argv, words", [(["--lr", "0"], "lr > 0"), (["--depth", "0"], "depth >= 1"),
                                         (["--layers", "2,x"], "--layers takes layer numbers"),
                                         (["--device", "gpu"], "unknown device 'gpu'; use cpu, cuda or cuda:N"),
                                         (["--device", "cuda:7"], "device cuda:7 is not available"),
                                         (["--fit"], "give both")])
def test_bad_training_options_get_a_sentence_before_any_model_loads(argv, words, capsys, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("the target was loaded before the options were checked")

    monkeypatch.setattr(eagle3, "command_start", no_loading)
    assert eagle3.main(argv) == 2
    assert words in capsys.readouterr().err

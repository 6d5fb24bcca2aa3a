"""The data and training commands on a GPU (`--device cuda`): what they make is what the CPU makes.

Skipped where torch sees no CUDA device (CI); run them on a GPU machine with `pytest tests/test_cuda.py`."""
from __future__ import annotations

from dataclasses import asdict, replace
from types import SimpleNamespace

import pytest
import torch

from engine.models import load_model
from engine.prompts import ChatPrompt, encode_chat
from engine.sources import SMOLLM2, SMOLLM2_PIP, smollm2_gguf
from engine.train import data_pack, eagle3, eagle3_batch, eagle3_folder, eagle3_loss
from engine.train import eagle3_data as data
from engine.train.draft_data import SamplingPass
from engine.train.eagle3_folder import DataFolder, Eagle3DataPlan

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
              pytest.mark.skipif(smollm2_gguf() is None, reason=f"the SmolLM2 wheel is not installed ({SMOLLM2_PIP})")]
QUESTIONS = ("Why is the sky blue?", "Name a bird.", "What does a compiler do in one sentence?",
             "Write a haiku about rain.")


@pytest.fixture(scope="module")
def gpu_smol():
    return load_model(SMOLLM2, device="cuda", dtype="float32")


def plan(**overrides) -> Eagle3DataPlan:
    base = dict(magpie_prompts=6, prompt_batch=8, prompt_max_tokens=40, answer_batch=4, max_new_tokens=16, top_k=8,
                written_prompts=6)
    return Eagle3DataPlan(**{**base, **overrides}).for_model(30)


def close_features(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a.float() - b.float()).abs().max() < 2e-3 * b.float().abs().max() + 1e-2)


@pytest.mark.parametrize("sampling", [SamplingPass(), SamplingPass(0.7, 0.95)], ids=["greedy", "sampled"])
def test_gpu_answers_are_the_cpu_answers(smol, gpu_smol, sampling):
    """Both in float32 and from the same CPU generator: the same tokens (a summation order may flip a near-tie, so
    three of four answers must agree whole), and where they agree the same features and soft labels."""
    p = plan()
    prompts = [encode_chat(smol.tokenizer, ChatPrompt(q)) for q in QUESTIONS]
    on_cpu = data.answer_batch(smol.fused, prompts, sampling, p, 2, seed=5)
    on_gpu = data.answer_batch(gpu_smol.fused, prompts, sampling, p, 2, seed=5)
    same = [c for c, g in zip(on_cpu, on_gpu) if torch.equal(c.ids, g.ids)]
    assert len(same) >= 3, [(c.ids.tolist(), g.ids.tolist()) for c, g in zip(on_cpu, on_gpu)]
    for c, g in zip(on_cpu, on_gpu):
        assert g.check() is None and g.features.device.type == "cpu" and g.top_ids.device.type == "cpu"
        if torch.equal(c.ids, g.ids):
            assert close_features(g.features, c.features)
            assert (g.top_ids[:, 0] == c.top_ids[:, 0]).float().mean() > 0.95
            assert (g.top_logp[:, 0].float() - c.top_logp[:, 0].float()).abs().max() < 2e-2


def test_a_gpu_rebuild_from_the_pack_is_the_cpu_one(smol, gpu_smol, tmp_path):
    """A folder made on the CPU, packed, and rebuilt on the GPU (many rows at once): the same sequences, features
    within float rounding, the same top-1 labels."""
    p = plan()
    with DataFolder(tmp_path / "cpu", p, smol.name) as folder:
        data.build_prompts(folder, smol.fused, smol.tokenizer, 2, lambda m: None, None)
        data.build_answers(folder, smol.fused, smol.tokenizer, 2, 10**9, lambda m: None, None)
        data_pack.save_pack(folder, tmp_path / "pack", lambda m: None)
    assert data_pack.replay_rows(gpu_smol.fused) > data_pack.replay_rows(smol.fused)
    with DataFolder(tmp_path / "gpu", p, smol.name) as folder:
        rebuilt = data_pack.restore(folder, tmp_path / "pack", gpu_smol.fused, lambda m: None)
    shards = sorted(eagle3_folder.iter_shards(tmp_path / "cpu"))
    assert rebuilt == len(shards) > 0
    for path in shards:
        made = eagle3_folder.load_shard(path, p.fingerprint())
        again = eagle3_folder.load_shard(tmp_path / "gpu" / "answers" / path.name, p.fingerprint())
        for m, a in zip(made, again, strict=True):
            assert torch.equal(m.ids, a.ids) and m.prompt_len == a.prompt_len
            assert close_features(a.features, m.features)
            assert (a.top_ids[:, 0] == m.top_ids[:, 0]).float().mean() > 0.95


def test_a_head_trains_on_the_gpu_and_resumes_on_the_cpu(smol, gpu_smol, tmp_path, monkeypatch):
    """One batch's loss is the CPU's on the GPU; a run stopped on the GPU (its post-norm layer, which the data did
    not keep, computed by the target there) resumes on the CPU (its checkpoint holds CPU tensors), its loss falls,
    and the export is a head the engine loads."""
    p = plan(answer_batch=2, max_new_tokens=12)
    with DataFolder(tmp_path / "data", p, smol.name) as folder:
        data.build_prompts(folder, smol.fused, smol.tokenizer, 2, lambda m: None, None)
        data.build_answers(folder, smol.fused, smol.tokenizer, 2, 10**9, lambda m: None, None)
    examples = [e for path in eagle3_folder.iter_shards(tmp_path / "data") for e in eagle3_folder.load_shard(path, p.fingerprint())]
    kept = eagle3_batch.kept_vocabulary(examples, 256, (2,))
    index = torch.full((smol.vocab_size,), -1, dtype=torch.long)
    index[kept] = torch.arange(len(kept))
    train_plan = eagle3.Eagle3Plan(kept=256, depth=4, epochs=4, batch=4, warmup=2, lr=2e-3, log_every_s=0,
                                   heldout_every=0, layers=(2, 15, 30))
    from engine.drafters.eagle import EagleConfig, EagleHead
    from engine.train.eagle import target_rope

    config = EagleConfig(**{**asdict(EagleConfig.for_target(smol, len(kept))), "feature_layers": p.layers,
                            "own_head": True})
    head = EagleHead(config)
    head.init_for_training(torch.Generator().manual_seed(0))
    batch = eagle3_batch.make_batch(examples[:4], index, 384)
    n = batch.emb_ids.shape[1]
    cos, sin = target_rope(smol, config.head_dim, n + 1)
    embed = smol.model.get_input_embeddings().weight.detach().float()
    losses = {}
    for device in ("cpu", "cuda"):
        moved = head.to(device)
        loss, _ = eagle3_loss.unrolled_loss(moved, batch.to(torch.device(device)), embed.to(device), train_plan,
                                       cos[1: n + 1].to(device), sin[1: n + 1].to(device), moved.lm)
        losses[device] = float(loss)
    assert abs(losses["cpu"] - losses["cuda"]) < 1e-3 * abs(losses["cpu"]) + 1e-4, losses

    clock = [0.0]

    def tick() -> float:
        clock[0] += 1.0
        return clock[0]
    monkeypatch.setattr(eagle3, "time", SimpleNamespace(time=tick))
    logs = []
    stopped = eagle3.train(gpu_smol, [tmp_path / "data"], tmp_path / "work", tmp_path / "head", train_plan, logs.append,
                           deadline=25.0, device="cuda")
    assert not stopped["finished"] and stopped["cursor"]["step"] > 0
    saved = torch.load(tmp_path / "work" / "checkpoint.pt", weights_only=False)
    assert all(t.device.type == "cpu" for t in saved["head"].values())
    result = eagle3.train(smol, [tmp_path / "data"], tmp_path / "work", tmp_path / "head", train_plan, logs.append)
    losses = [p["loss"] for p in result["log"]]   # a quarter of the steps each end: one batch's loss is noisy
    quarter = max(1, len(losses) // 4)
    assert result["finished"] and sum(losses[-quarter:]) < sum(losses[:quarter]), losses
    from engine.drafters.eagle import read_head

    loaded, kept_ids = read_head(tmp_path / "head")
    assert 0 < len(kept_ids) <= 256 and all(torch.isfinite(t).all() for t in loaded.state_dict().values())
    warm = eagle3.train(gpu_smol, [tmp_path / "data"], tmp_path / "warm", tmp_path / "warm-head",
                        replace(train_plan, init=str(tmp_path / "head"), epochs=1), logs.append, device="cuda")
    assert warm["finished"] and warm["log"][0]["loss"] < result["log"][0]["loss"]

"""Trains the built-in offline pair (tokenizer, target, draft) on the stdlib corpus, resumably.

`python -m engine train-builtin` rebuilds everything in assets/builtin from scratch. Phases:
1. tokenizer: byte-level BPE on the training split;
2. joint: the target learns next-token prediction while the draft is distilled from it online
   (cross-entropy first, then mostly KL to the target's distribution, which is what raises
   greedy acceptance; plain cross-entropy roughly halves it);
3. distill: the target is frozen and the draft keeps distilling.
A checkpoint is written every couple of minutes; rerunning the command resumes from it.
"""
from __future__ import annotations

import json
import math
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.sources import BUILTIN_DIR, REPO_ROOT
from engine.train import corpus
from engine.train.builtin_eval import greedy_acceptance, heldout_loss

WORK_DIR = REPO_ROOT / ".cache" / "train-builtin"


@dataclass(frozen=True, slots=True)
class LlamaShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    mlp: int

    def config(self, vocab_size: int, max_positions: int, eos_id: int):
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=vocab_size, hidden_size=self.hidden, num_hidden_layers=self.layers,
            num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
            intermediate_size=self.mlp, tie_word_embeddings=True,
            max_position_embeddings=max_positions, rope_theta=10000.0,
            bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
        )


@dataclass(frozen=True, slots=True)
class TrainPlan:
    vocab_size: int = 4096
    seq_len: int = 256
    max_positions: int = 1024
    batch: int = 16
    target: LlamaShape = field(default_factory=lambda: LlamaShape(384, 8, 6, 2, 1024))
    draft: LlamaShape = field(default_factory=lambda: LlamaShape(256, 1, 4, 2, 1024))
    joint_steps: int = 1200
    distill_steps: int = 900
    lr_target: float = 2e-3
    lr_draft: float = 3e-3
    warmup_steps: int = 60
    kl_weight: float = 0.9
    kl_ramp_fraction: float = 0.25
    seed: int = 0
    compile: bool = True
    checkpoint_every_s: float = 120.0
    export_every_steps: int = 400

    def __post_init__(self) -> None:
        if self.joint_steps < 1 or self.distill_steps < 0:
            raise ValueError("joint_steps must be >= 1 and distill_steps >= 0")


# ---------------------------------------------------------------------------- data

def load_or_build_data(plan: TrainPlan, work: Path, log) -> tuple[object, torch.Tensor, torch.Tensor]:
    """Tokenizer plus train/held-out token streams, cached under `work`."""
    from tokenizers import Tokenizer

    tok_path, data_path = work / "tokenizer.json", work / "streams.pt"
    if tok_path.exists() and data_path.exists():
        streams = torch.load(data_path)
        return Tokenizer.from_file(str(tok_path)), streams["train"], streams["heldout"]
    t0 = time.perf_counter()
    train_files = corpus.list_sources("train")
    heldout_files = corpus.list_sources("heldout")
    log(f"corpus: {len(train_files)} train files, {len(heldout_files)} held-out files "
        f"under {corpus.stdlib_root()}")
    tok = corpus.train_tokenizer(train_files, plan.vocab_size)
    eos = tok.token_to_id(corpus.EOS_TOKEN)
    train = corpus.encode_stream(tok, train_files, eos)
    heldout = corpus.encode_stream(tok, heldout_files, eos)
    work.mkdir(parents=True, exist_ok=True)
    tok.save(str(tok_path))
    torch.save({"train": train, "heldout": heldout}, data_path)
    log(f"tokenizer + streams in {time.perf_counter() - t0:.0f}s: "
        f"{len(train):,} train tokens, {len(heldout):,} held-out tokens")
    return tok, train, heldout


def batch_at(stream: torch.Tensor, step: int, plan: TrainPlan, salt: int = 0) -> torch.Tensor:
    """Random windows of seq_len+1 tokens; a pure function of (seed, step) so resume is exact."""
    g = torch.Generator().manual_seed(plan.seed * 1_000_003 + step * 7 + salt)
    starts = torch.randint(0, len(stream) - plan.seq_len - 1, (plan.batch,), generator=g)
    return torch.stack([stream[s : s + plan.seq_len + 1] for s in starts.tolist()]).long()


def fixed_windows(stream: torch.Tensor, count: int, length: int, seed: int = 1234) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(stream) - length, (count,), generator=g)
    return torch.stack([stream[s : s + length] for s in starts.tolist()]).long()


# ---------------------------------------------------------------------------- schedule

def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def draft_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor, labels: torch.Tensor,
               kl_weight: float) -> torch.Tensor:
    """kl_weight * KL(p_target || q_draft) + (1 - kl_weight) * CE(labels)."""
    ce = F.cross_entropy(draft_logits.flatten(0, 1), labels.flatten())
    if kl_weight == 0.0:
        return ce
    kl = F.kl_div(F.log_softmax(draft_logits, -1).flatten(0, 1),
                  F.log_softmax(target_logits.detach(), -1).flatten(0, 1),
                  log_target=True, reduction="batchmean")
    return kl_weight * kl + (1 - kl_weight) * ce


# ---------------------------------------------------------------------------- evaluation


@torch.inference_mode()
def _alpha(target, draft, tokenizer, prompts: torch.Tensor) -> float:
    """Greedy alpha at K=4 of the models being trained, measured by the engine itself (over the
    transformers forward: the fused one would re-lay the weights the optimiser is updating)."""
    from transformers import PreTrainedTokenizerFast

    from engine.models import LoadedModel
    from engine.pair import ModelPair

    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=corpus.EOS_TOKEN)
    pair = ModelPair(LoadedModel.of("training:target", target, wrapped, fuse=False),
                     LoadedModel.of("training:draft", draft, wrapped, fuse=False))
    target.eval(), draft.eval()
    return greedy_acceptance(pair, prompts, k=4, new_tokens=48, fused=False).alpha


# ---------------------------------------------------------------------------- export

def hf_tokenizer(tok):
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    eos = corpus.EOS_TOKEN
    # Prompts start like a file does in the training stream: right after an end-of-text.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{eos} $A", pair=f"{eos} $A {eos} $B", special_tokens=[(eos, tok.token_to_id(eos))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=eos, eos_token=eos,
                                   pad_token=eos, model_max_length=1024, clean_up_tokenization_spaces=False)


def export_pair(target, draft, tok, out: Path, meta: dict) -> None:
    """save_pretrained both models (fp16 weights) and the shared tokenizer; swap in atomically."""
    import copy

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    hf_tok = hf_tokenizer(tok)
    for name, model in (("target", target), ("draft", draft)):
        m = copy.deepcopy(model).to(torch.float16)
        m.generation_config.pad_token_id = m.config.eos_token_id
        m.save_pretrained(tmp / name, max_shard_size="15MB")  # shards under 20 MiB keep git happy
        hf_tok.save_pretrained(tmp / name)
    (tmp / "training.json").write_text(json.dumps(meta, indent=2) + "\n")
    if (out / "MODEL_CARD.md").exists():
        shutil.copy(out / "MODEL_CARD.md", tmp / "MODEL_CARD.md")
    backup = out.with_name(out.name + ".old")
    shutil.rmtree(backup, ignore_errors=True)
    if out.exists():
        out.rename(backup)
    tmp.rename(out)
    shutil.rmtree(backup, ignore_errors=True)


# ---------------------------------------------------------------------------- training

def adapt_threads() -> None:
    """Use one thread while other work shares the 2 cores: two OpenMP threads fighting a third
    process for cores run slower than one thread with a core to itself."""
    import os

    others = os.getloadavg()[0] - torch.get_num_threads()
    want = 1 if others > 0.7 else 2
    if want != torch.get_num_threads():
        torch.set_num_threads(want)


def build_models(plan: TrainPlan, eos_id: int):
    from transformers import LlamaForCausalLM

    torch.manual_seed(plan.seed)
    target = LlamaForCausalLM(plan.target.config(plan.vocab_size, plan.max_positions, eos_id))
    draft = LlamaForCausalLM(plan.draft.config(plan.vocab_size, plan.max_positions, eos_id))
    return target, draft


def train(plan: TrainPlan, out: Path = BUILTIN_DIR, work: Path = WORK_DIR, fresh: bool = False) -> None:
    torch.set_num_threads(2)
    if fresh:
        shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    log_file = (work / "train.log").open("a")

    def log(msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    tok, train_stream, heldout_stream = load_or_build_data(plan, work, log)
    eos = tok.token_to_id(corpus.EOS_TOKEN)
    target, draft = build_models(plan, eos)
    opt_t = torch.optim.AdamW(target.parameters(), lr=plan.lr_target, betas=(0.9, 0.95), weight_decay=0.1)
    opt_d = torch.optim.AdamW(draft.parameters(), lr=plan.lr_draft, betas=(0.9, 0.95), weight_decay=0.1)
    ckpt_path = work / "checkpoint.pt"
    step = 0
    if ckpt_path.exists():
        ck = torch.load(ckpt_path, weights_only=False)
        steps_only = {"joint_steps", "distill_steps"}
        old_plan = {k: v for k, v in ck["plan"].items() if k not in steps_only}
        if old_plan != {k: v for k, v in asdict(plan).items() if k not in steps_only}:
            raise SystemExit(f"{ckpt_path} was written by a different plan; rerun with --fresh")
        if ck["plan"]["joint_steps"] != plan.joint_steps and ck["step"] > plan.joint_steps:
            raise SystemExit(f"{ckpt_path} is already past {plan.joint_steps} joint steps")
        if ck["plan"] != asdict(plan):
            # Only the step budget changed: the cosine schedule continues from here on the new length.
            log(f"step budget changed from {ck['plan']['joint_steps']}+{ck['plan']['distill_steps']} "
                f"to {plan.joint_steps}+{plan.distill_steps}")
        target.load_state_dict(ck["target"]), draft.load_state_dict(ck["draft"])
        opt_t.load_state_dict(ck["opt_t"]), opt_d.load_state_dict(ck["opt_d"])
        step = ck["step"]
        log(f"resumed at step {step}")
    n_t = sum(p.numel() for p in target.parameters())
    n_d = sum(p.numel() for p in draft.parameters())
    log(f"target {n_t / 1e6:.1f}M params, draft {n_d / 1e6:.2f}M params; plan {asdict(plan)}")

    fwd_t, fwd_d = target, draft
    if plan.compile:
        fwd_t, fwd_d = torch.compile(target), torch.compile(draft)
    eval_windows = fixed_windows(heldout_stream, 32, plan.seq_len + 1)
    alpha_prompts = fixed_windows(heldout_stream, 48, 64, seed=99)
    total = plan.joint_steps + plan.distill_steps
    tokens_per_step = plan.batch * plan.seq_len
    last_ckpt = time.perf_counter()
    t_start, step_start = time.perf_counter(), step

    def save(final: bool = False) -> None:
        torch.save({"plan": asdict(plan), "step": step, "target": target.state_dict(),
                    "draft": draft.state_dict(), "opt_t": opt_t.state_dict(),
                    "opt_d": opt_d.state_dict()}, work / "checkpoint.tmp")
        (work / "checkpoint.tmp").replace(ckpt_path)

    def evaluate_and_export() -> dict:
        t0 = time.perf_counter()
        meta = {"step": step, "tokens_seen_target": min(step, plan.joint_steps) * tokens_per_step,
                "tokens_seen_draft": step * tokens_per_step,
                "heldout_loss_target": heldout_loss(target, eval_windows),
                "heldout_loss_draft": heldout_loss(draft, eval_windows),
                "greedy_alpha_k4": _alpha(target, draft, tok, alpha_prompts),
                "plan": asdict(plan)}
        export_pair(target, draft, tok, out, meta)
        target.train(), draft.train()
        log(f"eval+export step {step}: target loss {meta['heldout_loss_target']:.3f}, draft loss "
            f"{meta['heldout_loss_draft']:.3f}, greedy alpha@4 {meta['greedy_alpha_k4']:.3f} "
            f"({time.perf_counter() - t0:.0f}s) -> {out}")
        return meta

    target.train(), draft.train()
    while step < total:
        x = batch_at(train_stream, step, plan)
        inputs, labels = x[:, :-1], x[:, 1:]
        joint = step < plan.joint_steps
        if joint:
            for g in opt_t.param_groups:
                g["lr"] = lr_at(step, plan.joint_steps, plan.lr_target, plan.warmup_steps)
            t_logits = fwd_t(input_ids=inputs).logits
            t_loss = F.cross_entropy(t_logits.flatten(0, 1), labels.flatten())
            opt_t.zero_grad(set_to_none=True)
            t_loss.backward()
            torch.nn.utils.clip_grad_norm_(target.parameters(), 1.0)
            opt_t.step()
            ramp = min(1.0, step / max(1, plan.kl_ramp_fraction * plan.joint_steps))
            kl_w = plan.kl_weight * ramp
        else:
            with torch.no_grad():
                target.eval()
                t_logits = fwd_t(input_ids=inputs).logits
            t_loss = torch.tensor(float("nan"))
            kl_w = plan.kl_weight
        for g in opt_d.param_groups:
            g["lr"] = lr_at(step, total, plan.lr_draft, plan.warmup_steps)
        d_loss = draft_loss(fwd_d(input_ids=inputs).logits, t_logits, labels, kl_w)
        opt_d.zero_grad(set_to_none=True)
        d_loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt_d.step()
        step += 1

        if step % 10 == 0:
            adapt_threads()
        if step % 10 == 0 or step == total:
            rate = (step - step_start) * tokens_per_step / (time.perf_counter() - t_start)
            eta = (total - step) * tokens_per_step / max(rate, 1e-9) / 60
            log(f"step {step}/{total} [{'joint' if joint else 'distill'}] target {t_loss.item():.3f} "
                f"draft {d_loss.item():.3f} kl_w {kl_w:.2f} | {rate:,.0f} tok/s, eta {eta:.0f} min")
        if time.perf_counter() - last_ckpt > plan.checkpoint_every_s:
            save()
            last_ckpt = time.perf_counter()
        if step % plan.export_every_steps == 0 or step == plan.joint_steps:
            save()
            evaluate_and_export()
    save()
    meta = evaluate_and_export()
    log(f"done: {json.dumps({k: v for k, v in meta.items() if k != 'plan'})}")


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m engine train-builtin",
                                 description="Rebuild the built-in tokenizer, target and draft from the stdlib corpus "
                                             "(resumes from .cache/train-builtin unless --fresh).")
    defaults = TrainPlan()
    ap.add_argument("--joint-steps", type=int, default=defaults.joint_steps,
                    help="steps training the target (draft distilled online alongside)")
    ap.add_argument("--distill-steps", type=int, default=defaults.distill_steps,
                    help="further steps distilling the draft from the frozen target")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    ap.add_argument("--fresh", action="store_true", help="discard the checkpoint and start over")
    ap.add_argument("--out", type=Path, default=BUILTIN_DIR, help="where the pair is exported")
    ap.add_argument("--work", type=Path, default=WORK_DIR, help="checkpoint and data cache")
    a = ap.parse_args(argv)
    plan = TrainPlan(joint_steps=a.joint_steps, distill_steps=a.distill_steps, compile=not a.no_compile)
    train(plan, out=a.out, work=a.work, fresh=a.fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main())

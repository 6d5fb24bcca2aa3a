"""The EAGLE-style feature drafter: one small decoder layer that drafts from the target's own features.

Every target forward already computes the post-norm feature f_t of each row (the vector its LM head
reads). The head predicts the next feature from the current one and the next token's embedding
(Li et al. 2024, "EAGLE"):

    draft position t:  x = fc([embed(x_t); f_{t-1}])  ->  one Llama decoder layer  ->  RMSNorm  ->  f^_t
                       q(x_{t+1}) = softmax(head_kept(f^_t))

so a chain of K drafts costs K passes through one layer plus a pruned head, with the target's
embedding matrix and a slice of its LM head reused (nothing of the head is stored but its own layer).
The first draft of a round reads the real feature of the token before the last committed one; later
drafts read the head's own predictions. After verification the accepted tokens' real features (rows
of the verify forward) replace the predictions: the head's cache is rolled back to the last position
whose input was real, and the next round feeds the rest at once.

Pruned head (FR-Spec, Zhao et al. 2025): q is a distribution over the `kept` most frequent tokens of the
target's own outputs and exactly 0 elsewhere. Sampling stays lossless: a token outside the kept set is
never drafted, and the residual max(0, p - q) still covers it. A head that reads the target's LM head also
scores the tokens of its sequence's context outside the kept set (`DraftVocabulary`): a prompt's subject
words ("yolk", "Canberra") are rare in the data, so never kept, yet the target repeats them.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine.clock import ForwardTimer, Now, native_bf16
from engine.config import DrafterKind, TreeSpec
from engine.drafters.base import DraftCache, DraftSteps, Proposal, TreeProposal, drive
from engine.fused_llama import (
    BlockedWeights,
    CodedWeights,
    DraftCodes,
    _rms_norm,
    attend_with,
    decoder_layer,
    segmented_attend,
)
from engine.kv_cache import KVPool, KVShape, PagedCache
from engine.models import LoadedModel
from engine.runner import pool_blocks
from engine.sampling import SamplingParams, draw_uniform, greedy_ids, logits_to_probs, one_hot_rows, sample_from
from engine.sources import eagle_folder
from engine.tree import CopyAt, DraftTree, Weigh, attention_mask, grow

EAGLE_FORMAT = 1
WEIGHTS, CONFIG = "head.safetensors", "eagle.json"


class EagleLoadError(RuntimeError):
    """An EAGLE head cannot be loaded for this target; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class EagleConfig:
    """The head's shape and what it was trained for."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rms_eps: float
    kept: int                  # size of the pruned vocabulary
    target: str                # the target it reads the features of (its LoadedModel name)
    target_vocab: int
    format: int = EAGLE_FORMAT
    feature_layers: tuple[int, ...] = ()   # EAGLE-3 style: the target layers whose inputs it fuses (L, one past
                                           # the last layer: the post-norm output); () = the post-norm output alone
    own_head: bool = False                 # its own trained LM head over the kept vocabulary (else the target's)
    feature_norm: bool = False             # each fused layer RMS-normalised, with a weight of its own, before the
                                           # fusion (the raw residual streams carry outliers in the tens of thousands)

    def __post_init__(self) -> None:
        object.__setattr__(self, "feature_layers", tuple(self.feature_layers))

    @property
    def style(self) -> str:
        """How the UI and the bench name the head: 'EAGLE-3 style' (fused layers, own head) or 'EAGLE'."""
        return "EAGLE-3 style" if self.feature_layers else "EAGLE"

    @staticmethod
    def for_target(target: LoadedModel, kept: int) -> "EagleConfig":
        c = target.model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return EagleConfig(c.hidden_size, c.num_attention_heads, getattr(c, "num_key_value_heads", None)
                           or c.num_attention_heads, head_dim, c.intermediate_size, float(c.rms_norm_eps),
                           kept, target.name, target.vocab_size)

    @property
    def kv_shape(self) -> KVShape:
        return KVShape(1, self.kv_heads, self.head_dim)


@dataclass(frozen=True, slots=True)
class LayerView:
    """A decoder layer's weights in the layout `decoder_block` reads (see fused_llama._Layer)."""

    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_size: int
    kv_size: int
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor
    inter: int
    down: torch.Tensor
    norm_in: tuple[torch.Tensor, float]
    norm_post: tuple[torch.Tensor, float]
    scaling: float


class EagleHead(nn.Module):
    """The trainable part: fc (2d -> d), one Llama decoder layer, and the norm that makes a feature."""

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        d, h, kv, hd = config.hidden, config.heads, config.kv_heads, config.head_dim
        self.config = config
        self.fc = nn.Linear(2 * d, d, bias=True)
        self.q_proj, self.k_proj = nn.Linear(d, h * hd, bias=False), nn.Linear(d, kv * hd, bias=False)
        self.v_proj, self.o_proj = nn.Linear(d, kv * hd, bias=False), nn.Linear(h * hd, d, bias=False)
        self.gate_proj = nn.Linear(d, config.intermediate, bias=False)
        self.up_proj = nn.Linear(d, config.intermediate, bias=False)
        self.down_proj = nn.Linear(config.intermediate, d, bias=False)
        self.norm_in, self.norm_post, self.norm_out = (nn.Parameter(torch.ones(d)) for _ in range(3))
        if config.feature_layers:  # EAGLE-3: low, middle and high features fused into one (len * d -> d)
            self.fuse = nn.Linear(len(config.feature_layers) * d, d, bias=False)
            if config.feature_norm:
                self.fuse_norm = nn.Parameter(torch.ones(len(config.feature_layers), d))
        if config.own_head:
            self.lm = nn.Parameter(torch.zeros(config.kept, d))

    @torch.no_grad()
    def init_for_training(self, generator: torch.Generator) -> None:
        """The starting point training uses: a freshly initialised layer (Linear's own uniform init, from
        `generator`), unit norms, and fc passing the feature through beside its random part. Measured
        here on SmolLM2's data, this learns several times faster per sequence than starting from the
        target's last layer, whose weights expect the residual stream, not post-norm features."""
        for module in (self.fc, self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.gate_proj, self.up_proj,
                       self.down_proj):
            bound = module.in_features ** -0.5
            module.weight.uniform_(-bound, bound, generator=generator)
            if module.bias is not None:
                module.bias.uniform_(-bound, bound, generator=generator)
        for norm in (self.norm_in, self.norm_post, self.norm_out):
            norm.fill_(1.0)
        d = self.config.hidden
        self.fc.weight[:, d:] += torch.eye(d)

    def layer(self) -> LayerView:
        """The layer's weights as `decoder_block` takes them (differentiable: q, k, v concatenated)."""
        c = self.config
        eps = c.rms_eps
        return LayerView(torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]), None,
                         c.heads * c.head_dim, c.kv_heads * c.head_dim, self.o_proj.weight, None,
                         torch.cat([self.gate_proj.weight, self.up_proj.weight]), c.intermediate,
                         self.down_proj.weight, (self.norm_in, eps), (self.norm_post, eps), c.head_dim ** -0.5)

    def real_features(self, target_features: torch.Tensor, linear=F.linear) -> torch.Tensor:
        """What a draft position reads for a committed token: the target's post-norm feature, or (EAGLE-3
        style) its fused layer inputs, each normalised first with `feature_norm`. `linear(x, weight, bias)`
        multiplies by a matrix (see step)."""
        c = self.config
        if not c.feature_layers:
            return target_features
        if c.feature_norm:
            parts = target_features.split(c.hidden, dim=-1)
            target_features = torch.cat([_rms_norm(x, (w, c.rms_eps)) for x, w in zip(parts, self.fuse_norm)], dim=-1)
        return linear(target_features, self.fuse.weight)

    def step(self, emb: torch.Tensor, feats: torch.Tensor, layer: LayerView, keys_values, cos: torch.Tensor,
             sin: torch.Tensor, mask: torch.Tensor | None, linear=F.linear) -> torch.Tensor:
        """Predicted features [1, q, d] from token embeddings and the previous features ([1, q, d] each).
        `linear` is F.linear in training (differentiable), the blocked copies' product in the engine."""
        return self.step_attending(emb, feats, layer, attend_with(keys_values, mask, layer.scaling), cos, sin, linear)

    def step_attending(self, emb: torch.Tensor, feats: torch.Tensor, layer: LayerView, attend, cos: torch.Tensor,
                       sin: torch.Tensor, linear=F.linear) -> torch.Tensor:
        """`step` with the attention step given (engine.fused_llama.decoder_layer): several sequences' rows
        stacked, each attending to its own cache, is how a batch drafts (`EagleRuntime.draft_many`)."""
        x = linear(torch.cat([emb, feats], dim=-1), self.fc.weight, self.fc.bias)
        c = self.config
        x = decoder_layer(x, layer, attend, cos, sin, c.heads, c.kv_heads, c.head_dim, linear)
        return _rms_norm(x, (self.norm_out, c.rms_eps))


def save_head(head: EagleHead, kept_ids: torch.Tensor, folder: Path, meta: dict | None = None) -> None:
    """Write the head (fp16 weights, its kept ids) and its config; nothing of the target is stored."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.float16).contiguous() for k, v in head.state_dict().items()}
    tensors["kept_ids"] = kept_ids.to(torch.int64).contiguous()
    save_file(tensors, str(folder / WEIGHTS))
    (folder / CONFIG).write_text(json.dumps({"config": asdict(head.config), "meta": meta or {}}, indent=1) + "\n")


def draft_in_bf16() -> bool:
    """Whether a head drafts with bfloat16 copies of its matrices: where the CPU multiplies bf16 natively
    (engine.clock.native_bf16), unless SPECPLAY_DRAFT_BF16 is set to 0 or 1. A draft's rounding changes which
    tokens it proposes, never which ones verification emits: the target stays fp32."""
    override = os.environ.get("SPECPLAY_DRAFT_BF16", "").strip()
    return override == "1" if override in ("0", "1") else native_bf16()


def draft_in_codes() -> bool:
    """Whether a head drafts with 8-bit codes of its matrices (DraftCodes) where its target's products read codes
    and it has no bf16 copies, unless SPECPLAY_DRAFT_CODES is 0. On SmolLM2 (AVX2-only AMD EPYC) a draft step
    read 20 MB of fp32 matrices for its fc and layer; as codes it reads 6."""
    return os.environ.get("SPECPLAY_DRAFT_CODES", "").strip() != "0"


class EagleRuntime:
    """A trained head bound to its target: the head's layer, the target's embeddings and the kept slice
    of its LM head, on the target's device and dtype. Read-only; shared by every drafter of the target."""

    def __init__(self, head: EagleHead, kept_ids: torch.Tensor, target: LoadedModel, name: str = "eagle",
                 bf16: bool | None = None, codes: bool | None = None) -> None:
        if target.fused is None:
            raise EagleLoadError(f"The EAGLE drafter reads the target's features through the engine's fused "
                                 f"forward, which {target.name!r} does not have.")
        self.config, self.target, self.name = head.config, target, name
        self.head = head.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
        self.layer = self.head.layer()
        self.kept_ids = kept_ids.to(target.device)
        self.embed = target.fused.embed
        if head.config.own_head:
            self.head_weight = self.head.lm.detach()
        else:
            self.head_weight = target.fused.lm_head.detach().index_select(0, self.kept_ids)  # [kept, d], a copy
        self._rope = target.fused._rope
        # a target read from a GGUF's codes: the kept rows of its head are Q8_0 rows too, and the draft reads them so
        coded = target.fused.blocked if isinstance(target.fused.blocked, CodedWeights) else None
        by_codes = coded.product_by(self.head_weight) if coded is not None and not head.config.own_head else None
        self._head_product = by_codes[0] if by_codes is not None else None
        self._blocked = self._blocked_copies(target, draft_in_bf16() if bf16 is None else bf16,
                                             draft_in_codes() if codes is None else codes)
        if by_codes is not None and isinstance(self._blocked, DraftCodes) and self._blocked.integer:
            self._head_product = coded.product_by(self.head_weight, integer=True)[0]   # as the draft's layer
        self.native, self.native_reason = NativeEagleStep.of(self)
        own = sum(p.numel() * p.element_size() for p in self.head.parameters())
        borrowed = 0 if head.config.own_head else by_codes[1] if by_codes is not None else \
            self.head_weight.numel() * self.head_weight.element_size()
        self.weight_bytes = own + borrowed   # counted once: read every round for the cache panel
        if self._blocked is not None and self._blocked.bf16:   # its matrices are read as bf16 copies: half
            self.weight_bytes -= self._blocked.bytes           # their fp32 bytes (the copies' count)
        if isinstance(self._blocked, DraftCodes):              # or as 8-bit codes
            self.weight_bytes -= self._blocked.saved

    @property
    def matrices(self) -> str:
        """How a draft step multiplies, for reports: "bf16 copies", "fp32 copies" (oneDNN-blocked), "8-bit codes"
        (DraftCodes) or "fp32"."""
        if isinstance(self._blocked, DraftCodes):
            return "8-bit codes"
        return "fp32" if self._blocked is None else ("bf16" if self._blocked.bf16 else "fp32") + " copies"

    def _blocked_copies(self, target: LoadedModel, bf16: bool, codes: bool) -> BlockedWeights | DraftCodes | None:
        """oneDNN blocked copies of the head's matrices (its layer, fc, the fusion and the LM head rows) when the
        target's own forward uses them: the head reads them once per draft, where the blocked product is the
        faster one (engine.fused_llama.blocked_min_rows). `bf16`: bfloat16 copies (see draft_in_bf16)."""
        if target.fused.blocked is None:
            return None
        layer = self.layer
        matrices = [layer.qkv, layer.o, layer.gate_up, layer.down, self.head.fc.weight]
        if self._head_product is None:
            matrices.append(self.head_weight)
        if self.config.feature_layers:
            matrices.append(self.head.fuse.weight)
        if BlockedWeights.unsupported(matrices) is not None:
            return None
        bf16 = bf16 and BlockedWeights.unsupported(matrices, bf16=True) is None
        if codes and not bf16 and isinstance(target.fused.blocked, CodedWeights):   # (the C++ module is there)
            from engine import native
            return DraftCodes(native.layers(), matrices)
        # where the CPU has no bf16 products (AVX2 only), the copies stay fp32: the same tokens emitted
        return BlockedWeights(matrices, bf16)

    def linear(self, rows: int):
        """The matrix product for `rows` rows at once: the blocked copies' from the target's threshold on."""
        if self._blocked is not None and rows >= self.target.fused.blocked_rows:
            return self._blocked.linear
        return F.linear

    @torch.inference_mode()
    def forward(self, cache: PagedCache, tokens: list[int], feats: torch.Tensor, positions: list[int] | None = None,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Predicted features [n, d] for draft positions past+1 .. past+n, whose inputs are `tokens` (x_t)
        and `feats` ([n, d], f_{t-1}); writes their K/V into the head's cache. A tree's nodes come with
        their own draft `positions` and an `attn_mask` [n, past + n] (engine.tree.attention_mask)."""
        n = len(tokens)
        past = cache.get_seq_length()
        ids = torch.tensor([tokens], dtype=torch.long, device=self.target.device)
        if positions is None:
            cos, sin = self._rope(past + 1, n, self.target.dtype)   # draft position t sits at rotary position t
            mask = None if n == 1 else torch.ones(n, past + n, dtype=torch.bool, device=ids.device).tril(past)
        else:
            cos, sin = self._rope(0, max(positions) + 1, self.target.dtype)
            index = torch.tensor(positions, device=ids.device)
            cos, sin, mask = cos[index], sin[index], attn_mask.to(ids.device)
        emb, feats = F.embedding(ids, self.embed), feats[None].to(self.target.dtype)
        if self.native is not None and n >= self.target.fused.blocked_rows:
            out = self.native.step(cache, emb, feats, cos[None, None], sin[None, None], mask)
        else:
            out = self.head.step(emb, feats, self.layer, lambda ks, vs: cache.layer_update(0, ks, vs),
                                 cos[None, None], sin[None, None], mask, self.linear(n))
        cache.tokens.extend(tokens)
        return out[0]

    @torch.inference_mode()
    def draft_many(self, steps: list["EagleStep"]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Several sequences' draft steps (each its own drafter and cache) as one head forward: their rows stacked
        through every product, attention per sequence, then one LM-head product over the kept tokens for all of
        them; each sequence's own context tokens are scored apart. Timed once; every drafter counts it as one
        draft forward. (predicted features, logits over its vocabulary) per step, as `EagleDrafter.run_step`."""
        device, dtype = self.target.device, self.target.dtype
        sizes = [len(s.tokens) for s in steps]
        caches = [s.drafter.cache for s in steps]
        times: list[float] = []
        with steps[0].drafter._timer.time(times):
            ids = torch.tensor([[t for s in steps for t in s.tokens]], dtype=torch.long, device=device)
            cos_parts, sin_parts, masks = [], [], []
            for cache, n in zip(caches, sizes):
                past = cache.get_seq_length()
                cos, sin = self._rope(past + 1, n, dtype)   # draft position t sits at rotary position t
                cos_parts.append(cos)
                sin_parts.append(sin)
                masks.append(None if n == 1 else torch.ones(n, past + n, dtype=torch.bool, device=device).tril(past))
            cos, sin = torch.cat(cos_parts)[None, None], torch.cat(sin_parts)[None, None]
            feats = torch.cat([s.feats for s in steps]).to(dtype)[None]
            rows = sum(sizes)
            attend = segmented_attend(caches, masks, sizes, 0, self.layer.scaling)
            out = self.head.step_attending(F.embedding(ids, self.embed), feats, self.layer, attend, cos, sin,
                                           self.linear(rows))[0]
            parts = [o[-1:] if s.last_only else o for o, s in zip(out.split(sizes), steps)]
            kept = self.logits(torch.cat(parts)).split([p.shape[0] for p in parts])
            logits = [s.drafter.vocabulary.logits(p, kept=k) for s, p, k in zip(steps, parts, kept)]
        for s in steps:
            s.drafter.cache.tokens.extend(s.tokens)
            s.drafter.forward_ms.extend(times)
        return list(zip(parts, logits))

    @torch.inference_mode()
    def real_features(self, target_features: torch.Tensor) -> torch.Tensor:
        return self.head.real_features(target_features.to(self.target.dtype), self.linear(target_features.shape[0]))

    @torch.inference_mode()
    def logits(self, feats: torch.Tensor) -> torch.Tensor:
        """Logits [n, kept] float32 over the pruned vocabulary."""
        if self._head_product is not None:
            return self._head_product(feats.float())
        return self.linear(feats.shape[0])(feats, self.head_weight).float()


class NativeEagleStep:
    """`EagleHead.step` with the blocked copies' products, run by engine.native's C++ `eagle_step`: the same ATen
    calls in the same order, so the same features bit for bit (tests/test_native.py), without the cost of calling
    some 40 small operations from Python each draft step: a chain's rows, or a tree's nodes under their mask.
    Batches draft together (`draft_many`), in Python."""

    def __init__(self, runtime: "EagleRuntime", module, blocked: list[torch.Tensor], kinds: list[int],
                 rows: list[int]) -> None:
        head, layer, c = runtime.head, runtime.layer, runtime.config
        self._module, self._blocked, self._bf16 = module, blocked, runtime._blocked.bf16
        self._kinds, self._rows = kinds, rows
        self._fc_bias = head.fc.bias.detach() if head.fc.bias is not None else None
        self._norms = [layer.norm_in[0].detach(), layer.norm_post[0].detach(), head.norm_out.detach()]
        self._geometry = (c.heads, c.kv_heads, c.head_dim, layer.inter, float(layer.scaling), float(c.rms_eps))

    @classmethod
    def of(cls, runtime: "EagleRuntime") -> tuple["NativeEagleStep | None", str | None]:
        """(the C++ step for `runtime`'s head, None) or (None, why its steps run in Python)."""
        if runtime._blocked is None:
            return None, "the C++ step multiplies with blocked copies, and this head has none"
        layer = runtime.layer
        matrices = [runtime.head.fc.weight, layer.qkv, layer.o, layer.gate_up, layer.down]
        if isinstance(runtime._blocked, DraftCodes):   # Fp32Product in layers.cpp: 1 blocked, 2 or 3 from codes
            coded = [runtime._blocked.blocks(m) for m in matrices]
            blocked, rows, kinds = ([c[j] if c else None for c in coded] for j in range(3))
        else:
            blocked, kinds, rows = [runtime._blocked._blocked.get(id(m)) for m in matrices], [1] * 5, [0] * 5
        if any(b is None for b in blocked):
            return None, "a matrix of the head has no blocked copy"
        if layer.qkv_bias is not None or layer.o_bias is not None or runtime.target.dtype != torch.float32:
            return None, "the C++ step takes an fp32 layer without biases"
        from engine import native
        module = native.layers()
        return (cls(runtime, module, blocked, kinds, rows), None) if module is not None else (None, native.reason())

    def step(self, cache: PagedCache, emb: torch.Tensor, feats: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             mask: torch.Tensor | None) -> torch.Tensor:
        """Predicted features [1, q, d] from emb and feats [1, q, d]; writes the rows' K/V into `cache`."""
        write = cache.begin_write(emb.shape[1])
        span = cache.span
        return self._module.eagle_step(emb, feats, self._blocked, self._kinds, self._rows, self._fc_bias, self._bf16,
                                       self._norms,
                                       cache.pool.keys[0], cache.pool.values[0], write, cache.slots,
                                       span[0] if span else 0, span[1] if span else -1, cos, sin, mask,
                                       *self._geometry)


def read_head(folder: Path) -> tuple[EagleHead, torch.Tensor]:
    """(the head saved in `folder`, in float32, its kept ids); EagleLoadError when it cannot be read."""
    from safetensors.torch import load_file

    try:
        data = json.loads((folder / CONFIG).read_text())
        config = EagleConfig(**data["config"])
        tensors = load_file(str(folder / WEIGHTS))
        kept = tensors.pop("kept_ids")
        head = EagleHead(config)
        head.load_state_dict({k: v.float() for k, v in tensors.items()})
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise EagleLoadError(f"No usable EAGLE head in {folder}: {type(exc).__name__}: {exc}") from None
    return head, kept


def load_runtime(folder: Path, target: LoadedModel) -> EagleRuntime:
    """The head in `folder`, bound to `target`. EagleLoadError when it is missing or trained for another
    target (its features would mean nothing to it)."""
    head, kept = read_head(folder)
    config = head.config
    c = target.model.config
    if (config.hidden, config.target_vocab) != (c.hidden_size, target.vocab_size):
        raise EagleLoadError(f"The EAGLE head in {folder} was trained for {config.target!r} (hidden "
                             f"{config.hidden}, vocabulary {config.target_vocab}), not for {target.name!r}.")
    layers = len(target.model.model.layers) if hasattr(target.model, "model") else 0
    if any(not 0 <= i <= layers for i in config.feature_layers):
        raise EagleLoadError(f"The EAGLE head in {folder} reads layers {list(config.feature_layers)}, which "
                             f"{target.name!r} ({layers} layers) does not have.")
    return EagleRuntime(head, kept, target, name=f"eagle:{folder.name}")


def load_eagle(source: str, target: LoadedModel) -> EagleRuntime:
    """The EAGLE head for a target: the one shipped for a source name ('smollm2', 'builtin', under
    assets/eagle/), or a folder path. EagleLoadError names the command that builds one."""
    folder = eagle_folder(source) if not Path(source).is_dir() else Path(source)
    if not (folder / CONFIG).is_file():
        raise EagleLoadError(f"No EAGLE head for {source!r} at {folder}. Train one with "
                             f"`python -m engine train-draft --target {source}`.")
    return load_runtime(folder, target)


class DraftVocabulary:
    """The tokens one sequence's q covers: the head's kept set, then (for a head that reads the target's LM head)
    every token of the sequence's context outside it, scored by its own row of the target's LM head, as the
    kept ones are. Such a head's feature is the vector the target's LM head reads, so that row's logit means what
    the kept rows' do, though training never saw it (docs/history.md: about a point of α more on the chat
    prompts, what the whole vocabulary gives, for a few hundred rows instead of 41,000).

    `ids` [kept + extra]: the token of each column of `logits`."""

    def __init__(self, runtime: EagleRuntime) -> None:
        self.runtime = runtime
        self.ids = runtime.kept_ids
        self.extends = not runtime.config.own_head
        self._known = set(runtime.kept_ids.tolist()) if self.extends else set()
        self._rows = runtime.target.fused.lm_head.detach()[:0]    # [extra, d]: the extra tokens' LM-head rows

    @property
    def extra(self) -> int:
        return self.ids.shape[0] - self.runtime.kept_ids.shape[0]

    def add(self, tokens: list[int]) -> None:
        """Cover the tokens not covered yet (a head with its own LM head covers only its kept set)."""
        if not self.extends:
            return
        new = [t for t in dict.fromkeys(tokens) if t not in self._known]
        if new:
            self._known.update(new)
            index = torch.tensor(new, device=self.ids.device)
            self.ids = torch.cat([self.ids, index])
            self._rows = torch.cat([self._rows, self.runtime.target.fused.lm_head.detach().index_select(0, index)])

    @torch.inference_mode()
    def logits(self, feats: torch.Tensor, kept: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [n, len(ids)] float32: the kept ones (the runtime's product, unless given: a batch computes
        them for all its sequences at once), then the context's."""
        kept = self.runtime.logits(feats) if kept is None else kept
        if not self.extra:
            return kept
        return torch.cat([kept, F.linear(feats, self._rows).float()], dim=-1)

    def full_rows(self, probs: torch.Tensor) -> torch.Tensor:
        """[n, len(ids)] probabilities as [n, V_target] rows, exactly 0 outside the covered tokens."""
        rows = torch.zeros(probs.shape[0], self.runtime.target.vocab_size, device=probs.device)
        return rows.index_copy_(1, self.ids, probs.float())


@dataclass(frozen=True, slots=True)
class EagleStep:
    """One draft forward an EagleDrafter asks for (its `propose_steps` yields them): `tokens` fed with the
    features `feats` after its cache; `last_only`: only the last row's prediction is wanted."""

    drafter: "EagleDrafter"
    tokens: list[int]
    feats: torch.Tensor
    last_only: bool = False

    def run(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This step alone: (predicted features, logits over the sequence's vocabulary)."""
        return self.drafter._draft(self.tokens, self.feats, last_only=self.last_only)


class EagleDrafter:
    """Drafts K tokens with an EAGLE head, keeping its own paged cache and the committed tokens' real
    features (rows of the target's forwards) in step with the target.

    State between rounds, with n committed tokens: `features` holds the real f_0..f_{n-2}; the head's
    cache holds draft positions 1..L (L <= n - 1), every one of them computed from real features.
    """

    kind = DrafterKind.EAGLE
    needs_features = True

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.runtime.config.feature_layers

    def __init__(self, runtime: EagleRuntime, sampling: SamplingParams, generator: torch.Generator,
                 capacity: int, block_size: int = 16, num_blocks: int | None = None,
                 now: Now = time.perf_counter) -> None:
        self.runtime, self.sampling, self.generator = runtime, sampling, generator
        self._timer = ForwardTimer(runtime.target.device, now)
        target = runtime.target
        blocks = num_blocks if num_blocks is not None else pool_blocks(capacity, block_size)
        self.pool = KVPool(runtime.config.kv_shape, blocks, block_size, target.device, target.dtype)
        self.cache = self.pool.new_sequence()
        self.features = torch.empty(0, runtime.config.hidden, device=target.device, dtype=target.dtype)
        self.vocabulary = DraftVocabulary(runtime)
        self.forward_ms: list[float] = []

    def _forward(self, tokens: list[int], feats: torch.Tensor, positions: list[int] | None = None,
                 attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        with self._timer.time(self.forward_ms):
            out = self.runtime.forward(self.cache, tokens, feats, positions, attn_mask)
        return out

    def _draft(self, tokens: list[int], feats: torch.Tensor, positions: list[int] | None = None,
               attn_mask: torch.Tensor | None = None, last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(predicted features, their logits over the sequence's vocabulary), timed as one draft forward: the
        head's LM-head product is part of what a draft costs, as a draft model's is part of its forward."""
        with self._timer.time(self.forward_ms):
            out = self.runtime.forward(self.cache, tokens, feats, positions, attn_mask)
            if last_only:
                out = out[-1:]
            logits = self.vocabulary.logits(out)
        return out, logits

    @torch.inference_mode()
    def prefill(self, prompt: list[int], features: torch.Tensor | None) -> None:
        """Take the prompt's real features and feed draft positions 1..p-1 (their inputs are all known)."""
        self.features = features = self.runtime.real_features(features)
        self.vocabulary.add(prompt)
        if len(prompt) > 1:
            self._forward(prompt[1:], features[: len(prompt) - 1])

    @torch.inference_mode()
    def propose(self, committed: list[int], k: int, limit: int | None = None) -> Proposal:
        """K drafts: one forward over the positions not yet cached (real features), then one per draft
        on the head's own predicted features."""
        return drive(self.propose_steps(committed, k, limit))

    def propose_steps(self, committed: list[int], k: int, limit: int | None = None) -> DraftSteps:
        """`propose` as steps: yields each draft forward (an EagleStep) and is sent its result; returns the
        Proposal. A batch runs the steps of all its sequences together (engine.batch)."""
        n, cached = len(committed), self.cache.table.length
        if self.features.shape[0] != n - 1:
            raise RuntimeError(f"the drafter holds {self.features.shape[0]} real features for {n} committed "
                               "tokens; it must be committed with every round's accepted features")
        predicted, logits = yield EagleStep(self, committed[cached + 1:], self.features[cached:], last_only=True)
        tokens, rows = [], []
        for i in range(k):
            u = draw_uniform(1, self.generator, logits.device)
            if self.sampling.greedy:      # one-hot rows, built once at the end (as the model drafter does)
                choice = int(greedy_ids(logits)[0])
            else:
                q = logits_to_probs(logits, self.sampling)
                choice = int(sample_from(q, u)[0])
                rows.append(q[0])
            tokens.append(int(self.vocabulary.ids[choice]))
            if i + 1 < k:
                predicted, logits = yield EagleStep(self, [tokens[-1]], predicted)
        if self.sampling.greedy:
            q_draft = one_hot_rows(torch.tensor(tokens, device=logits.device), self.runtime.target.vocab_size)
        else:
            q_draft = self.vocabulary.full_rows(torch.stack(rows))
        return Proposal(tokens, q_draft, k, self.kind)

    @torch.inference_mode()
    def propose_tree(self, committed: list[int], spec: TreeSpec, weigh: Weigh | None = None,
                     copy_at: CopyAt | None = None) -> TreeProposal:
        """A draft tree: the first forward (real features) gives the root's prediction; each level of nodes
        then reads its parents' predicted features, attending to the real positions and its ancestors."""
        n, cached = len(committed), self.cache.table.length
        predicted: dict[int, torch.Tensor] = {}
        root_position, base, forwards, fed = n - 1, n - 1, 0, []

        def rows_at(tree: DraftTree, nodes: list[int]) -> dict[int, torch.Tensor]:
            nonlocal forwards
            forwards += 1
            if nodes == [0]:
                out, logits = self._draft(committed[cached + 1:], self.features[cached:], last_only=True)
                predicted[0] = out[0]
                return {0: self._rows(logits)[0]}
            fed.extend(nodes)
            feats = torch.stack([predicted[tree.parents[i]] for i in nodes])
            out, logits = self._draft([tree.tokens[i] for i in nodes], feats,
                                      [root_position + tree.depths[i] for i in nodes],
                                      attention_mask(tree, base, nodes, fed))
            predicted.update(zip(nodes, out))
            return dict(zip(nodes, self._rows(logits)))

        tree = grow(spec, committed[-1], rows_at, self.sampling.greedy, self.generator, weigh, copy_at)
        return TreeProposal(tree, forwards, self.kind)

    def _rows(self, logits: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary draft rows for tree nodes from their logits over the sequence's vocabulary (plain
        softmax when greedy: it only ranks children)."""
        probs = torch.softmax(logits, dim=-1) if self.sampling.greedy else logits_to_probs(logits, self.sampling)
        return self.vocabulary.full_rows(probs)

    @torch.inference_mode()
    def commit(self, committed: list[int], features: torch.Tensor | None) -> None:
        """Append the real features of the tokens this round committed but the last (the verify
        forward's rows 0..accepted) and roll back every cached position computed from a prediction."""
        old = self.features.shape[0] + 1       # committed tokens before this round
        self.features = torch.cat([self.features, self.runtime.real_features(features[: len(committed) - old])])
        self.vocabulary.add(committed[old:])
        keep = min(self.cache.table.length, old - 1)
        self.cache.rollback(self.cache.table.length - keep)

    def caches(self) -> list[DraftCache]:
        return [DraftCache("eagle", self.cache, str(self.runtime.target.device), self.runtime.weight_bytes)]

    def drain_forward_ms(self) -> list[float]:
        times, self.forward_ms = self.forward_ms, []
        return times

    def close(self) -> None:
        self.cache.free()

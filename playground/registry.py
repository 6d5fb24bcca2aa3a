"""Model pairs: the presets, lazy loading, and models shared read-only by every session.

A model is loaded the first time a session asks for it and kept for all sessions after that.
Before a Hub or custom model is loaded, its config.json is read and its weight memory estimated;
a model that would not fit in the free memory of its device is refused with a clear message.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.models import LoadedModel, ModelLoadError, ModelPair, default_devices, load_model, resolve_dtype
from engine.sources import BUILTIN

CUSTOM = "custom"
MEMORY_HEADROOM = 1.2   # weights plus activations, allocator slack and the KV pools


@dataclass(frozen=True, slots=True)
class PairPreset:
    key: str
    label: str
    draft: str
    target: str
    draft_device: str | None = None    # None: engine.models.default_devices decides
    target_device: str | None = None
    gpus: int = 0                      # GPUs the layout needs


HUB_PRESETS = (
    PairPreset("qwen-0.5b-1.5b", "Qwen2.5-0.5B → Qwen2.5-1.5B (Hub download)",
               "Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-1.5B"),
    PairPreset("qwen-0.5b-7b-2gpu", "Qwen2.5-0.5B → Qwen2.5-7B, draft cuda:0 / target cuda:1 (seed system)",
               "Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-7B", "cuda:0", "cuda:1", gpus=2),
)


def estimate_parameters(config) -> int:
    """Parameter count of a decoder-only transformer from its config (embeddings, attention, gated MLP).

    Raises ValueError when the config lacks the sizes needed (not a causal LM we can estimate).
    """
    config = getattr(config, "text_config", None) or config
    try:
        h, layers, vocab = int(config.hidden_size), int(config.num_hidden_layers), int(config.vocab_size)
        heads = int(config.num_attention_heads)
    except (AttributeError, TypeError) as exc:
        raise ValueError(f"the config has no {exc} size") from None
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or h // heads)
    inter = int(getattr(config, "intermediate_size", None) or 4 * h)
    attention = 2 * h * heads * head_dim + 2 * h * kv_heads * head_dim   # q, o and k, v projections
    mlp = 3 * h * inter                                                   # gate, up, down
    embeddings = vocab * h * (1 if getattr(config, "tie_word_embeddings", False) else 2)
    return layers * (attention + mlp) + embeddings


def free_memory(device: torch.device) -> int:
    """Bytes free on a device: CUDA's own count, or MemAvailable for the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_fits(source: str, role: str, device: torch.device, free: Callable[[torch.device], int] = free_memory) -> int:
    """Estimated weight bytes of `source` on `device`; raises ModelLoadError if it cannot fit there."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=False)
    except Exception as exc:  # offline, unknown id, not a model folder, remote code required, ...
        raise ModelLoadError(f"Could not read the config of {role} model {source!r}: {type(exc).__name__}. "
                             "Hub ids need internet access (or a copy in the local HF cache); "
                             "paths must hold a config.json.") from None
    try:
        need = estimate_parameters(config) * torch.empty((), dtype=resolve_dtype("auto", device)).element_size()
    except ValueError as exc:
        raise ModelLoadError(f"Cannot estimate the size of {role} model {source!r} ({exc}); "
                             "refusing to load it.") from None
    have = free(device)
    if need * MEMORY_HEADROOM > have:
        raise ModelLoadError(f"The {role} model {source!r} needs about {need / 2**30:.1f} GiB on {device}, but only "
                             f"{have / 2**30:.1f} GiB is free there. Pick a smaller pair.")
    return need


class ModelRegistry:
    """Loads model pairs on demand and shares each loaded model, read-only, across sessions."""

    def __init__(self, default_draft: str = BUILTIN, default_target: str = BUILTIN, *,
                 draft_device: str | None = None, target_device: str | None = None, allow_custom: bool = False,
                 loader: Callable[..., LoadedModel] = load_model,
                 free: Callable[[torch.device], int] = free_memory) -> None:
        label = "Built-in pair (offline, runs on CPU)" if (default_draft, default_target) == (BUILTIN, BUILTIN) \
            else f"{default_draft} → {default_target} (server default)"
        self.presets: tuple[PairPreset, ...] = (
            PairPreset("default", label, default_draft, default_target, draft_device, target_device), *HUB_PRESETS)
        self.allow_custom = allow_custom
        self._loader, self._free = loader, free
        self._models: dict[tuple[str, str, str], LoadedModel] = {}
        self._pairs: dict[tuple[int, int], ModelPair] = {}   # tokenizers checked once per pair
        self._lock = threading.Lock()

    def choices(self) -> list[tuple[str, str]]:
        """(label, key) for the preset picker; "custom" only when custom ids are allowed."""
        extra = [("Custom ids or paths", CUSTOM)] if self.allow_custom else []
        return [(p.label, p.key) for p in self.presets] + extra

    def resolve(self, key: str, custom_draft: str = "", custom_target: str = "") -> PairPreset:
        if key == CUSTOM:
            if not self.allow_custom:
                raise ModelLoadError("Custom models are disabled on this server (start it with --allow-custom-models "
                                     "or SPECPLAY_ALLOW_CUSTOM_MODELS=1).")
            draft, target = custom_draft.strip(), custom_target.strip()
            if not draft or not target:
                raise ModelLoadError("Enter both a draft and a target model id or path.")
            return PairPreset(CUSTOM, "custom", draft, target)
        for preset in self.presets:
            if preset.key == key:
                return preset
        raise ModelLoadError(f"Unknown model pair {key!r}.")

    def pair(self, key: str, custom_draft: str = "", custom_target: str = "") -> ModelPair:
        """The loaded (draft, target) for a preset; loads whatever is not loaded yet."""
        preset = self.resolve(key, custom_draft, custom_target)
        if preset.gpus > torch.cuda.device_count():
            raise ModelLoadError(f"{preset.label} needs {preset.gpus} GPUs; this server has "
                                 f"{torch.cuda.device_count()}.")
        draft_dev, target_dev = default_devices(preset.draft_device, preset.target_device)
        with self._lock:  # one load at a time: two sessions asking for the same model share one copy
            draft = self._get(preset.draft, "draft", draft_dev)
            target = self._get(preset.target, "target", target_dev)
            key = (id(target), id(draft))
            if key not in self._pairs:
                self._pairs[key] = ModelPair(target, draft)
            return self._pairs[key]

    def loaded(self) -> list[str]:
        return [f"{m.name} on {m.device}" for m in self._models.values()]

    def _get(self, source: str, role: str, device: torch.device) -> LoadedModel:
        key = (source, role if source == BUILTIN else "", str(device))
        if key not in self._models:
            if source != BUILTIN:
                check_fits(source, role, device, self._free)
            model = self._loader(source, role, device=device)
            model.model.requires_grad_(False)
            self._models[key] = model
        return self._models[key]

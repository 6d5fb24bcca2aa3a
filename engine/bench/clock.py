"""Timing model forwards for the bench."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.fused_llama import FusedLlama, fused_for
from engine.models import LoadedModel


@dataclass(frozen=True, slots=True)
class ForwardTime:
    """One model forward: new tokens fed (q), logits rows kept (0 = all), seconds."""

    q: int
    rows: int
    seconds: float

    @property
    def all_rows(self) -> bool:
        return self.rows in (0, self.q)


class ForwardClock:
    """Times every forward of one model through hooks, while active (`with clock:`).

    On CUDA each forward is synchronized at both ends, so the times are the device's, at the price
    of losing the overlap of CPU launch work with the previous forward.
    """

    def __init__(self, loaded: LoadedModel | None) -> None:
        self.loaded, self.times, self._handles, self._t0 = loaded, [], [], 0.0
        self._fused: FusedLlama | None = None
        self._shadowed = None

    def _sync(self) -> None:
        if self.loaded.device.type == "cuda":
            torch.cuda.synchronize(self.loaded.device)

    def _pre(self, module, args, kwargs) -> None:
        self._sync()
        self._t0 = time.perf_counter()

    def _post(self, module, args, kwargs, output) -> None:
        self._sync()
        ids = kwargs.get("input_ids", args[0] if args else None)
        rows = kwargs.get("logits_to_keep", 0)
        self.times.append(ForwardTime(int(ids.shape[-1]), rows if isinstance(rows, int) else -1,
                                      time.perf_counter() - self._t0))

    def _timed(self, forward):
        """The fused forward, timed like the hooked module (it never calls the module)."""
        def timed(cache, ids, last_only=False):
            self._pre(None, (), {})
            logits = forward(cache, ids, last_only)
            self._post(None, (), {"input_ids": ids, "logits_to_keep": 1 if last_only else 0}, logits)
            return logits
        return timed

    def __enter__(self) -> "ForwardClock":
        if self.loaded is not None:
            m = self.loaded.model
            self._handles = [m.register_forward_pre_hook(self._pre, with_kwargs=True),
                             m.register_forward_hook(self._post, with_kwargs=True)]
            self._fused = fused_for(m)
            if self._fused is not None:
                self._shadowed = self._fused.__dict__.get("forward")  # another clock's, when nested
                self._fused.forward = self._timed(self._fused.forward)  # an instance attribute shadows the method
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.loaded is not None and self._fused is not None:
            if self._shadowed is None:
                del self._fused.forward
            else:
                self._fused.forward = self._shadowed

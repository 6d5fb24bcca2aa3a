"""Timing Hugging Face `generate`'s model forwards for the bench, through module hooks.

The engine reports its own forward times in its round records (engine.clock); `generate` does not,
so its forwards are timed by forward hooks on the module, the API torch offers for this.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.clock import ForwardTimer
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
    """Times every forward of one module through hooks, while active (`with clock:`).

    On CUDA each forward is synchronized at both ends, so the times are the device's, at the price
    of losing the overlap of CPU launch work with the previous forward.
    """

    def __init__(self, loaded: LoadedModel | None, module: torch.nn.Module | None = None) -> None:
        self.loaded, self.times, self._handles, self._t0 = loaded, [], [], 0.0
        self.module = module if module is not None else (loaded.model if loaded is not None else None)
        self.device = next(self.module.parameters()).device if self.module is not None else torch.device("cpu")
        self._timer = ForwardTimer(self.device)

    def _pre(self, module, args, kwargs) -> None:
        self._timer.start()

    def _post(self, module, args, kwargs, output) -> None:
        ms = self._timer.stop()
        ids = kwargs.get("input_ids", args[0] if args else None)
        rows = kwargs.get("logits_to_keep", 0)
        self.times.append(ForwardTime(int(ids.shape[-1]), rows if isinstance(rows, int) else -1, ms / 1000))

    def __enter__(self) -> "ForwardClock":
        if self.module is not None:
            self._handles = [self.module.register_forward_pre_hook(self._pre, with_kwargs=True),
                             self.module.register_forward_hook(self._post, with_kwargs=True)]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

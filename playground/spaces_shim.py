"""ZeroGPU support: `spaces.GPU` when the `spaces` package is importable, a no-op decorator otherwise."""
from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


def gpu(duration: int = 60) -> Callable[[F], F]:
    """Decorate a function that runs model forwards. On a ZeroGPU Space, `spaces.GPU` attaches a GPU
    for the call (at most `duration` seconds); anywhere else the function is returned unchanged."""
    try:
        import spaces
    except ImportError:
        return lambda fn: fn
    return spaces.GPU(duration=duration)

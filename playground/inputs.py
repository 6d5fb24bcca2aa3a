"""Reading what a visitor typed: the one place a UI or API value becomes an int, a float or text, with a
sentence naming the field and the values it allows when it cannot."""
from __future__ import annotations

import math

SEED_MAX = 2**63 - 1   # torch.Generator.manual_seed takes a signed 64-bit integer


def as_number(name: str, value: object) -> float:
    """A finite number from a Gradio number box (floats, ints, numeric strings), else ValueError."""
    if value is None or value == "":
        raise ValueError(f"{name} is empty: enter a number.")
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number, not {value}.")
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{name} must be a number, got {str(value)[:40]!r}.") from None
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {value}.")
    return number


def as_int(name: str, value: object, low: int | None = None, high: int | None = None) -> int:
    """A whole number within [low, high] (either bound optional), else ValueError naming the range."""
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        x = as_number(name, value)
        if x != int(x):
            raise ValueError(f"{name} must be a whole number, got {value}.")
        number = int(x)
    if (low is not None and number < low) or (high is not None and number > high):
        span = f"between {low} and {high}" if low is not None and high is not None else (
            f"at least {low}" if low is not None else f"at most {high}")
        raise ValueError(f"{name} must be {span}, got {number}.")
    return number


def as_float(name: str, value: object) -> float:
    return as_number(name, value)


def as_seed(value: object) -> int:
    return as_int("Seed", value, 0, SEED_MAX)


def as_text(name: str, value: object, max_chars: int) -> str:
    """Text that the tokenizer can encode (no lone surrogates) and of bounded length."""
    if value is None:
        value = ""
    if not isinstance(value, str):
        raise ValueError(f"{name} must be text.")
    if len(value) > max_chars:
        raise ValueError(f"{name} has {len(value)} characters; this server takes at most {max_chars}.")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{name} contains a character that is not valid Unicode text (position {exc.start}); "
                         "remove it or paste the text again.") from None
    return value

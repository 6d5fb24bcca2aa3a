"""Reading what a visitor typed or an API caller sent: the one place a UI or API value becomes an int, a float
or text, with a sentence naming the field and the values it allows when it cannot.

Values arrive as sent (see playground.components): text, None, NaN, infinity or a huge integer reach
these functions rather than failing inside Gradio. Where the engine owns a rule (the seed's range,
valid Unicode text), its own sentence is used, so the command line says exactly the same.
"""
from __future__ import annotations

import math

from engine.config import SEED_MAX, check_seed
from engine.prompts import check_text

__all__ = ["SEED_MAX", "as_float", "as_int", "as_number", "as_optional_number", "as_seed", "as_text"]


def as_number(name: str, value: object, allowed: str = "a finite number") -> float:
    """A finite number from a Gradio number box or slider (floats, ints, numeric strings), else ValueError
    saying `{name} must be {allowed}`."""
    if value is None or value == "":
        raise ValueError(f"{name} is empty: enter {allowed}.")
    if isinstance(value, bool):
        raise ValueError(f"{name} must be {allowed}, got {value}.")
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{name} must be {allowed}, got {_shown(value)}.") from None
    if not math.isfinite(number):
        raise ValueError(f"{name} must be {allowed}, got {_shown(value)}.")
    return number


def as_optional_number(value: object) -> float | None:
    """A finite number, or None where the field is empty or holds no finite number: for a field that may stay
    unset while it is being typed into (the Live engine page's c and r), where a sentence at every keystroke
    would be noise."""
    try:
        return as_number("", value)
    except ValueError:
        return None


def as_int(name: str, value: object, low: int | None = None, high: int | None = None) -> int:
    """A whole number within [low, high] (either bound optional), else ValueError naming the range."""
    allowed = "a whole number" + (f" from {low} to {high}" if low is not None and high is not None else
                                  f" of at least {low}" if low is not None else
                                  f" of at most {high}" if high is not None else "")
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        x = as_number(name, value, allowed)
        if x != int(x):
            raise ValueError(f"{name} must be {allowed}, got {_shown(value)}.")
        number = int(x)
    if (low is not None and number < low) or (high is not None and number > high):
        raise ValueError(f"{name} must be {allowed}, got {number}.")
    return number


def as_float(name: str, value: object, allowed: str = "a finite number") -> float:
    return as_number(name, value, allowed)


def as_seed(value: object) -> int:
    """A seed for torch's generators, with the engine's sentence (engine.config.check_seed) for every way it
    can be wrong: text, a fraction, NaN, infinity, negative or over SEED_MAX."""
    try:
        seed: object = as_int("Seed", value)
    except ValueError:
        seed = value
    return check_seed(seed)


def as_text(name: str, value: object, max_chars: int) -> str:
    """Text that a tokenizer can encode (no lone surrogates, engine.speculative.check_text) and of at most
    `max_chars` characters."""
    if value is None:
        value = ""
    if not isinstance(value, str):
        raise ValueError(f"{name} must be text.")
    if len(value) > max_chars:
        raise ValueError(f"{name} has {len(value):,} characters; this server takes at most {max_chars:,}.")
    return check_text(name, value)


def _shown(value: object) -> str:
    """A value as a message quotes it: text in quotes and cut short, numbers as they are."""
    return repr(value[:40]) if isinstance(value, str) else str(value)[:40]

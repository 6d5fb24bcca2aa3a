"""One sequence being decoded: its prompt, the tokens committed after it, and when it is finished."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Sequence:
    """Committed tokens (prompt + generated), cut at EOS or at max_new_tokens.

    Cutting a round's tokens keeps the run lossless: a prefix of a sample from the target's
    distribution is a sample of that prefix.
    """

    prompt: list[int]
    max_new_tokens: int
    eos_id: int | None = None
    stop_at_eos: bool = True
    tokens: list[int] = field(default_factory=list)
    finished: bool = False

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError("a sequence needs at least one prompt token")
        self.prompt = list(self.prompt)
        self.tokens = list(self.prompt)

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt):]

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.generated)

    @property
    def last(self) -> int:
        return self.tokens[-1]

    def accept(self, tokens: list[int]) -> list[int]:
        """Append a round's tokens, cut at EOS or at the budget; return what was appended."""
        emitted = tokens[: self.remaining]
        if self.stop_at_eos and self.eos_id is not None and self.eos_id in emitted:
            emitted = emitted[: emitted.index(self.eos_id) + 1]
            self.finished = True
        self.tokens.extend(emitted)
        if self.remaining <= 0:
            self.finished = True
        return emitted

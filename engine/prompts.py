"""Prompts as the target reads them: raw text, or one chat turn through the tokenizer's chat template."""
from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from engine.typed_json import unicode_problem


class PromptError(ValueError):
    """The prompt cannot be decoded with these settings (empty, too long, or not encodable)."""


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A user message (and an optional system prompt) for a target with a chat template."""

    user: str
    system: str | None = None

    def messages(self) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system}] if self.system and self.system.strip() else []
        return system + [{"role": "user", "content": self.user}]


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def check_text(name: str, text: str) -> str:
    """`text` when every character can be encoded as UTF-8, else ValueError naming the field and the first
    bad character (engine.typed_json.unicode_problem: a lone surrogate such as '\\ud800' is a str that no
    tokenizer can encode)."""
    problem = unicode_problem(text)
    if problem is not None:
        raise ValueError(f"{name} {problem}; only valid Unicode text is allowed, so remove it or paste the text "
                         "again.")
    return text


def _checked(name: str, text: str) -> str:
    try:
        return check_text(name, text)
    except ValueError as exc:
        raise PromptError(str(exc)) from None


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """The prompt's ids as the tokenizer gives them (special tokens included); PromptError if empty or not
    valid Unicode text."""
    if not isinstance(text, str) or not text.strip():
        raise PromptError("The prompt is empty: type some text (for the built-in pair, some Python code).")
    return list(tokenizer(_checked("The prompt", text))["input_ids"])


def encode_chat(tokenizer: PreTrainedTokenizerBase, prompt: ChatPrompt) -> list[int]:
    """The ids of the chat template applied to the turn, ending with the assistant's header
    (`add_generation_prompt=True`), exactly as `apply_chat_template` gives them."""
    if not isinstance(prompt.user, str) or not prompt.user.strip():
        raise PromptError("The message is empty: type a question or an instruction.")
    _checked("The message", prompt.user)
    if prompt.system:
        _checked("The system prompt", prompt.system)
    if not has_chat_template(tokenizer):
        raise PromptError("This target has no chat template: switch the prompt to raw text.")
    out = tokenizer.apply_chat_template(prompt.messages(), add_generation_prompt=True, tokenize=True,
                                        return_dict=True)
    return list(out["input_ids"])

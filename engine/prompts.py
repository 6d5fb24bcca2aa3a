"""Prompts as the target reads them: raw text, or one chat turn through the tokenizer's chat template."""
from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase


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


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """The prompt's ids as the tokenizer gives them (special tokens included); PromptError if empty."""
    if not text or not text.strip():
        raise PromptError("The prompt is empty: type some text (for the built-in pair, some Python code).")
    return list(tokenizer(text)["input_ids"])


def encode_chat(tokenizer: PreTrainedTokenizerBase, prompt: ChatPrompt) -> list[int]:
    """The ids of the chat template applied to the turn, ending with the assistant's header
    (`add_generation_prompt=True`), exactly as `apply_chat_template` gives them."""
    if not prompt.user or not prompt.user.strip():
        raise PromptError("The message is empty: type a question or an instruction.")
    if not has_chat_template(tokenizer):
        raise PromptError("This target has no chat template: switch the prompt to raw text.")
    out = tokenizer.apply_chat_template(prompt.messages(), add_generation_prompt=True, tokenize=True,
                                        return_dict=True)
    return list(out["input_ids"])


def end_of_turn_id(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The id that ends the assistant's turn in a chat: the tokenizer's EOS (SmolLM2's `<|im_end|>`)."""
    return tokenizer.eos_token_id

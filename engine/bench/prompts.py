"""The bench's prompt sets: held-out stdlib windows, code continuations and chat questions."""
from __future__ import annotations

import random
from dataclasses import dataclass

from engine.bench.methods import BenchSettings
from engine.config import K_SLACK
from engine.models import LoadedModel
from engine.prompts import PromptError


@dataclass(frozen=True, slots=True)
class Prompt:
    name: str          # where it came from: "<file>@<token offset>" or "<file> (first half)"
    ids: list[int]


def heldout_prompts(tokenizer, count: int, length: int, seed: int) -> list[Prompt]:
    """`count` windows of `length` tokens from distinct held-out stdlib test files (seeded choice)."""
    from engine.train.corpus import list_sources

    files = list_sources("heldout")
    rng = random.Random(seed)
    rng.shuffle(files)
    out = []
    for f in files:
        ids = tokenizer(f.text, add_special_tokens=False)["input_ids"]
        if len(ids) > length:
            start = rng.randrange(len(ids) - length)
            out.append(Prompt(f"{f.path.name}@{start}", list(ids[start:start + length])))
        if len(out) == count:
            return out
    raise PromptError(f"found only {len(out)} held-out files longer than {length} tokens")


def code_prompts(tokenizer, count: int, max_tokens: int, seed: int) -> list[Prompt]:
    """Code continuation: the first half (by lines) of held-out test files, cut from the left to
    `max_tokens` so it fits the context. The continuation is what the file really says next."""
    from engine.train.corpus import list_sources

    files = [f for f in list_sources("heldout") if 120 <= f.text.count("\n") <= 1500]
    random.Random(seed).shuffle(files)
    out = []
    for f in files[:count]:
        lines = f.text.splitlines(keepends=True)
        ids = list(tokenizer("".join(lines[: len(lines) // 2]))["input_ids"])
        out.append(Prompt(f"{f.path.name} (first half)", ids[-max_tokens:]))
    if len(out) < count:
        raise PromptError(f"found only {len(out)} held-out files of 120-1500 lines for code prompts")
    return out


def chat_prompts(tokenizer, which: str, count: int) -> list[Prompt]:
    """The project's chat questions ('bench', 32; or 'heldout', 16, never trained on), each through the
    target's chat template."""
    from engine.prompts import ChatPrompt, encode_chat, has_chat_template
    from engine.train.chat_prompts import chat_prompts as written

    if not has_chat_template(tokenizer):
        raise PromptError("chat prompts need a target with a chat template (e.g. --target smollm2)")
    texts = written(which)[:count]
    return [Prompt(f"{which} #{i + 1}: {t[:40]}", encode_chat(tokenizer, ChatPrompt(t))) for i, t in enumerate(texts)]


def make_prompts(settings: BenchSettings, target: LoadedModel) -> list[Prompt]:
    """The prompt set, cut so that prompt + new tokens + a round's slack fit the target's context."""
    room = target.max_context - settings.new_tokens - K_SLACK
    if room < 2:
        raise PromptError(f"{settings.new_tokens} new tokens leave no room for a prompt in a "
                          f"{target.max_context}-token context")
    length = min(settings.prompt_tokens, room)
    if settings.prompt_set.startswith("chat"):
        which = {"chat": "bench", "chat-heldout": "heldout", "chat-fresh": "fresh",
                 "chat-wide": "wide"}[settings.prompt_set]
        return chat_prompts(target.tokenizer, which, settings.num_prompts)
    if settings.prompt_set == "code":
        return code_prompts(target.tokenizer, settings.num_prompts, length, settings.seed)
    return heldout_prompts(target.tokenizer, settings.num_prompts, length, settings.seed)

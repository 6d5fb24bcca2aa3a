"""engine.text: a byte-level stream decoded as a whole: no replacement characters where the text is fine,
and the tokens that stop inside a character marked partial."""
from __future__ import annotations

from engine.text import StreamDecoder, token_texts

TEXT = "café 日本 👍 naïve"


def test_texts_join_to_the_decoded_stream_and_mark_partial_tokens(builtin_tokenizer):
    ids = builtin_tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    texts = token_texts(builtin_tokenizer, ids)
    assert "".join(t.text for t in texts) == builtin_tokenizer.decode(ids) == TEXT
    assert not any("\ufffd" in t.text for t in texts)
    per_token = [builtin_tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in t for t in per_token)   # what decoding token by token would have shown
    partial = [t for t in texts if t.partial]
    assert partial and all(t.text in ("", " ") for t in partial)


def test_a_fork_reads_drafts_without_moving_the_stream(builtin_tokenizer):
    ids = builtin_tokenizer("日本", add_special_tokens=False)["input_ids"]
    stream = StreamDecoder(builtin_tokenizer)
    stream.feed(ids[0])
    fork = stream.copy()
    assert "".join(t.text for t in fork.feed_all(ids[1:])).endswith("本")
    assert "".join(t.text for t in stream.feed_all(ids[1:])) == "".join(t.text for t in token_texts(
        builtin_tokenizer, ids[1:], ids[:1]))

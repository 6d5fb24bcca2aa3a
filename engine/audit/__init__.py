"""Auditing a server's speculative sampling: does it sample what its model would without speculation?

`exact` computes the distribution of a prompt's first m tokens from the model itself; `client` asks an
OpenAI-compatible completions endpoint for samples; `test` compares the two (or a server with speculation
against one without) and says how large a deviation its sample could have shown; `server` serves this
project's own engine through the same API, with a known-wrong rule when asked (engine.faults); `cli` is
`python -m engine audit` and `python -m engine serve`.
"""

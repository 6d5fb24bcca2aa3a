"""Drafters: each proposes K tokens and the q_draft rows they were drawn from, behind one interface.

The interface and what a round verifies live in `base`; each drafter is one module (`model`, `ngram`,
`hybrid`, `eagle`), imported from there."""

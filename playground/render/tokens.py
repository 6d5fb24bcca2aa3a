"""The token stream: every emitted and drafted token as a chip coloured (and marked) by its outcome."""
from __future__ import annotations

import html
from dataclasses import dataclass

from engine.config import DrafterKind
from engine.records import FinalRecord, Outcome, PositionRecord, RoundRecord
from playground.render.palette import OUTCOME_STYLES, chip_class
from playground.view import Cursor, RunView

# Visible stand-ins: the built-in pair writes code, where spaces and newlines are the content.
WHITESPACE = str.maketrans({" ": "·", "\n": "↵", "\t": "→", "\r": "␍"})

# Chip clicks reach Python as a "click" event carrying the chip's round and position.
CHIP_CLICK_JS = """
element.addEventListener('click', (e) => {
  const chip = e.target.closest('[data-round]');
  if (chip) trigger('click', {round: Number(chip.dataset.round), position: Number(chip.dataset.pos)});
});
"""


def visible(text: str) -> str:
    """Token text with whitespace made visible (· space, ↵ newline, → tab)."""
    return text.translate(WHITESPACE) if text else "∅"


def _num(x: float | None) -> str:
    return "—" if x is None else f"{x:.3g}"


@dataclass(frozen=True, slots=True)
class Chip:
    """One token as the stream shows it."""

    text: str
    outcome: Outcome
    title: str
    round: int
    position: int

    def html(self, selected: bool) -> str:
        classes = ["chip", chip_class(self.outcome)] + (["selected"] if selected else [])
        body = html.escape(visible(self.text))
        tail = "<br>" if "\n" in self.text else ""  # keep the code's line structure
        attrs = (f'class="{" ".join(classes)}" data-round="{self.round}" data-pos="{self.position}" '
                 f'data-outcome="{self.outcome.value}" title="{html.escape(self.title, quote=True)}"')
        return f"<span {attrs}>{body}</span>{tail}"


def draft_source(r: RoundRecord) -> str:
    """Who proposed a round's drafts: the draft model, the EAGLE head, or a copy of an earlier
    occurrence (the n-gram drafter always, a hybrid in rounds where it copied)."""
    if r.proposer is DrafterKind.NGRAM:
        return "copied by prompt lookup"
    if r.proposer is DrafterKind.EAGLE:
        return "from the EAGLE head"
    return "from the draft model"


def chip_text(text: str, pending: str) -> str:
    """What a chip shows: its characters, and the bytes of a character it starts but does not finish."""
    return text + (f"‹{pending}›" if pending else "")


def position_chip(r: RoundRecord, p: PositionRecord, revealed: bool) -> Chip:
    name = f"drafted #{p.index + 1} ({draft_source(r)})"
    if not revealed:
        return Chip(chip_text(p.text, p.pending), Outcome.PENDING, f"{name}: q={_num(p.q_draft)} · not yet verified",
                    r.index, p.index)
    if p.outcome is Outcome.UNCHECKED:
        return Chip(chip_text(p.text, p.pending), Outcome.UNCHECKED, f"{name}: q={_num(p.q_draft)} · discarded "
                    "unchecked (an earlier draft was rejected)", r.index, p.index)
    verdict = "u < α: accepted" if p.outcome is Outcome.ACCEPTED else "u ≥ α: rejected"
    title = (f"{name}: p={_num(p.p_target)} q={_num(p.q_draft)} "
             f"α=min(1,p/q)={_num(p.alpha)} u={_num(p.u)} · {verdict}")
    return Chip(chip_text(p.text, p.pending), p.outcome, title, r.index, p.index)


def all_accepted(k: int) -> str:
    """What a bonus round's K drafts were: "the draft accepted" (K = 1), "all 4 drafts accepted"."""
    return "the draft accepted" if k == 1 else f"all {k} drafts accepted"


def final_chip(r: RoundRecord, f: FinalRecord) -> Chip:
    if f.outcome is Outcome.CORRECTED:
        how = f"correction sampled from the residual norm(max(0, p−q)) at row {f.row}"
    elif r.k:
        how = f"bonus sampled from the target's row {f.row} ({all_accepted(r.k)})"
    elif r.index == 0:
        how = "the prefill round: sampled from the target's row after the whole prompt, before any drafting"
    else:
        how = "sampled from the target alone (no drafts this round)"
    position = 0 if r.tree is not None else r.k    # a tree round's final token is its position 0
    return Chip(chip_text(f.text, f.pending), f.outcome, f"{how}: p={_num(f.p_target)} u={_num(f.u)}", r.index,
                position)


def tree_chips(r: RoundRecord, revealed: bool) -> list[Chip]:
    """A tree round in the stream: its accepted path and final token (the Round detail tab draws the tree)."""
    if not revealed:
        return [Chip(f"tree of {r.k}", Outcome.PENDING, f"a tree of {r.k} drafted nodes ({draft_source(r)}), not "
                     "yet verified", r.index, 0)]
    nodes = {n.index: n for n in r.tree.nodes}
    chips = [Chip(chip_text(nodes[i].text, nodes[i].pending), Outcome.ACCEPTED,
                  f"tree node {i} at depth {nodes[i].depth} ({draft_source(r)}): p={_num(nodes[i].p_target)} "
                  f"q={_num(nodes[i].q_draft)} α={_num(nodes[i].alpha)} u={_num(nodes[i].u)} · accepted", r.index, i)
             for i in r.tree.path[: len(r.emitted)]]
    if len(r.emitted) > r.accepted:
        chips.append(final_chip(r, r.final))
    return chips


def round_chips(r: RoundRecord, revealed: bool = True) -> list[Chip]:
    """Accepted drafts, then the rejected and discarded ones (struck), then the final token.

    Unrevealed, only the drafts show, all pending. Tokens cut by EOS or max_new_tokens are not shown.
    """
    if r.tree is not None:
        return tree_chips(r, revealed)
    if not revealed:
        return [position_chip(r, p, False) for p in r.positions]
    chips = [position_chip(r, p, True) for p in r.positions[: r.accepted]]
    chips += [position_chip(r, p, True) for p in r.positions[r.accepted:] if p.outcome is not Outcome.ACCEPTED]
    if len(r.emitted) > r.accepted:
        chips.append(final_chip(r, r.final))
    return chips


def stream_html(view: RunView | None, cursor: Cursor) -> str:
    """The prompt, then one group of chips per shown round; the selected token is outlined."""
    if view is None:
        return '<div class="stream"><em>Press Step to decode the first round, or load a trace.</em></div>'
    selection = cursor.selection(view)
    parts = [f'<span class="prompt" title="prompt">{html.escape(view.info.prompt)}</span>']
    shown = view.rounds[: cursor.shown]
    for r in shown:
        revealed = cursor.revealed or r.index != shown[-1].index
        parts.append(f'<span class="round-sep" title="round {r.index + 1}"></span>')
        parts += [c.html(selection == (c.round, c.position)) for c in round_chips(r, revealed)]
    return f'<div class="stream">{"".join(parts)}</div>'


def legend_html() -> str:
    """One sample chip per outcome, with what it means."""
    items = []
    for outcome, style in OUTCOME_STYLES.items():
        sample = f'<span class="chip {chip_class(outcome)}">{outcome.value}</span>'
        items.append(f"<span>{sample} {html.escape(style.meaning)}</span>")
    items.append("<span>· space &nbsp; ↵ newline &nbsp; → tab &nbsp;│ round boundary</span>")
    return f'<div class="legend">{"".join(items)}</div>'

"""Round detail: p_target vs q_draft at one position, the residual at a rejection, the bonus row, as bar charts."""
from __future__ import annotations

from engine.records import Candidate, Outcome, RoundRecord
from playground.render.bars import BarChart, BarSeries, marked, message_chart
from playground.render.palette import BLUE, ORANGE, OUTCOME_STYLES, PURPLE, VERMILLION
from playground.render.tokens import all_accepted, visible

P_COLOUR, Q_COLOUR, RESIDUAL_COLOUR = BLUE, ORANGE, VERMILLION


def _labels(candidates: list[Candidate]) -> tuple[str, ...]:
    """Axis labels: visible text, made unique with the id where two tokens print alike."""
    texts = [visible(c.text) for c in candidates]
    return tuple(t if texts.count(t) == 1 else f"{t} #{c.token}" for t, c in zip(texts, candidates))


def position_chart(record: RoundRecord, position: int, revealed: bool = True) -> BarChart:
    """The bars for position `position` of a round: 0..k-1 a drafted token, k the final token (a tree
    round: 1..k its nodes, 0 its final token)."""
    if not 0 <= position <= record.k:
        raise ValueError(f"position {position} is outside round {record.index}'s 0..{record.k}")
    if record.tree is not None:
        from playground.render.tree import node_chart

        return node_chart(record, position) if revealed else message_chart(
            "The tree's verification is pending: Step reveals it.")
    if position == record.k:
        if not revealed:
            return message_chart("The final token (correction or bonus) appears once verification is revealed.")
        return final_chart(record)
    return draft_chart(record, position, revealed)


def draft_chart(record: RoundRecord, position: int, revealed: bool = True) -> BarChart:
    """Grouped p_target / q_draft bars over the union of their top-N tokens, the draft outlined,
    α = min(1, p/q) and u in the title with the verdict."""
    p = record.positions[position]
    name = f"round {record.index + 1}, draft #{position + 1} {visible(p.text)!r}"
    if not revealed:
        return message_chart(f"{name}: drafted with q={p.q_draft:.3f}; verification is pending (Step to reveal).")
    if p.outcome is Outcome.UNCHECKED:
        return message_chart(f"{name} was never checked: an earlier draft was rejected, so it was discarded.")
    cands = p.candidates
    verdict = "u < α → ACCEPTED ✓" if p.outcome is Outcome.ACCEPTED else "u ≥ α → REJECTED ✗"
    return BarChart((f"{name} — {verdict}", f"p={p.p_target:.3f}, q={p.q_draft:.3f}, α=min(1, p/q)={p.alpha:.3f}, "
                                            f"u={p.u:.3f}"),
                    _labels(cands), (_series("p_target", cands, "p_target", P_COLOUR),
                                     _series("q_draft", cands, "q_draft", Q_COLOUR)),
                    _index(cands, p.token), "drafted")


def final_chart(record: RoundRecord) -> BarChart:
    """A correction: the normalised residual max(0, p − q) beside p and q, the sampled token marked.
    A bonus: the target's row K (or the only row, target-only), the sampled token marked."""
    f = record.final
    cands = f.candidates
    name = f"round {record.index + 1}, final token {visible(f.text)!r}"
    if f.outcome is Outcome.CORRECTED:
        return BarChart((f"{name} — CORRECTED ↻", f"draft #{f.row + 1} was rejected: the correction is sampled from "
                                                  f"the residual with u={f.u:.3f}"),
                        _labels(cands), (_series("p_target", cands, "p_target", P_COLOUR, 0.45, outlines=False),
                                         _series("q_draft", cands, "q_draft", Q_COLOUR, 0.45, outlines=False),
                                         _series("residual norm(max(0, p−q))", cands, "residual", RESIDUAL_COLOUR)),
                        _index(cands, f.token), "correction ↻")
    why = f"{all_accepted(record.k)}: row K={f.row} gives a free token" if record.k else "target-only: one token"
    return BarChart((f"{name} — BONUS ★", f"{why}, sampled with u={f.u:.3f} (p={f.p_target:.3f})"),
                    _labels(cands), (_series(f"p_target row {f.row} (bonus row)", cands, "p_target", PURPLE),),
                    _index(cands, f.token), "bonus ★")


def _series(name: str, candidates: list[Candidate], field: str, colour: str, opacity: float = 1.0,
            outlines: bool = True) -> BarSeries:
    return BarSeries(name, tuple(getattr(c, field) or 0.0 for c in candidates), colour, opacity, outlines)


def _index(candidates: list[Candidate], token: int) -> int | None:
    return marked([c.token for c in candidates], token)


def position_choices(record: RoundRecord) -> list[tuple[str, int]]:
    """Dropdown entries for a round's positions: (label, position); a tree round's nodes, then its final (0)."""
    if record.tree is not None:
        nodes = [(f"node {n.index} (depth {n.depth}) {visible(n.text)} {OUTCOME_STYLES[n.outcome].icon}", n.index)
                 for n in record.tree.nodes]
        return nodes + [(f"final {visible(record.final.text)} {OUTCOME_STYLES[record.final.outcome].icon}", 0)]
    out = []
    for p in record.positions:
        mark = OUTCOME_STYLES[p.outcome].icon
        out.append((f"draft #{p.index + 1} {visible(p.text)} {mark}", p.index))
    out.append((f"final {visible(record.final.text)} {OUTCOME_STYLES[record.final.outcome].icon}", record.k))
    return out


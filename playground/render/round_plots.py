"""Round detail: p_target vs q_draft at one position, the residual at a rejection, the bonus row."""
from __future__ import annotations

import plotly.graph_objects as go

from engine.records import Candidate, Outcome, RoundRecord
from playground.render.palette import BLUE, ORANGE, OUTCOME_STYLES, PURPLE, VERMILLION, styled_figure
from playground.render.tokens import all_accepted, visible

P_COLOUR, Q_COLOUR, RESIDUAL_COLOUR = BLUE, ORANGE, VERMILLION
HIGHLIGHT_WIDTH = 4


def _labels(candidates: list[Candidate]) -> list[str]:
    """Axis labels: visible text, made unique with the id where two tokens print alike."""
    texts = [visible(c.text) for c in candidates]
    return [t if texts.count(t) == 1 else f"{t} #{c.token}" for t, c in zip(texts, candidates)]


def _outline(candidates: list[Candidate], token: int) -> dict:
    """A thick black outline on the marked token's bar: highlighted without relying on colour."""
    return dict(line=dict(color=["#000" if c.token == token else "rgba(0,0,0,0)" for c in candidates],
                          width=[HIGHLIGHT_WIDTH if c.token == token else 0 for c in candidates]))


def _figure(bars: list, title: str, marks: list[dict]) -> go.Figure:
    """Grouped probability bars over token labels, built in one go (see palette.styled_figure)."""
    return styled_figure(bars, title=dict(text=title, font=dict(size=14)), barmode="group", height=360,
                         margin=dict(l=40, r=20, t=70, b=60), yaxis=dict(title="probability", rangemode="tozero"),
                         xaxis=dict(type="category"), legend=dict(orientation="h", y=-0.25), annotations=marks)


def _message(text: str) -> go.Figure:
    return styled_figure(annotations=[dict(text=text, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper",
                                           font=dict(size=14))],
                         height=220, xaxis=dict(visible=False), yaxis=dict(visible=False),
                         margin=dict(l=10, r=10, t=10, b=10))


def _mark(labels: list[str], candidates: list[Candidate], token: int, text: str, y: float) -> list[dict]:
    """An arrow over the marked token's bars. By position: plotly would read a label such as "22" as
    the number 22, off the category axis."""
    return [dict(x=labels.index(label), y=y, text=text, showarrow=True, arrowhead=2, ay=-35)
            for label, c in zip(labels, candidates) if c.token == token]


def position_figure(record: RoundRecord, position: int, revealed: bool = True) -> go.Figure:
    """The figure for position `position` of a round: 0..k-1 a drafted token, k the final token (a tree
    round: 1..k its nodes, 0 its final token)."""
    if not 0 <= position <= record.k:
        raise ValueError(f"position {position} is outside round {record.index}'s 0..{record.k}")
    if record.tree is not None:
        from playground.render.tree import node_figure

        return node_figure(record, position) if revealed else _message("The tree's verification is pending: Step "
                                                                         "reveals it.")
    if position == record.k:
        if not revealed:
            return _message("The final token (correction or bonus) appears once verification is revealed.")
        return final_figure(record)
    return draft_figure(record, position, revealed)


def draft_figure(record: RoundRecord, position: int, revealed: bool = True) -> go.Figure:
    """Grouped p_target / q_draft bars over the union of their top-N tokens, the draft outlined,
    α = min(1, p/q) and u in the title with the verdict."""
    p = record.positions[position]
    name = f"round {record.index + 1}, draft #{position + 1} {visible(p.text)!r}"
    if not revealed:
        return _message(f"{name}: drafted with q={p.q_draft:.3f}; verification is pending (Step to reveal).")
    if p.outcome is Outcome.UNCHECKED:
        return _message(f"{name} was never checked: an earlier draft was rejected, so it was discarded.")
    cands = p.candidates
    labels = _labels(cands)
    outline = _outline(cands, p.token)
    bars = [
        go.Bar(name="p_target", x=labels, y=[c.p_target for c in cands], marker=dict(color=P_COLOUR, **outline)),
        go.Bar(name="q_draft", x=labels, y=[c.q_draft for c in cands], marker=dict(color=Q_COLOUR, **outline)),
    ]
    verdict = "u < α → ACCEPTED ✓" if p.outcome is Outcome.ACCEPTED else "u ≥ α → REJECTED ✗"
    # the verdict on the title's short first line: a narrow panel cuts a long line at its right edge
    return _figure(bars, f"{name} — {verdict}<br>p={p.p_target:.3f}, q={p.q_draft:.3f}, "
                         f"α=min(1, p/q)={p.alpha:.3f}, u={p.u:.3f}",
                   _mark(labels, cands, p.token, "drafted", max(p.p_target or 0.0, p.q_draft)))


def final_figure(record: RoundRecord) -> go.Figure:
    """A correction: the normalised residual max(0, p − q) beside p and q, the sampled token marked.
    A bonus: the target's row K (or the only row, target-only), the sampled token marked."""
    f = record.final
    cands = f.candidates
    labels = _labels(cands)
    name = f"round {record.index + 1}, final token {visible(f.text)!r}"
    if f.outcome is Outcome.CORRECTED:
        bars = [
            go.Bar(name="p_target", x=labels, y=[c.p_target for c in cands], marker=dict(color=P_COLOUR), opacity=0.45),
            go.Bar(name="q_draft", x=labels, y=[c.q_draft for c in cands], marker=dict(color=Q_COLOUR), opacity=0.45),
            go.Bar(name="residual norm(max(0, p−q))", x=labels, y=[c.residual or 0.0 for c in cands],
                   marker=dict(color=RESIDUAL_COLOUR, **_outline(cands, f.token))),
        ]
        top = max([c.residual or 0.0 for c in cands if c.token == f.token] or [0.0])
        return _figure(bars, f"{name} — CORRECTED ↻<br>draft #{f.row + 1} was rejected: the correction is "
                             f"sampled from the residual with u={f.u:.3f}",
                       _mark(labels, cands, f.token, "correction ↻", top))
    bars = [go.Bar(name=f"p_target row {f.row} (bonus row)", x=labels, y=[c.p_target for c in cands],
                   marker=dict(color=PURPLE, **_outline(cands, f.token)))]
    why = f"{all_accepted(record.k)}: row K={f.row} gives a free token" if record.k else "target-only: one token"
    return _figure(bars, f"{name} — BONUS ★<br>{why}, sampled with u={f.u:.3f} (p={f.p_target:.3f})",
                   _mark(labels, cands, f.token, "bonus ★", f.p_target))


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


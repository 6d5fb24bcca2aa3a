"""A tree round as a tree: token chips laid out by depth, coloured by outcome, the accepted path bold,
edges from each node to its parent; and the p/q bars of one node's verification.

Pure functions of a RoundRecord whose `tree` is set. Chips carry data-round and data-pos (the node's
index; 0 is the final token) so a click selects them as stream chips are selected.
"""
from __future__ import annotations

import html

from engine.records import Outcome, RoundRecord, TreeNode
from playground.render.bars import BarChart, BarSeries, marked, message_chart
from playground.render.palette import OUTCOME_STYLES, chip_class
from playground.render.tokens import visible

ROW_PX = 34
FIT_PX = 880                 # the Round detail panel's width on a laptop screen: columns shrink to fit it
COLUMN_PX = (96, 150)        # a depth column's width, at least and at most; a chip is GAP_PX narrower
GAP_PX = 30


def _num(x: float | None) -> str:
    return "—" if x is None else f"{x:.3g}"


def node_title(node: TreeNode) -> str:
    """The hover text: p, q, alpha and u of the node's test, or why it has none."""
    head = f"node {node.index} (depth {node.depth}, under {'the root' if node.parent == 0 else f'node {node.parent}'}" \
           f"{', copied from the context by prompt lookup' if node.copied else ''})"
    if node.outcome is Outcome.UNCHECKED:
        return f"{head}: q={_num(node.q_draft)} · never reached (its parent was not accepted, or a sibling was)"
    verdict = "accepted" if node.outcome is Outcome.ACCEPTED else "rejected"
    return (f"{head}: p={_num(node.p_target)} q={_num(node.q_draft)} α=min(1,p/q)={_num(node.alpha)} "
            f"u={_num(node.u)} · {verdict}")


FINAL = -1   # the final token's place in the layout: a first child of the node it hangs under


def _layout(record: RoundRecord) -> dict[int, tuple[int, int]]:
    """(column, row) of every node and of the final token (FINAL): columns by depth, rows in
    depth-first order so subtrees stay together. The final token is laid out as the first child of
    the node it hangs under, so the accepted path runs along one row and no drafted child sits under it."""
    nodes = record.tree.nodes
    children: dict[int, list[int]] = {}
    for n in nodes:
        children.setdefault(n.parent, []).append(n.index)
    children.setdefault(record.tree.final_parent, []).insert(0, FINAL)
    place, row = {}, 0

    def visit(index: int, depth: int) -> None:
        nonlocal row
        kids = children.get(index, []) if index != FINAL else []
        if not kids:
            place[index] = (depth, row)
            row += 1
            return
        for kid in kids:
            visit(kid, depth + 1)
        place[index] = (depth, place[kids[0]][1])
    visit(0, 0)
    return place


def tree_html(record: RoundRecord, selected: int | None = None) -> str:
    """The round's tree: the root, every node as a chip, and the final token after the path's end."""
    if record.tree is None:
        return "<p><em>This round drafted a chain, not a tree.</em></p>"
    place = _layout(record)
    path = set(record.tree.path)
    final_col, final_row = place[FINAL]
    rows = max(r for _, r in place.values()) + 1
    columns = max(c for c, _ in place.values()) + 1
    col = max(COLUMN_PX[0], min(COLUMN_PX[1], FIT_PX // columns))   # deeper than that: the view scrolls
    chip_w = col - GAP_PX
    width, height = columns * col, rows * ROW_PX + 8
    # edges run from a parent's right edge to its child's left edge, so that none crosses a chip's text
    xy = {i: (c * col, r * ROW_PX + ROW_PX // 2) for i, (c, r) in place.items()}
    lines = []
    for n in record.tree.nodes:
        (x1, y1), (x2, y2) = xy[n.parent], xy[n.index]
        x1 += chip_w
        on_path = n.index in path
        lines.append(f'<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="{"#000" if on_path else "#bbb"}" '
                     f'stroke-width="{3 if on_path else 1}"/>')
    fx, fy = xy[FINAL]
    end = xy[record.tree.path[-1]] if record.tree.path else xy[0]
    lines.append(f'<line x1="{end[0] + chip_w}" y1="{end[1]}" x2="{fx}" y2="{fy}" stroke="#000" stroke-width="3"/>')
    size = f"width:{chip_w - 10}px"   # less its padding and border
    chips = [f'<span class="chip tree-root" style="left:0px;top:{place[0][1] * ROW_PX + 4}px;{size}" '
             f'title="the root: the last committed token">root</span>']
    for n in record.tree.nodes:
        c, r = place[n.index]
        bold = (" on-path" if n.index in path else "") + (" copied" if n.copied else "")
        sel = " selected" if selected == n.index else ""
        text = html.escape(visible(n.text)) + (f"‹{html.escape(n.pending)}›" if n.pending else "")
        chips.append(f'<span class="chip {chip_class(n.outcome)}{bold}{sel}" data-round="{record.index}" '
                     f'data-pos="{n.index}" data-outcome="{n.outcome.value}" style="left:{c * col}px;'
                     f'top:{r * ROW_PX + 4}px;{size}" title="{html.escape(node_title(n), quote=True)}">{text}</span>')
    f = record.final
    sel = " selected" if selected == 0 else ""
    chips.append(f'<span class="chip {chip_class(f.outcome)} on-path{sel}" data-round="{record.index}" data-pos="0" '
                 f'data-outcome="{f.outcome.value}" style="left:{final_col * col}px;top:{final_row * ROW_PX + 4}px;'
                 f'{size}" title="{html.escape(_final_title(record), quote=True)}">{html.escape(visible(f.text))}</span>')
    svg = f'<svg width="{width}" height="{height}" style="position:absolute;left:0;top:0">{"".join(lines)}</svg>'
    copies = " A thick left edge: copied from the context by prompt lookup." \
        if any(n.copied for n in record.tree.nodes) else ""
    legend = (f'<p class="tree-caption">Tree {html.escape(record.tree.shape)}: {record.k} drafted nodes, accepted path '
              f'of {len(record.tree.path)} (bold), then the {f.outcome.value} token.{copies} Click a node for its p and q.</p>')
    return (f'{legend}<div class="tree-scroll"><div class="tree-view" style="position:relative;width:{width}px;'
            f'height:{height}px">{svg}{"".join(chips)}</div></div>')


def _final_title(record: RoundRecord) -> str:
    f = record.final
    how = "drawn from the residual where no child was accepted" if f.outcome is Outcome.CORRECTED else \
        "the bonus from the accepted leaf's row"
    return f"final token ({f.outcome.value}): {how}; p={_num(f.p_target)} u={_num(f.u)}"


def node_chart(record: RoundRecord, node: int) -> BarChart:
    """p and q at a node's parent (the rows its test read), the node's token outlined; node 0 is the final."""
    if record.tree is None:
        return message_chart("This round drafted a chain, not a tree.")
    if node == 0:
        f = record.final
        cands, title, token = f.candidates, _final_title(record), f.token
    else:
        n = record.tree.nodes[node - 1]
        if n.outcome is Outcome.UNCHECKED:
            return message_chart(f"node {node} was never reached: its parent was not accepted, or a sibling was.")
        cands, title, token = n.candidates, node_title(n), n.token
    if not cands:
        return message_chart("No candidates recorded for this node (the run did not record for a UI).")
    series = [BarSeries("p_target", tuple(c.p_target for c in cands), OUTCOME_STYLES[Outcome.ACCEPTED].colour),
              BarSeries("q_draft", tuple(c.q_draft for c in cands), OUTCOME_STYLES[Outcome.PENDING].colour)]
    if any(c.residual is not None for c in cands):
        series.append(BarSeries("residual max(0, p − q), normalised", tuple(c.residual or 0.0 for c in cands),
                                OUTCOME_STYLES[Outcome.CORRECTED].colour, outlines=False))
    return BarChart((title,), tuple(f"{visible(c.text)} #{c.token}" for c in cands), tuple(series),
                    marked([c.token for c in cands], token))

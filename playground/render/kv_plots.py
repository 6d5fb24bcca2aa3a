"""KV state: a grid of physical blocks × slots per cache, and the block table, device and memory.

v2 writes K+1 slots in its verify forward and rolls the rejected ones back (orange kept, vermillion
rolled back); v1's verify writes nothing and its second forward writes only accepted tokens, so
its grid never shows a rollback. That difference is what these grids are for.
"""
from __future__ import annotations

import html

import plotly.graph_objects as go

from engine.records import KVState
from playground.render.palette import SLOT_COLOURS, SLOT_LABELS, SLOT_MARKS, SlotState, styled_figure


def slot_states(kv: KVState) -> list[list[SlotState]]:
    """[num_blocks][block_size] states of every physical slot after the round."""
    bs = kv.block_size
    grid = [[SlotState.FREE] * bs for _ in range(kv.num_blocks)]
    written = set(kv.written)
    for i in range(kv.length):
        slot = kv.block_table[i // bs] * bs + i % bs
        state = SlotState.PROMPT if i < kv.prompt_len else SlotState.COMMITTED
        grid[slot // bs][slot % bs] = SlotState.WRITTEN if slot in written and i >= kv.prompt_len else state
    live = {kv.block_table[i // bs] * bs + i % bs for i in range(kv.length)}
    for slot in kv.rolled_back:
        if slot not in live and slot // bs < kv.num_blocks:
            grid[slot // bs][slot % bs] = SlotState.ROLLED_BACK
    return grid


def _colourscale() -> list[tuple[float, str]]:
    """A stepped scale over [-0.5, 4.5]: each integer z sits mid-band and gets exactly its state's colour."""
    n = len(SlotState)
    scale = []
    for s in SlotState:
        scale += [(s.value / n, SLOT_COLOURS[s]), ((s.value + 1) / n, SLOT_COLOURS[s])]
    return scale


def kv_figure(kv: KVState) -> go.Figure:
    """Heatmap of physical blocks (rows) × slot offsets (columns), with a letter in each used cell
    (P prompt, C committed, W written this round, ✗ rolled back) so colour is never the only cue."""
    grid = slot_states(kv)
    owner = {b: n for n, b in enumerate(kv.block_table)}
    rows = [f"block {b}" + (f" (#{owner[b]})" if b in owner else "") for b in range(kv.num_blocks)]
    hover = [[f"physical block {b}, slot {b * kv.block_size + o}: {SLOT_LABELS[grid[b][o]]}"
              for o in range(kv.block_size)] for b in range(kv.num_blocks)]
    heat = go.Heatmap(z=[[s.value for s in row] for row in grid], x=list(range(kv.block_size)), y=rows,
                      text=[[SLOT_MARKS[s] for s in row] for row in grid], texttemplate="%{text}",
                      hovertext=hover, hoverinfo="text", colorscale=_colourscale(), zmin=-0.5,
                      zmax=len(SlotState) - 0.5, showscale=False, xgap=2, ygap=2)
    # Invisible points give the heatmap a legend of the five states.
    legend = [go.Scatter(x=[None], y=[None], mode="markers", name=f"{SLOT_MARKS[s] or '□'} {SLOT_LABELS[s]}",
                         marker=dict(symbol="square", size=12, color=SLOT_COLOURS[s])) for s in SlotState]
    return styled_figure([heat, *legend],
                         title=dict(text=f"{kv.model} cache on {kv.device}: {kv.length} slots used of "
                                         f"{kv.num_blocks * kv.block_size}", font=dict(size=14)),
                         height=110 + 28 * kv.num_blocks, margin=dict(l=90, r=20, t=50, b=45),
                         xaxis=dict(title="slot offset in block", dtick=1), yaxis=dict(autorange="reversed"),
                         legend=dict(x=1.02, y=1, yanchor="top"))


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def kv_table_html(states: list[KVState]) -> str:
    """Device, dtype, memory, block table and this round's block events, one column per cache."""
    if not states:
        return "<p><em>No KV state yet.</em></p>"
    rows = {
        "device": lambda k: k.device, "dtype": lambda k: k.dtype,
        "pool memory": lambda k: _mib(k.pool_bytes),
        "blocks × slots": lambda k: f"{k.num_blocks} × {k.block_size}",
        "cached tokens": lambda k: f"{k.length} (prompt {k.prompt_len})",
        "block table (logical → physical)":
            lambda k: ", ".join(f"{i}→{b}" for i, b in enumerate(k.block_table)) or "—",
        "slots written this round": lambda k: str(len(k.written)),
        "slots rolled back this round": lambda k: str(len(k.rolled_back)),
        "blocks allocated / freed": lambda k: f"{k.blocks_allocated or '—'} / {k.blocks_freed or '—'}",
    }
    head = "".join(f"<th>{html.escape(k.model)} cache</th>" for k in states)
    body = "".join(f"<tr><th>{html.escape(name)}</th>" + "".join(f"<td>{html.escape(str(fn(k)))}</td>" for k in states)
                   + "</tr>" for name, fn in rows.items())
    return f'<table class="kv-table"><tr><th></th>{head}</tr>{body}</table>'

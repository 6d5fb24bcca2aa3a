"""Colours and non-colour cues for outcomes and KV slot states (Okabe-Ito, colour-blind safe); the figures'
house style."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType

import plotly.graph_objects as go

from engine.records import Outcome

# Okabe & Ito (2008): distinguishable under the common colour-vision deficiencies.
ORANGE, SKY, GREEN, YELLOW, BLUE, VERMILLION, PURPLE, GREY = (
    "#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00", "#CC79A7", "#999999")


@dataclass(frozen=True, slots=True)
class OutcomeStyle:
    colour: str
    icon: str       # a non-colour cue shown after the token
    border: str     # CSS border style: a second non-colour cue
    meaning: str    # the legend's sentence


OUTCOME_STYLES: MappingProxyType[Outcome, OutcomeStyle] = MappingProxyType({
    Outcome.ACCEPTED: OutcomeStyle(GREEN, "✓", "solid", "draft accepted by the target (u < α)"),
    Outcome.REJECTED: OutcomeStyle(VERMILLION, "✗", "dashed",
                                   "draft rejected (struck through); later drafts are discarded unchecked"),
    Outcome.UNCHECKED: OutcomeStyle(ORANGE, "·", "dotted",
                                    "drafted after a rejection: discarded, never verified"),
    Outcome.CORRECTED: OutcomeStyle(BLUE, "↻", "double", "correction sampled from the residual max(0, p − q)"),
    Outcome.BONUS: OutcomeStyle(PURPLE, "★", "solid",
                                "bonus token from the target's extra row (every draft accepted, or target-only)"),
    Outcome.PENDING: OutcomeStyle(GREY, "?", "dotted", "drafted, not yet verified"),
})


def chip_class(outcome: Outcome) -> str:
    """The CSS class of a token chip with this outcome: the one place the class name is formed."""
    return f"chip-{outcome.value}"


class SlotState(int, Enum):
    """What a physical KV slot holds after a round; the value is the heatmap's z."""

    FREE = 0
    PROMPT = 1
    COMMITTED = 2
    WRITTEN = 3       # written this round and kept (speculative slots that survived verification)
    ROLLED_BACK = 4   # written this round, then rolled back with the rejected drafts


SLOT_COLOURS: MappingProxyType[SlotState, str] = MappingProxyType({
    SlotState.FREE: "#F2F2F2", SlotState.PROMPT: GREY, SlotState.COMMITTED: SKY,
    SlotState.WRITTEN: ORANGE, SlotState.ROLLED_BACK: VERMILLION})
SLOT_MARKS: MappingProxyType[SlotState, str] = MappingProxyType({
    SlotState.FREE: "", SlotState.PROMPT: "P", SlotState.COMMITTED: "C",
    SlotState.WRITTEN: "W", SlotState.ROLLED_BACK: "✗"})
SLOT_LABELS: MappingProxyType[SlotState, str] = MappingProxyType({
    SlotState.FREE: "free", SlotState.PROMPT: "prompt", SlotState.COMMITTED: "committed",
    SlotState.WRITTEN: "written this round (kept)", SlotState.ROLLED_BACK: "rolled back this round"})

SPEC_COLOUR, BASELINE_COLOUR, PREDICTED_COLOUR = BLUE, GREY, ORANGE

PLOT_GRID, PLOT_INK = "#EBF0F8", "#2a3f5f"


def styled_figure(data: list | None = None, **layout) -> go.Figure:
    """A figure in the house style: the template is given as the figure is built, since replacing
    Plotly's default one afterwards (update_layout(template=...)) costs some 30 ms more a figure."""
    return go.Figure(data or [], layout=dict(template=plot_template(), **layout))


def plot_template() -> dict:
    """Plotly's "plotly_white" look for the 2-D bar, scatter and heatmap figures drawn here, and nothing
    else. Naming "plotly_white" makes Plotly validate and copy that template's defaults for every trace
    type it knows, about 12 ms a figure and 8 ms more to serialise it; a Step redraws several figures."""
    axis = dict(gridcolor=PLOT_GRID, linecolor=PLOT_GRID, ticks="", title=dict(standoff=15), zerolinecolor=PLOT_GRID,
                automargin=True, zerolinewidth=2)
    layout = dict(autotypenumbers="strict", font=dict(color=PLOT_INK), hovermode="closest",
                  hoverlabel=dict(align="left"), paper_bgcolor="white", plot_bgcolor="white", title=dict(x=0.05),
                  xaxis=axis, yaxis=dict(axis),
                  colorway=["#636efa", "#EF553B", "#00cc96", "#ab63fa", "#FFA15A", "#19d3f3", "#FF6692", "#B6E880",
                            "#FF97FF", "#FECB52"],
                  coloraxis=dict(colorbar=dict(outlinewidth=0, ticks="")),
                  shapedefaults=dict(line=dict(color=PLOT_INK)),
                  annotationdefaults=dict(arrowcolor=PLOT_INK, arrowhead=0, arrowwidth=1))
    bars = dict(error_x=dict(color=PLOT_INK), error_y=dict(color=PLOT_INK),
                marker=dict(line=dict(color="white", width=0.5)))
    return dict(layout=layout, data=dict(bar=[bars], heatmap=[dict(colorbar=dict(outlinewidth=0, ticks=""))]))


def _chip_rule(outcome: Outcome) -> str:
    s = OUTCOME_STYLES[outcome]
    return (f".chip.{chip_class(outcome)} {{ border: 2px {s.border} {s.colour}; background: {s.colour}22; }}\n"
            f".chip.{chip_class(outcome)}::after {{ content: '{s.icon}'; color: {s.colour}; }}\n")


def stylesheet() -> str:
    """The app's CSS: chips, legend, badges. Passed to `launch(css=...)` (Gradio 6 takes CSS there)."""
    rules = "".join(_chip_rule(o) for o in Outcome)
    return rules + """
#pick-note, #pick-note * { font-size: 12px !important; line-height: 1.4 !important; color: var(--body-text-color-subdued) !important; }
.stream { font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size: 15px; line-height: 2.1; }
.stream .prompt { color: #666; white-space: pre-wrap; }
.chip { display: inline-block; padding: 0 3px; margin: 1px 1px; border-radius: 4px; cursor: pointer;
        white-space: pre; color: inherit; }
.chip::after { font-size: 10px; vertical-align: super; margin-left: 1px; }
.chip.chip-rejected { text-decoration: line-through; text-decoration-thickness: 2px; }
.chip.chip-unchecked { opacity: 0.55; text-decoration: line-through; }
.chip.selected { outline: 3px solid #000; outline-offset: 1px; }
.tree-view .chip { position: absolute; width: 110px; overflow: hidden; text-overflow: ellipsis; }
.tree-view .chip.on-path { font-weight: 700; box-shadow: 0 0 0 2px #000; }
.tree-view .chip.copied { border-left-width: 7px; }
.tree-scroll { overflow-x: auto; max-width: 100%; padding-bottom: 4px; }  /* deep trees scroll, never spill */
.tree-view .tree-root { background: #eee; border: 2px solid #999; cursor: default; }
.tree-caption { font-size: 13px; margin: 2px 0 6px; }
.bars { padding: 6px 4px 2px; }
.bars-title { font-size: 13px; line-height: 1.4; color: #2a3f5f; }
.bars-title.first { font-size: 14px; font-weight: 600; }
.bars-message { min-height: 120px; display: flex; flex-direction: column; justify-content: center; align-items: center;
                text-align: center; }
.bars-svg { display: block; width: 100%; height: auto; margin-top: 4px; }
.bars-svg rect:hover { stroke: #000; stroke-width: 1.5; }
.bars-legend { font-size: 12px; text-align: center; color: #2a3f5f; }
.bars-key { margin: 0 10px; white-space: nowrap; }
.bars-key i { display: inline-block; width: 11px; height: 11px; margin-right: 5px; vertical-align: -1px; }
.round-sep { display: inline-block; width: 1px; height: 1.2em; background: #bbb; margin: 0 3px;
             vertical-align: middle; }
.legend { display: flex; flex-wrap: wrap; gap: 10px 18px; font-size: 13px; margin: 4px 0; }
.legend .chip { cursor: default; }
.badge { display: inline-block; padding: 3px 10px; border-radius: 12px; font-weight: 600; }
.badge.ok { background: #009E7333; border: 2px solid #009E73; }
.badge.bad { background: #D55E0033; border: 2px solid #D55E00; }
.badge.na { background: #99999933; border: 2px dotted #999999; }
.theory-note.warn { border-left: 4px solid #D55E00; padding-left: 8px; }
/* the lesson's step titles sit centred under their dots; the first and last would spill past the page's edge */
#lesson-walkthrough .step-item:first-child .step-label { left: 0; width: max-content; max-width: none; text-align: left; }
#lesson-walkthrough .step-item:last-child .step-label { left: auto; right: 0; width: max-content; max-width: none; text-align: right; }
.kv-table { border-collapse: collapse; font-size: 13px; }
.kv-table td, .kv-table th { border: 1px solid #ccc; padding: 2px 6px; text-align: left; }
"""

"""In the browser: fit every shown Plotly figure to its panel again when a tab is shown.

Plotly sizes a figure from its container when it draws. A figure drawn while its tab is hidden has
no width to fit, so Plotly falls back to its default 700 px and keeps it when the tab is shown
(it re-fits only on a window resize): wider than a chart's panel, it is cut off on the right. The
server draws only the shown tab (see ui.Handlers.render), but a figure can still be drawn hidden,
for example by Play while another top-level tab is shown, or keep a size from before a resize.
"""
from __future__ import annotations

# Run on every tab selection. Two animation frames: the first lets the newly selected tab be laid
# out, so its figures have their panels' widths when they are fitted.
FIT_SHOWN_PLOTS_JS = """
() => {
  const fit = () => {
    if (!window.Plotly) return;
    for (const plot of document.querySelectorAll('.js-plotly-plot')) {
      if (plot.offsetParent !== null) window.Plotly.Plots.resize(plot).catch(() => {});
    }
  };
  requestAnimationFrame(() => requestAnimationFrame(fit));
}
"""

"""Number boxes and sliders whose value reaches the handler exactly as the browser or an API caller sent it.

Gradio's own gr.Number and gr.Slider round and bound-check a value before the handler runs, and
raise TypeError, ValueError or OverflowError on text, NaN or infinity sent through the API: the
caller then sees Gradio's generic error and the server logs a traceback. These components skip
that step, so playground.inputs parses every value and answers with a sentence naming the field
and what it allows. They draw as the ordinary components (`is_template`: Gradio then uses the
parent's frontend, as it does for its own gr.ClearButton).
"""
from __future__ import annotations

from typing import Any

import gradio as gr

class RawNumber(gr.Number):
    """gr.Number without its preprocessing; parse the value with playground.inputs."""

    is_template = True

    def preprocess(self, payload: Any) -> Any:
        return payload
    from typing import Callable, Literal, Sequence, Any, TYPE_CHECKING
    from gradio.blocks import Block
    if TYPE_CHECKING:
        from gradio.components import Timer
        from gradio.components.base import Component


class RawSlider(gr.Slider):
    """gr.Slider without its preprocessing; parse the value with playground.inputs."""

    is_template = True

    def preprocess(self, payload: Any) -> Any:
        return payload
    from typing import Callable, Literal, Sequence, Any, TYPE_CHECKING
    from gradio.blocks import Block
    if TYPE_CHECKING:
        from gradio.components import Timer
        from gradio.components.base import Component
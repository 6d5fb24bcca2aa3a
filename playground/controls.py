"""The control panel: prompt, model pair, drafter, mode, decoding settings and the transport buttons."""
from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from engine.config import K_BOUND, DrafterKind, KSchedule, Mode
from playground.components import RawNumber, RawSlider
from playground.controller import CHAT, RAW
from playground.registry import ModelRegistry, PairPreset, Recommended

MODES = (("v2: one target forward, rejected slots rolled back", Mode.V2.value),
         ("v1: verify read-only, then a second forward commits", Mode.V1.value),
         ("target only (the baseline)", Mode.TARGET.value))
DRAFTERS = (("draft model", DrafterKind.MODEL.value), ("n-gram (prompt lookup)", DrafterKind.NGRAM.value),
            ("hybrid: copy repeats, else the draft model", DrafterKind.HYBRID.value),
            ("EAGLE head: one layer over the target's features", DrafterKind.EAGLE.value),
            ("hybrid: copy repeats, else the EAGLE head", DrafterKind.EAGLE_HYBRID.value))
PROMPT_AS = (("a chat message (the target's chat template)", CHAT), ("raw text to continue", RAW))
SCHEDULES = (("constant", KSchedule.CONSTANT.value), ("heuristic (+2 after a full accept, −1 otherwise)",
                                                      KSchedule.HEURISTIC.value))


@dataclass(frozen=True)
class Controls:
    """The components whose values make a DecodeRequest (in `decode_inputs` order) and the buttons."""

    prompt: gr.Textbox
    preset: gr.Dropdown
    custom_draft: gr.Textbox
    custom_target: gr.Textbox
    mode: gr.Radio
    drafter: gr.Radio
    k: RawSlider
    k_schedule: gr.Radio
    k_min: RawSlider
    k_max: RawSlider
    temperature: RawSlider
    top_k: RawNumber
    top_p: RawSlider
    seed: RawNumber
    max_new_tokens: RawSlider
    prompt_as: gr.Radio
    system: gr.Textbox
    tree: gr.Textbox
    examples: gr.Dropdown
    reveal: gr.Checkbox
    reset: gr.Button
    step: gr.Button
    back: gr.Button
    play: gr.Button
    speed: RawSlider
    run_to_end: gr.Button
    scrubber: RawSlider

    def decode_inputs(self) -> list[gr.components.Component]:
        """In DecodeRequest's field order."""
        return [self.prompt, self.preset, self.custom_draft, self.custom_target, self.mode, self.drafter, self.k,
                self.k_schedule, self.k_min, self.k_max, self.temperature, self.top_k, self.top_p, self.seed,
                self.max_new_tokens, self.prompt_as, self.system, self.tree]

    def preset_outputs(self) -> list[gr.components.Component]:
        """What a change of model pair resets (`preset_defaults`)."""
        return [self.prompt, self.prompt_as, self.drafter, self.k, self.temperature, self.top_p, self.examples]


def _transport() -> dict:
    with gr.Row():
        reset = gr.Button("⟲ Reset", elem_id="reset-btn", size="sm")
        back = gr.Button("◀ Back", elem_id="back-btn", size="sm")
        step = gr.Button("Step ▶", variant="primary", elem_id="step-btn", size="sm")
    with gr.Row():
        play = gr.Button("▷ Play", elem_id="play-btn", size="sm")
        run_to_end = gr.Button("⇥ Run to end", elem_id="run-end-btn", size="sm")
    speed = RawSlider(0.2, 3.0, value=1.0, step=0.1, label="Play speed (seconds per step)")
    reveal = gr.Checkbox(False, label="Reveal sub-step: show drafts as pending before verifying",
                         elem_id="reveal-box")
    scrubber = RawSlider(0, 1, value=0, step=1, label="Rounds shown (scrub back over rounds already run)",
                         elem_id="scrubber")
    return dict(reset=reset, back=back, step=step, play=play, run_to_end=run_to_end, speed=speed, reveal=reveal,
                scrubber=scrubber)


def _models(registry: ModelRegistry) -> dict:
    preset = gr.Dropdown(registry.choices(), value=registry.presets[0].key, label="Model pair",
                         info="Hub pairs download on first use (press Reset to load them) and need internet access.")
    with gr.Row(visible=registry.allow_custom):
        custom_draft = gr.Textbox("", label="Custom draft id or path", placeholder="e.g. Qwen/Qwen2.5-0.5B",
                                  visible=registry.allow_custom)
        custom_target = gr.Textbox("", label="Custom target id or path", placeholder="e.g. Qwen/Qwen2.5-1.5B",
                                   visible=registry.allow_custom)
    return dict(preset=preset, custom_draft=custom_draft, custom_target=custom_target)


def _decoding(max_new_tokens: int, preset: PairPreset, registry: ModelRegistry) -> dict:
    rec = preset.recommended
    mode = gr.Radio(list(MODES), value=Mode.V2.value, label="Mode")
    # drafter and K are read when a page loads: the server may measure them on its CPU after it starts (engine.pick)
    drafter = gr.Radio(list(DRAFTERS), value=lambda: default_drafter(preset, registry.recommended(preset)),
                       label="Drafter", elem_id="drafter-radio", info=_fastest_info(registry.recommended(preset)))
    gr.Markdown(lambda: registry.pick_note(preset.key), elem_id="pick-note")
    with gr.Row():
        k = RawSlider(1, K_BOUND, value=lambda: registry.recommended(preset).k, step=1, label="K (drafts per round)")
        k_schedule = gr.Radio(list(SCHEDULES), value=KSchedule.CONSTANT.value, label="K schedule")
    with gr.Row():
        k_min = RawSlider(1, K_BOUND, value=1, step=1, label="K min (heuristic)")
        k_max = RawSlider(1, K_BOUND, value=8, step=1, label="K max (heuristic)")
    tree = gr.Textbox("", label="Tree (empty: a chain of K)", elem_id="tree-box", max_lines=1,
                      info="Widths per depth, e.g. 4-2-2-1 (static), or a node budget N16 / N16d6 (dynamic, up to "
                           "32 nodes); drafted by the draft model or the EAGLE head, and with a hybrid drafter by "
                           "prompt lookup too (copied nodes have a thick left edge). Greedy trees grow by the "
                           "draft's measured confidence; end in q (N16d6q) to grow by its raw q.")
    with gr.Row():
        temperature = RawSlider(0.0, 2.0, value=rec.temperature, step=0.05, label="Temperature (0 = greedy)",
                                info=_card_info(rec.temperature, rec), elem_id="temperature-slider")
        top_p = RawSlider(0.05, 1.0, value=rec.top_p, step=0.05, label="Top-p (1 = off)",
                          info=_card_info(rec.top_p, rec), elem_id="top-p-slider")
    with gr.Row():
        top_k = RawNumber(0, precision=0, label="Top-k (0 = off)", minimum=0)
        seed = RawNumber(0, precision=0, label="Seed")
    max_new = RawSlider(1, max_new_tokens, value=min(64, max_new_tokens), step=1, label="Max new tokens")
    return dict(mode=mode, drafter=drafter, k=k, k_schedule=k_schedule, k_min=k_min, k_max=k_max,
                temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, max_new_tokens=max_new, tree=tree)


def preset_defaults(registry: ModelRegistry, key: str) -> tuple:
    """(prompt, prompt-as, drafter, K, temperature, top-p, examples) that suit a model pair (`preset_outputs`):
    its first example, chat for a chat model, and its recommended settings (PairPreset.recommended), each
    saying where it comes from."""
    try:
        preset = registry.resolve(key)
    except ValueError:
        return tuple(gr.skip() for _ in range(7))
    examples = list(preset.examples) or [""]
    rec = registry.recommended(preset)
    return (examples[0], CHAT if preset.chat else RAW,
            gr.update(value=default_drafter(preset, rec), info=_fastest_info(rec)), rec.k,
            gr.update(value=rec.temperature, info=_card_info(rec.temperature, rec)),
            gr.update(value=rec.top_p, info=_card_info(rec.top_p, rec)),
            gr.Dropdown(choices=[(_short(e), e) for e in examples], value=examples[0]))


def default_drafter(preset: PairPreset, rec: Recommended | None = None) -> str:
    """The drafter measured fastest for the pair (`rec`: its recommended settings, the preset's own by default);
    without a measurement its own draft model, else its EAGLE head, else prompt lookup."""
    rec = rec or preset.recommended
    if rec.drafter is not None:
        return rec.drafter.value
    return DrafterKind.MODEL.value if preset.draft else (
        DrafterKind.EAGLE.value if preset.eagle else DrafterKind.NGRAM.value)


def _card_info(value: float, rec: Recommended) -> str | None:
    return f"Recommended for this model: {value:g} ({rec.source}); change it freely." if rec.source else None


def _fastest_info(rec: Recommended) -> str | None:
    if rec.drafter is None:
        return None
    if rec.measured_here:
        return (f"Recommended for this pair: {rec.drafter.value}, K={rec.k} (measured on this machine's CPU: the line "
                "below says how).")
    return f"Recommended for this pair: {rec.drafter.value}, K={rec.k} (the fastest chain in this project's bench)."


def _short(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= 60 else line[:59] + "…"


def build_controls(registry: ModelRegistry, max_new_tokens: int) -> Controls:
    """Lay the controls out in the current Blocks context and return them."""
    first = registry.presets[0]
    examples = list(first.examples) or [""]
    prompt = gr.Textbox(examples[0], lines=4, label="Prompt", elem_id="prompt-box")
    # the first example is selected, so the box never shows empty before it is opened
    example_box = gr.Dropdown([(_short(e), e) for e in examples], value=examples[0],
                              label="Example prompts for this pair", elem_id="examples-box")
    with gr.Row():
        prompt_as = gr.Radio(list(PROMPT_AS), value=CHAT if first.chat else RAW, label="Prompt as",
                             elem_id="prompt-as")
    system = gr.Textbox("", lines=1, label="System prompt (chat only; empty: the template's own)",
                        elem_id="system-box")
    transport = _transport()
    gr.Markdown("Settings apply from the next **Reset** (or the first Step after a reset).")
    with gr.Accordion("Models", open=False):
        models = _models(registry)
    with gr.Accordion("Decoding", open=True):
        decoding = _decoding(max_new_tokens, first, registry)
    example_box.input(lambda text: text, [example_box], [prompt], api_name=False)
    return Controls(prompt=prompt, **models, **decoding, prompt_as=prompt_as, system=system, examples=example_box,
                    **transport)


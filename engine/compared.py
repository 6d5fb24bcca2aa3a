"""A speculative run and its target-only baseline, interleaved on the same hardware, optionally traced.

A prompt is raw text (encoded with the target's tokenizer), a chat turn (through the target's chat
template, ending at the assistant's header), or ids already encoded."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from engine.calibration import RCurve
from engine.config import Mode, SpecConfig
from engine.pair import ModelPair
from engine.prompts import ChatPrompt, encode_chat, encode_prompt
from engine.records import RoundRecord, RunSummary
from engine.speculative import SpeculativeEngine, kv_bytes


def kv_bytes_needed(pair: ModelPair, prompt_tokens: int, config: SpecConfig, compare: bool = True) -> int:
    """KV pool bytes a ComparedRun allocates: its engine's pools, plus the target-only baseline's."""
    total = kv_bytes(pair, prompt_tokens, config)
    if compare and config.mode is not Mode.TARGET:
        total += kv_bytes(ModelPair(pair.target), prompt_tokens, replace(config, mode=Mode.TARGET))
    return total


class ComparedRun:
    """Drives a speculative engine one round at a time, with a target-only engine beside it.

    After each speculative round the baseline decodes until it has produced as many tokens (or
    finished), so the two curves of tokens against time are measured on the same prompt,
    settings and hardware, never estimated. Each engine's clock counts only its own work.
    With `trace_path`, every round is appended to a JSON Lines trace as it happens.
    """

    def __init__(self, pair: ModelPair, prompt: str | ChatPrompt | list[int], config: SpecConfig, *,
                 compare: bool = True, trace_path: str | Path | None = None, kv_blocks: int | None = None) -> None:
        from engine import trace

        tokenizer = pair.target.tokenizer
        self.chat = prompt if isinstance(prompt, ChatPrompt) else None
        if isinstance(prompt, ChatPrompt):   # the text shown is the template's, as the target reads it
            prompt_ids = encode_chat(tokenizer, prompt)
            self.prompt = tokenizer.decode(prompt_ids)
        elif isinstance(prompt, str):
            self.prompt, prompt_ids = prompt, encode_prompt(tokenizer, prompt)
        else:
            self.prompt, prompt_ids = tokenizer.decode(prompt), list(prompt)
        self.config, self.pair = config, pair
        self.spec = SpeculativeEngine(pair, prompt_ids, config, kv_blocks=kv_blocks)
        self.baseline: SpeculativeEngine | None = None
        if compare and config.mode is not Mode.TARGET:
            base_cfg = replace(config, mode=Mode.TARGET)
            self.baseline = SpeculativeEngine(ModelPair(pair.target), prompt_ids, base_cfg, kv_blocks=kv_blocks)
        self.calibration: RCurve | None = None
        self.writer = None
        if trace_path is not None:
            header = trace.make_header(self.prompt, prompt_ids, config, pair.target, pair.draft, self.chat,
                                       pair.eagle.name if pair.eagle is not None else None)
            self.writer = trace.TraceWriter(trace_path, header)

    def set_calibration(self, curve: RCurve) -> None:
        """Attach the target's measured r(n) (it may arrive while the run is under way); traced too."""
        self.calibration = curve
        if self.writer:
            self.writer.write_calibration(curve)

    @property
    def finished(self) -> bool:
        return self.spec.finished

    def step(self, catch_up: bool = True) -> RoundRecord:
        """One speculative round, then (`catch_up`) the target-only run up to its token count. Without
        `catch_up`, the baseline is left behind until `catch_up()` runs: the app runs it once the page has drawn
        the round, so that the page's drawing and the target-only rounds do not share the cores. A round left
        behind is caught up first."""
        self.catch_up()
        record = self.spec.step()
        if self.writer:
            self.writer.write_round(record, stream="spec")
        if catch_up:
            self.catch_up()
        return record

    @property
    def behind(self) -> bool:
        """Whether the target-only baseline has fewer tokens than the speculative run (and can go on)."""
        base = self.baseline
        return base is not None and not base.finished and len(base.generated) < len(self.spec.generated)

    def catch_up(self) -> int:
        """Target-only rounds up to the speculative run's token count; the trace's summaries once both are done.
        Returns the rounds run."""
        ran = 0
        while self.behind:
            b = self.baseline.step()
            ran += 1
            if self.writer:
                self.writer.write_round(b, stream="baseline")
        if self.finished:
            self._finish()
        return ran

    def run_to_end(self) -> list[RoundRecord]:
        while not self.finished:
            self.step()
        return self.spec.rounds

    def identical_to_baseline(self) -> bool | None:
        """Greedy runs must match target-only token for token; None when there is nothing to compare."""
        if self.baseline is None:
            return None
        n = min(len(self.spec.generated), len(self.baseline.generated))
        return self.spec.generated[:n] == self.baseline.generated[:n]

    def summaries(self) -> tuple[RunSummary, RunSummary | None]:
        base = self.baseline.summary() if self.baseline and self.baseline.rounds else None
        return self.spec.summary(), base

    def _finish(self) -> None:
        if self.writer:
            spec, base = self.summaries()
            self.writer.write_summary(spec, stream="spec")
            if base is not None:
                self.writer.write_summary(base, stream="baseline")
            self.writer.close()
            self.writer = None

    def close(self) -> None:
        if self.writer:
            self.writer.close()
            self.writer = None
        self.spec.close()
        if self.baseline:
            self.baseline.close()

"""The README a newcomer reads: short, its two commands name files that exist, and its engine snippet runs."""
from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from engine.sources import smollm2_gguf

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def test_it_is_short_and_its_two_commands_install_what_exists():
    assert len(README.splitlines()) <= 150
    commands = re.findall(r"^pip install .*$", README, flags=re.M)
    assert [c.endswith("python app.py") for c in commands] == [True, False]
    assert commands[1].endswith("python -m pytest -q")
    for command in commands:
        for name in re.findall(r"-r (\S+)", command):
            assert (REPO / name).is_file(), name
    for link in re.findall(r"\]\(((?:docs|assets)/[^)#]+)\)", README):
        assert (REPO / link).exists(), link


@pytest.mark.skipif(smollm2_gguf() is None, reason="the SmolLM2 wheel is not installed")
def test_the_engine_snippet_runs_as_written():
    snippet = re.search(r"## The engine in a few lines\n\n```python\n(.*?)```", README, flags=re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(snippet, "README.md", "exec"), {"__name__": "readme"})
    text, alpha = out.getvalue().rstrip("\n").rsplit("\n", 1)
    assert len(text.split()) > 10 and 0.0 <= float(alpha) <= 1.0

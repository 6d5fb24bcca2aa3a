"""The docs a newcomer reads stay true to the tree: every function docs/round.md names exists where it says,
and every relative link in docs/ leads to a file."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = sorted((REPO / "docs").glob("*.md"))


def resolve(dotted: str) -> object:
    """`speculative.SpeculativeEngine.step` -> the object, as a module of engine/ and attributes inside it."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module("engine." + ".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(f"no module of engine/ begins {dotted!r}")


def test_every_function_the_round_walk_names_exists():
    names = set(re.findall(r"`([a-z_]+(?:\.[A-Za-z_]+)+)`", (REPO / "docs" / "round.md").read_text()))
    assert len(names) > 40        # the walk names each function of a round once
    missing = []
    for name in sorted(names):
        try:
            resolve(name)
        except (ImportError, AttributeError):
            missing.append(name)
    assert not missing, f"docs/round.md names what the code no longer has: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_lead_to_files(doc):
    links = re.findall(r"\]\((?!https?:|#|mailto:)([^)#\s]+)", doc.read_text())
    broken = [link for link in links if not (doc.parent / link).exists()]
    assert not broken, f"{doc.name} links to what is not there: {broken}"

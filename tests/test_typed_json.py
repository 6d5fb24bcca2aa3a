"""engine.typed_json: JSON values checked against type hints, with the failing field's path in the message."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import pytest

from engine.typed_json import Invalid, decode


class Colour(str, Enum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True, slots=True)
class Leaf:
    token: int
    weight: float
    colour: Colour
    note: str | None = None


@dataclass(frozen=True, slots=True)
class Tree:
    name: str
    leaves: list[Leaf]
    tags: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name must not be empty")


GOOD = {"name": "t", "leaves": [{"token": 1, "weight": 2, "colour": "red", "note": None}], "tags": {"a": 1}}


def test_a_good_value_is_built_into_records():
    tree = decode(Tree, GOOD, "tree")
    assert tree == Tree("t", [Leaf(1, 2.0, Colour.RED)], {"a": 1})
    assert type(tree.leaves[0].weight) is float and tree.leaves[0].colour is Colour.RED


@pytest.mark.parametrize("change, message", [
    (lambda v: v["leaves"].append({**v["leaves"][0], "token": True}), "tree.leaves[1].token: expected an integer, got bool"),
    (lambda v: v["leaves"][0].update(weight=float("inf")), "tree.leaves[0].weight: inf is not a finite number"),
    (lambda v: v["leaves"][0].update(colour=["red"]), "tree.leaves[0].colour: ['red'] is not one of red, blue"),
    (lambda v: v["leaves"][0].pop("note"), "tree.leaves[0]: missing key(s) note"),
    (lambda v: v.update(extra=1), "tree: unknown key(s) extra"),
    (lambda v: v["tags"].update(b="2"), "tree.tags.b: expected an integer, got str"),
    (lambda v: v.update(leaves={}), "tree.leaves: expected a list, got dict"),
    (lambda v: v.update(name=""), "tree: name must not be empty"),
])
def test_a_bad_value_names_its_field(change, message):
    value = {**GOOD, "leaves": [dict(GOOD["leaves"][0])], "tags": dict(GOOD["tags"])}
    change(value)
    with pytest.raises(Invalid) as info:
        decode(Tree, value, "tree")
    assert info.value.at("tree") == message


def test_a_deep_value_does_not_recurse_past_the_type():
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(Invalid, match="expected an integer, got list"):
        decode(list[int], deep, "ids")

"""Request validation on its own: the JSON form of metadata, built without json_format."""

from __future__ import annotations

import math
from typing import Any

import pytest
from google.protobuf import json_format
from google.protobuf.struct_pb2 import Struct

from continuum_transcript import validation
from continuum_transcript.errors import BadRequest


def test_metadata_is_what_json_format_makes_of_it() -> None:
    value = Struct()
    value.update(
        {
            "text": "é\x00",
            "count": 3,
            "ratio": -0.25,
            "flag": False,
            "nothing": None,
            "nested": {"list": [1, "two", None, True, {"deep": [[]]}], "empty": {}},
        }
    )
    value.fields["unset"]  # a Value with no kind at all reads as null, as in json_format

    converted = validation.metadata(value, "messages[0].metadata")

    expected = json_format.MessageToDict(value)
    assert converted == expected and list(converted) == list(expected)
    assert converted["unset"] is None and converted["nested"]["list"][4] == {"deep": [[]]}


@pytest.mark.parametrize("number", [math.nan, math.inf, -math.inf])
def test_metadata_numbers_must_be_finite(number: float) -> None:
    value = Struct()
    value.update({"outer": {"inner": [1, number]}})

    with pytest.raises(BadRequest) as refused:
        validation.metadata(value, "messages[3].metadata")

    assert [violation.field for violation in refused.value.violations] == ["messages[3].metadata"]


def _nested(levels: int, container: str) -> Struct:
    """Metadata whose objects (or arrays, below the top object) nest `levels` deep."""
    inner: Any = {"leaf": 1} if container == "object" else [1]
    for _ in range(levels - 2):
        inner = {"a": inner} if container == "object" else [inner]
    value = Struct()
    value.update({"a": inner})
    return value


@pytest.mark.parametrize("container", ["object", "array"])
def test_metadata_nests_at_most_as_deep_as_protobuf_decodes(container: str) -> None:
    deepest = _nested(validation.MAX_METADATA_DEPTH, container)
    assert validation.metadata(deepest, "metadata") == json_format.MessageToDict(deepest)

    with pytest.raises(BadRequest) as refused:
        validation.metadata(_nested(validation.MAX_METADATA_DEPTH + 1, container), "messages[1].metadata")
    (violation,) = refused.value.violations
    assert violation.field == "messages[1].metadata" and "32 levels" in violation.description

"""Request validation on its own: the JSON form of metadata, built without json_format."""

from __future__ import annotations

import math

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

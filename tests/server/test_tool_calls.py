"""The schema a tool_choice of "required" or a named function makes the grammar
enforce: object schemas that do not state additionalProperties are closed,
at every depth; one that states it keeps it. Checked with jsonschema, which
reads the schemas as the JSON Schema specification says.
"""

import jsonschema
import pytest

from jaxinfer.server.tool_calls import closed_schema

PARAMETERS = {
    "type": "object",
    "properties": {
        "zone": {"type": "string"},
        "options": {"type": "object", "properties": {"format": {"enum": ["12h", "24h"]}}},
        "history": {"type": "array", "items": {"type": "object", "properties": {"at": {"type": "integer"}}}},
        "where": {"anyOf": [{"type": "object", "properties": {"city": {"type": "string"}}}, {"type": "null"}]},
        "meta": {"type": "object", "additionalProperties": True},
        "tags": {"type": "object", "additionalProperties": {"type": "string"}},
        "ref": {"$ref": "#/$defs/point"},
    },
    "required": ["zone"],
    "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}}}},
}


def test_closed_schema_refuses_unlisted_keys_at_every_depth():
    closed = closed_schema(PARAMETERS)
    good = {"zone": "Paris", "options": {"format": "24h"}, "history": [{"at": 1}], "where": {"city": "Lyon"},
            "meta": {"anything": [1, 2]}, "tags": {"a": "b"}, "ref": {"x": 1.5}}
    jsonschema.validate(good, PARAMETERS)
    jsonschema.validate(good, closed)
    extra_keys = [
        {"zone": "Paris", "state": "x"},
        {"zone": "Paris", "options": {"format": "24h", "description": "y"}},
        {"zone": "Paris", "history": [{"at": 1, "by": "me"}]},
        {"zone": "Paris", "where": {"city": "Lyon", "country": "FR"}},
        {"zone": "Paris", "ref": {"x": 1, "y": 2}},
    ]
    for instance in extra_keys:
        jsonschema.validate(instance, PARAMETERS)  # the schema as written lets them through
        with pytest.raises(jsonschema.ValidationError, match="Additional properties"):
            jsonschema.validate(instance, closed)
    jsonschema.validate({"zone": "Paris", "meta": {"free": 1}}, closed)  # explicit true: still open
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"zone": "Paris", "tags": {"a": 1}}, closed)  # an explicit schema is kept
    assert closed["properties"]["meta"]["additionalProperties"] is True
    assert closed["properties"]["tags"]["additionalProperties"] == {"type": "string"}
    assert "additionalProperties" not in PARAMETERS  # the request's own schema is not changed


def test_schema_that_says_true_keeps_its_meaning():
    open_schema = {"type": "object", "properties": {"zone": {"type": "string"}}, "additionalProperties": True}
    assert closed_schema(open_schema) == open_schema
    jsonschema.validate({"zone": "Paris", "state": "x"}, closed_schema(open_schema))

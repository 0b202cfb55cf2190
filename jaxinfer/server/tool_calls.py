"""What a chat request's `tools` and `tool_choice` make of it.

    none       the tools are rendered (the template may show them) but the
               output is plain content
    auto       the model is free; the template family's parser
               (server/tool_parsers.py) finds calls in what it writes; needs a
               parser (--tool-call-parser, or one detected from the template)
    required   decoding is constrained (structured outputs) to a JSON array of
               1+ calls (1 with parallel_tool_calls=false), each {"name": one
               of the tools, "arguments": that tool's parameters schema}
    {"type": "function", "function": {"name": N}}
               decoding is constrained to N's parameters schema, and the
               output is N's arguments (finish_reason "stop", as OpenAI)

so that `required` and a named function give arguments that validate
against the schema whatever the model, while `auto` is as good as the
model's own tool use.

For the grammar, an object schema in a tool's parameters that does not say
`additionalProperties` is closed (false), as vLLM's default grammar backend
reads it: otherwise the grammar lets a model invent keys the tool never
listed. A schema that says `additionalProperties: true` keeps that meaning.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxinfer.sampling_params import InvalidSamplingParameter, StructuredOutputsParams
from jaxinfer.server.errors import APIError
from jaxinfer.server.tool_parsers import FAMILIES, PARSERS, named_parser, parse_required

_ANY_OBJECT = {"type": "object"}


@dataclass
class ToolPlan:
    """How one request's output is constrained and read back."""

    parse: object  # text -> Parsed, or None: plain content
    structured: StructuredOutputsParams | None  # the constraint replacing the request's own, or None
    named: bool = False  # a named function: finish_reason stays "stop"
    keep_special_tokens: bool = False  # the family's marker is a special token (mistral)


def template_tools(request) -> list[dict] | None:
    """The tools as chat templates take them (OpenAI's shape, as Hugging Face passes them)."""
    if not request.tools:
        return None
    return [tool.model_dump(exclude_none=True) for tool in request.tools]


# Keywords whose value is a schema, a list of schemas, or a {name: schema} map.
_SUBSCHEMA = ("items", "contains", "not", "if", "then", "else", "additionalProperties", "unevaluatedProperties",
              "propertyNames", "additionalItems", "unevaluatedItems")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _is_object_schema(schema: dict) -> bool:
    kind = schema.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in schema


def closed_schema(schema):
    """A copy of `schema` in which every object schema that does not state
    additionalProperties has it false; one that states it (true, false or a
    schema) keeps what it says."""
    if isinstance(schema, list):  # the legacy form of items: one schema per position
        return [closed_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema  # true / false schemas
    closed = dict(schema)
    for key in _SUBSCHEMA:
        if key in closed:
            closed[key] = closed_schema(closed[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(closed.get(key), list):
            closed[key] = [closed_schema(s) for s in closed[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(closed.get(key), dict):
            closed[key] = {name: closed_schema(s) for name, s in closed[key].items()}
    if _is_object_schema(closed) and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


def _parameters(tool) -> dict:
    """The schema the grammar enforces on a tool's arguments."""
    return closed_schema(tool.function.parameters or _ANY_OBJECT)


def required_schema(tools, parallel: bool) -> dict:
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name}, "arguments": _parameters(t)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def plan(request, parser_name: str | None) -> ToolPlan:
    """parser_name: the server's tool-call parser (given or detected), or None."""
    choice = request.effective_tool_choice
    if choice == "none" or not request.tools:
        return ToolPlan(None, None)
    try:
        own = request.structured_spec()
    except InvalidSamplingParameter as e:
        raise APIError(400, str(e), "structured_outputs") from None
    if choice == "auto":
        if parser_name is None:
            raise APIError(400, "tool_choice 'auto' needs a tool-call parser, and this model's chat template has "
                                f"no tool-call format the server knows; start it with --tool-call-parser "
                                f"({', '.join(PARSERS)}), or use tool_choice 'required' or a named function",
                           "tool_choice")
        return ToolPlan(FAMILIES[parser_name], None, keep_special_tokens=parser_name == "mistral")
    if own is not None:
        raise APIError(400, f"tool_choice {choice if isinstance(choice, str) else 'of a named function'} "
                            "constrains the output itself; it cannot be combined with response_format or "
                            "structured outputs", "tool_choice")
    if choice == "required":
        return ToolPlan(parse_required, StructuredOutputsParams(json=required_schema(request.tools,
                                                                                     request.parallel_tool_calls)))
    name = choice.function.name
    tool = next(t for t in request.tools if t.function.name == name)
    return ToolPlan(named_parser(name), StructuredOutputsParams(json=_parameters(tool)), named=True)


def finish_reason(plan_: ToolPlan, reason: str | None, num_calls: int) -> str | None:
    """OpenAI's: "tool_calls" when calls end an auto or required answer."""
    if reason == "stop" and num_calls and not plan_.named:
        return "tool_calls"
    return reason

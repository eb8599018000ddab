"""What a chat or completions request constrains its answer to (`sampling/grammar.py`).

- `response_format`: `{"type": "json_object"}` (any JSON object), `{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}` (JSON matching the schema; `strict` or not,
  the schema is enforced), and llama.cpp's `{"type": "json_object", "schema": {...}}`;
- llama.cpp's `json_schema` (a schema) and `grammar` (GBNF) fields;
- vLLM's `structured_outputs`: `json` (a schema), `json_object`, `regex`, `choice` or
  `grammar`; without it a vLLM client's constraint would be quietly ignored;
- a forced `tool_choice` ("required", a named function) in a template with JSON calls: the
  call after its prefilled opening, to an offered tool with arguments matching its schema.

At most one of the first four; a forced call wins over them (its answer is the call).
Each is compiled before the request is queued, so a schema that cannot be used is a 400.
"""

from __future__ import annotations

import json

from ninfer_core.sampling.grammar import Constraint, GrammarError
from ninfer_core.serve import constraints
from ninfer_core.serve.state import ServeState
from ninfer_plugins.frontend_openai import wire
from ninfer_plugins.frontend_openai.common import refuse


def response_constraint(
    data: wire.SamplingFields, response_format: wire.ResponseFormat | None
) -> tuple[Constraint | None, str]:
    """(the constraint the request's own fields ask for, the field it came from)."""
    asked: list[tuple[Constraint, str]] = []
    field = "response_format"
    try:
        if response_format is not None and response_format.type != "text":
            asked.append((format_constraint(response_format), field))
        if data.json_schema is not None:
            field = "json_schema"
            asked.append((Constraint.json_schema(data.json_schema), field))
        if data.grammar is not None:
            asked.append((Constraint("gbnf", data.grammar), "grammar"))
        if data.structured_outputs is not None:
            field = "structured_outputs"
            asked.append((structured_constraint(data.structured_outputs), field))
    except GrammarError as exc:
        raise refuse(field, str(exc)) from None
    if len(asked) > 1:
        raise refuse(asked[1][1], f"cannot be combined with {asked[0][1]}")
    return asked[0] if asked else (None, "")


def format_constraint(fmt: wire.ResponseFormat) -> Constraint:
    if fmt.type == "json_object":
        return Constraint.json_schema(fmt.schema_) if fmt.schema_ else Constraint("json_object")
    if fmt.type == "json_schema":
        given = fmt.json_schema.schema_ if fmt.json_schema is not None else fmt.schema_
        if given is None:
            raise refuse("response_format", "json_schema needs json_schema.schema")
        return Constraint.json_schema(given)
    raise refuse(
        "response_format", f"type must be text, json_object or json_schema, got {fmt.type!r}"
    )


def structured_constraint(so: wire.StructuredOutputs) -> Constraint:
    """vLLM's `structured_outputs` as a constraint: exactly one of its kinds."""
    given: list[Constraint] = []
    if so.json is not None:
        try:
            schema = json.loads(so.json) if isinstance(so.json, str) else so.json
        except (ValueError, RecursionError) as exc:  # nesting past the interpreter's limit
            raise refuse("structured_outputs", f"json is not valid JSON: {exc}") from None
        given.append(Constraint.json_schema(schema))
    if so.json_object:
        given.append(Constraint("json_object"))
    if so.regex is not None:
        given.append(Constraint("regex", so.regex))
    if so.choice is not None:
        if not so.choice:
            raise refuse("structured_outputs", "choice needs at least one string")
        given.append(Constraint("choice", json.dumps(so.choice, ensure_ascii=False)))
    if so.grammar is not None:
        given.append(Constraint("gbnf", so.grammar))
    if len(given) != 1:
        raise refuse(
            "structured_outputs", "give exactly one of json, json_object, regex, choice, grammar"
        )
    return given[0]


async def request_constraint(
    state: ServeState,
    data: wire.SamplingFields,
    response_format: wire.ResponseFormat | None,
    forced: Constraint | None = None,
) -> Constraint | None:
    """The request's constraint, compiled for the served model (a 400 when it cannot be)."""
    if forced is not None:
        return forced
    constraint, param = response_constraint(data, response_format)
    return await constraints.checked(state, constraint, param)

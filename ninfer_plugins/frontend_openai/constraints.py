"""What a chat or completions request constrains its answer to (`sampling/grammar.py`).

- `response_format`: `{"type": "json_object"}` (any JSON object), `{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}` (JSON matching the schema; `strict` or not,
  the schema is enforced), and llama.cpp's `{"type": "json_object", "schema": {...}}`;
- llama.cpp's `json_schema` (a schema) and `grammar` (GBNF) fields;
- a forced `tool_choice` ("required", a named function) in a template with JSON calls: the
  call after its prefilled opening, to an offered tool with arguments matching its schema.

At most one of the first three; a forced call wins over them (its answer is the call).
Each is compiled before the request is queued, so a schema that cannot be used is a 400.
"""

from __future__ import annotations

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
    try:
        if response_format is not None and response_format.type != "text":
            asked.append((format_constraint(response_format), "response_format"))
        if data.json_schema is not None:
            asked.append((Constraint.json_schema(data.json_schema), "json_schema"))
        if data.grammar is not None:
            asked.append((Constraint("gbnf", data.grammar), "grammar"))
    except GrammarError as exc:
        raise refuse("response_format", str(exc)) from None
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

"""A request's constraint checked before it is queued: a schema or grammar that does not
compile is the client's 400 in its protocol's shape, never a failed stream.

Compiling runs in a worker thread (a large schema takes milliseconds to tens of them, and
llguidance bounds it, `sampling/grammar.py`); the engine caches what compiled, so the
request's matcher costs a look-up when its first token comes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from ninfer_core.sampling.grammar import Constraint, GrammarError
from ninfer_core.serve.errors import invalid
from ninfer_core.serve.state import ServeState
from ninfer_core.text.tool_choice import ForcedCall, call_grammar

#: llguidance's reasons can quote the grammar; a 400 says enough in this many characters.
MAX_REASON = 500


async def checked(
    state: ServeState, constraint: Constraint | None, param: str
) -> Constraint | None:
    """`constraint` once it compiled for the served model, else a 400 naming `param`."""
    if constraint is None:
        return None
    try:
        await asyncio.to_thread(state.engine.grammars.compile, constraint)
    except GrammarError as exc:
        why = str(exc) if len(str(exc)) <= MAX_REASON else str(exc)[:MAX_REASON] + "…"
        raise invalid(f"{param}: the schema or grammar cannot be used: {why}", param) from None
    return constraint


async def forced_call(
    state: ServeState, forced: ForcedCall | None, tools: Sequence[dict] | None
) -> Constraint | None:
    """The constraint of a forced tool call (the rest of the call after its prefilled
    opening: an offered tool's name and arguments matching its schema), or None when the
    template's call form is not the JSON one (the prefill alone forces it then)."""
    grammar = call_grammar(state.template, forced, tools, state.tokenizer)
    if grammar is None:
        return None
    return await checked(state, Constraint("lark", grammar), "tools")

"""Past responses, kept in memory for `previous_response_id` and `GET /v1/responses/{id}`.

Bounded two ways, least recently used first out: a number of responses, and the characters
they hold (each entry counts its response and its conversation as JSON). A chained
conversation stores its whole item list with every response, so one lookup rebuilds it and
evicting an old response never breaks a newer one; the character bound is what keeps long
chains from growing without limit. Nothing survives a restart, and an evicted or unknown id
is a 404 naming `previous_response_id`, which a client answers by sending the whole
conversation.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import msgspec

from ninfer_core.errors import elided
from ninfer_core.serve.errors import ApiError
from ninfer_plugins.frontend_responses import wire


@dataclass(frozen=True)
class Stored:
    response: wire.ResponseObject
    #: The conversation up to and including this response: earlier responses' items, this
    #: request's input items and this response's output items (instructions excluded, as
    #: OpenAI does not carry them over).
    items: list[wire.InputItem]
    size: int


class ResponseStore:
    def __init__(self, max_responses: int, max_chars: int) -> None:
        self.max_responses = max_responses
        self.max_chars = max_chars
        self._entries: OrderedDict[str, Stored] = OrderedDict()
        self._chars = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._entries

    def put(self, response: wire.ResponseObject, items: list[wire.InputItem]) -> bool:
        """Keep `response`, evicting the least recently used; False when it alone exceeds
        the character bound (then it is not kept)."""
        size = len(msgspec.json.encode(response)) + len(msgspec.json.encode(items))
        if size > self.max_chars or self.max_responses < 1:
            return False
        self.delete(response.id)
        while self._entries and (
            len(self._entries) >= self.max_responses or self._chars + size > self.max_chars
        ):
            _, old = self._entries.popitem(last=False)
            self._chars -= old.size
        self._entries[response.id] = Stored(response, items, size)
        self._chars += size
        return True

    def get(self, response_id: str, *, param: str | None = None) -> Stored:
        """The stored response (now the most recently used); a 404 when unknown."""
        entry = self._entries.get(response_id)
        if entry is None:
            # An id is ours (`resp_` and 32 hex digits): a longer one is not echoed back.
            raise ApiError(
                404,
                "not_found",
                f"Response with id {elided(response_id, 64)!r} not found (never stored, or "
                "evicted from this server's bounded store).",
                param=param,
            )
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._chars -= entry.size
        return True

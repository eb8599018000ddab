"""The OpenAI Responses API frontend: `/v1/responses` (and `GET`/`DELETE` of a stored one).

Registered through the `ninfer` entry point `frontend-responses`. It builds on the OpenAI
frontend (prompt building, tool-call and reasoning parsing, sampling, the error shape), so
the same conversation gets the same answer from `/v1/chat/completions` and `/v1/responses`.
Importing it is cheap: litestar and the handlers load when an app asks for routes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ninfer_core import hookimpl
from ninfer_core.support import Support

if TYPE_CHECKING:
    from ninfer_core.device import DeviceInfo
    from ninfer_core.serve.errors import ApiError
    from ninfer_core.serve.state import ServeState

#: The store's bounds (`store.py`): responses kept, and the characters they may hold.
MAX_STORED = 1024
MAX_STORED_CHARS = 64 * 1024 * 1024


class ResponsesFrontend:
    name = "responses"
    description = "OpenAI Responses API: /v1/responses (streaming, tools, reasoning, storage)"
    #: OpenAI's error shape; `/v1` is the OpenAI frontend's already, the bare path is ours.
    error_paths = ("/v1/responses", "/responses")

    def __init__(self, max_stored: int = MAX_STORED, max_stored_chars: int = MAX_STORED_CHARS):
        self.max_stored = max_stored
        self.max_stored_chars = max_stored_chars

    def supports(self, device: DeviceInfo) -> Support:
        return Support.yes()  # plain HTTP: nothing here touches the device

    def route_handlers(self, app_state: ServeState) -> list[Any]:
        from ninfer_plugins.frontend_responses import responses
        from ninfer_plugins.frontend_responses.store import ResponseStore

        store = ResponseStore(self.max_stored, self.max_stored_chars)
        return responses.route_handlers(app_state, store)

    def error_body(self, error: ApiError) -> dict[str, Any]:
        from ninfer_plugins.frontend_openai.errors import error_body

        return error_body(error)


@hookimpl
def register_frontends() -> list[ResponsesFrontend]:
    return [ResponsesFrontend()]

"""The OpenAI API frontend: chat completions, completions and models.

Registered through the `ninfer` entry point `frontend-openai`. The route modules (and
litestar with them) are imported only when an app asks for routes, so that loading the plugin
host for `ninfer generate` costs nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ninfer_core import hookimpl
from ninfer_core.support import Support

if TYPE_CHECKING:
    from ninfer_core.device import DeviceInfo
    from ninfer_core.serve.errors import ApiError
    from ninfer_core.serve.state import ServeState


class OpenAIFrontend:
    name = "openai"
    description = "OpenAI API: /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/models"
    #: Every /v1 path not claimed by a more specific frontend answers errors in OpenAI's shape,
    #: and so do the same routes without `/v1` (clients configured with a bare base URL).
    error_paths = ("/v1", "/chat/completions", "/completions", "/embeddings", "/models")

    def supports(self, device: DeviceInfo) -> Support:
        return Support.yes()

    def route_handlers(self, state: ServeState) -> list[Any]:
        from ninfer_plugins.frontend_openai import chat, completions, embeddings, models

        return [
            *chat.route_handlers(state),
            *completions.route_handlers(state),
            *embeddings.route_handlers(state),
            *models.route_handlers(state),
        ]

    def error_body(self, error: ApiError) -> dict[str, Any]:
        from ninfer_plugins.frontend_openai.errors import error_body

        return error_body(error)


@hookimpl
def register_frontends() -> list[OpenAIFrontend]:
    return [OpenAIFrontend()]

"""The Anthropic Messages API frontend: `/v1/messages` and `/v1/messages/count_tokens`.

Registered through the `ninfer` entry point group like any plugin. Importing this
module is cheap: litestar and the handlers load when `route_handlers` is called, so
commands that never serve (`ninfer probe`, `ninfer plugins`) do not pay for them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ninfer_core import hookimpl
from ninfer_core.support import Support

if TYPE_CHECKING:
    from ninfer_core.device import DeviceInfo
    from ninfer_core.serve.errors import ApiError
    from ninfer_core.serve.state import ServeState


class AnthropicFrontend:
    name = "anthropic"
    description = (
        "Anthropic Messages API: /v1/messages (streaming, tools, thinking) "
        "and /v1/messages/count_tokens"
    )
    #: The server core answers every error under these paths with `error_body`.
    error_paths = ("/v1/messages",)

    def __init__(self, ping_interval_s: float = 5.0) -> None:
        #: Seconds of silence (queue wait, a long prefill) before a stream sends a `ping`.
        self.ping_interval_s = ping_interval_s

    def supports(self, device: DeviceInfo) -> Support:
        return Support.yes()  # plain HTTP: nothing here touches the device

    def route_handlers(self, app_state: ServeState) -> list[Any]:
        from ninfer_plugins.frontend_anthropic.router import build_router

        return [build_router(app_state, ping_interval_s=self.ping_interval_s)]

    def error_body(self, error: ApiError) -> dict[str, Any]:
        from ninfer_plugins.frontend_anthropic.errors import error_body

        return error_body(error.status, error.message, error.kind)


@hookimpl
def register_frontends() -> list[AnthropicFrontend]:
    return [AnthropicFrontend()]

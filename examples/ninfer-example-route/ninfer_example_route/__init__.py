"""`example-tokenize`: an API frontend that adds llama.cpp's `/tokenize` and `/detokenize`.

A frontend is any plugin that hands `ninfer-serve` litestar route handlers; it need not be a
whole API dialect. These two routes show what a frontend receives: the `ServeState` of the
served model (`state.tokenizer`, `state.encode_prompt`, `state.engine`, ...), so a route uses
the model's own tokenizer and context limit without importing any built-in plugin.

    POST /tokenize    {"content": "text", "add_special": false} -> {"tokens": [ids]}
    POST /detokenize  {"tokens": [ids]}                          -> {"content": "text"}

The bodies are those of llama.cpp's server, so its clients work unchanged. The routes live in
`routes.py`, imported only when a server asks for them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ninfer_core import hookimpl
from ninfer_core.support import Support

if TYPE_CHECKING:
    from ninfer_core.device import DeviceInfo
    from ninfer_core.serve.state import ServeState


class TokenizeFrontend:
    name = "example-tokenize"
    description = "example plugin: llama.cpp-style POST /tokenize and /detokenize"
    # Optional `Frontend` members at their defaults: errors on these paths keep the core's
    # shape (`docs/serving.md`); a whole API dialect would claim a prefix and render its own.
    error_paths: tuple[str, ...] = ()
    error_body = None

    def supports(self, device: DeviceInfo) -> Support:
        return Support.yes()  # no kernels: it runs wherever the server does

    def route_handlers(self, app_state: ServeState) -> list[Any]:
        from ninfer_example_route import routes

        return routes.route_handlers(app_state)

    def __repr__(self) -> str:
        return "TokenizeFrontend()"


@hookimpl
def register_frontends() -> list[TokenizeFrontend]:
    return [TokenizeFrontend()]

"""`GET /v1/models` and `GET /v1/models/{id}`: the one model this server serves."""

from __future__ import annotations

from litestar import get
from litestar.params import FromPath

from ninfer_core.serve.errors import ApiError
from ninfer_core.serve.state import ServeState
from ninfer_plugins.frontend_openai import wire


def route_handlers(state: ServeState) -> list:
    def model() -> wire.Model:
        return wire.Model(state.options.model_id, state.created, max_model_len=state.max_context)

    @get(["/v1/models", "/models"], sync_to_thread=False, summary="List the models")
    def list_models() -> wire.ModelList:
        return wire.ModelList([model()])

    # `path`: model ids often hold a slash ("Qwen/Qwen3-8B").
    @get(
        ["/v1/models/{model_id:path}", "/models/{model_id:path}"],
        sync_to_thread=False,
        summary="Retrieve a model",
    )
    def retrieve_model(model_id: FromPath[str]) -> wire.Model:
        model_id = model_id.lstrip("/")
        if not state.options.serves(model_id):
            raise ApiError(
                404, "not_found", f"the model {model_id!r} does not exist", param="model"
            )
        return model()

    return [list_models, retrieve_model]

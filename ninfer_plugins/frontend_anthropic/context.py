"""What the frontend's handlers share: the served model and the frontend's settings."""

from __future__ import annotations

from dataclasses import dataclass

from ninfer_core.serve.errors import ApiError
from ninfer_core.serve.state import ServeState


@dataclass(frozen=True)
class Context:
    """Injected into every handler as `anthropic` (a Router-level dependency)."""

    state: ServeState
    #: Seconds of silence after which a stream sends a `ping` event.
    ping_interval_s: float = 5.0

    def check_model(self, model: str) -> None:
        """Only the id the server was started with (or one of `--model-aliases`) is
        served; any other is a 404."""
        served = self.state.options.model_id
        if not self.state.options.serves(model):
            raise ApiError(
                404, "not_found", f"model: {model!r} is not served here; this server serves "
                f"{served!r}", param="model",
            )  # fmt: skip

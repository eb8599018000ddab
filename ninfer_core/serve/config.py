"""`ServeConfig`: the HTTP server's own settings; `ninfer-serve`'s options are generated from it.

The engine's settings (`EngineConfig`) and the runtime's (`RuntimeConfig`) sit beside it;
this class holds only what is about serving: where to listen, who may call, how big a
request may be, and the defaults a request falls back on.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from ninfer_core.config import opt

DEFAULT_PORT = 18020
#: Read when `--api-key` is not given, so the key need not appear in the process list.
API_KEY_ENV = "NINFER_API_KEY"


@dataclass
class ConnectionLimits:
    """What the HTTP server allows a connection: the part of `ServeConfig` uvicorn gets
    (tests and `ServerThread` build one with small values)."""

    header_timeout_s: float = 10.0
    keep_alive_s: float = 5.0
    max_connections: int | None = 512
    graceful_shutdown_s: float = 30.0


@dataclass
class ServeConfig:
    """The HTTP server: address, authentication, request limits and defaults."""

    host: str = opt(
        "127.0.0.1", "address(es) to listen on, comma-separated (0.0.0.0: every IPv4 interface)"
    )
    port: int = opt(DEFAULT_PORT, "TCP port to listen on")
    allowed_hosts: str | None = opt(
        None,
        "Host names requests may be addressed to, comma-separated (*: any); default: "
        "loopback names when listening on loopback only, else any (serve/hosts.py)",
    )
    model_id: str | None = opt(None, "the model name clients send; default: the folder's name")
    model_aliases: str | None = opt(
        None,
        "comma-separated other names a request may send as model (a client's fixed "
        "placeholder such as gpt-3.5-turbo); *: any name. Answers still name --model-id",
    )
    api_key: str | None = opt(
        None,
        f"require this key (Bearer or x-api-key), or any of several comma-separated ones (a "
        f"tenant each); default: ${API_KEY_ENV}, unset: no auth",
    )
    max_request_mib: float = opt(16.0, "largest request body in MiB; larger ones get 413")
    cors: str | None = opt(None, "comma-separated origins browsers may call from; *: any")
    default_max_tokens: int = opt(
        1024, "new-token budget of a request that gives none (its KV pages are reserved)"
    )
    temperature: float | None = opt(None, "default sampling temperature; 0 is greedy")
    top_p: float | None = opt(None, "default nucleus sampling threshold; 1 is off")
    top_k: int | None = opt(None, "default top-k; 0 is off")
    min_p: float | None = opt(None, "default min-p; 0 is off")
    repetition_penalty: float | None = opt(None, "default repetition penalty; 1 is off")
    pooling: Literal["last", "mean"] = opt(
        "last",
        "how /v1/embeddings pools the decoder's final hidden states: last (the last token's, "
        "as vLLM and Qwen3-Embedding do) or mean (over the input's tokens)",
    )
    max_embedding_tokens: int = opt(
        300_000,
        "tokens one /v1/embeddings call may send, all inputs together (OpenAI's limit); more: 400",
    )
    graceful_shutdown_s: float = opt(
        30.0, "on SIGINT/SIGTERM, seconds requests may finish before each ends with a 503 error"
    )
    header_timeout_s: float = opt(
        10.0, "seconds to send a request's headers (from connecting or a keep-alive wait); 0: none"
    )
    body_timeout_s: float = opt(
        60.0, "seconds for a request's whole body to arrive after its headers, else 408; 0: none"
    )
    keep_alive_s: float = opt(5.0, "seconds an idle connection stays open between requests")
    max_connections: int = opt(
        512, "open connections at most; more get a 503 and are closed at once; 0: no limit"
    )

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.max_request_mib <= 0:
            raise ValueError(f"max_request_mib must be positive, got {self.max_request_mib}")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if self.pooling not in ("last", "mean"):
            raise ValueError(f"pooling must be last or mean, got {self.pooling!r}")
        if self.max_embedding_tokens <= 0:
            raise ValueError(
                f"max_embedding_tokens must be positive, got {self.max_embedding_tokens}"
            )
        if self.graceful_shutdown_s < 0:
            raise ValueError(f"graceful_shutdown_s must be >= 0, got {self.graceful_shutdown_s}")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s", "max_connections"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.api_key is None and API_KEY_ENV in os.environ:
            # Set but empty is refused like `--api-key ''`: a key that went missing from a
            # deployment's environment must not quietly open the server to everyone.
            if not os.environ[API_KEY_ENV].strip():
                raise ValueError(
                    f"${API_KEY_ENV} is set but empty; unset it to serve without a key"
                )
            self.api_key = os.environ[API_KEY_ENV]
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key is empty")
        if self.api_key is not None:
            server_keys(self.api_key)  # a ValueError for an empty entry ("a,,b")

    @property
    def max_request_bytes(self) -> int:
        return int(self.max_request_mib * 1024 * 1024)

    @property
    def limits(self) -> ConnectionLimits:
        return ConnectionLimits(
            header_timeout_s=self.header_timeout_s,
            keep_alive_s=self.keep_alive_s,
            max_connections=self.max_connections or None,
            graceful_shutdown_s=self.graceful_shutdown_s,
        )

    @property
    def cors_origins(self) -> list[str]:
        return [o.strip() for o in (self.cors or "").split(",") if o.strip()]


def server_keys(api_key: str) -> list[bytes]:
    """The keys `--api-key` names: one, or several separated by commas (one per client:
    each key is a tenant of its own, `serve/cache_salt.py`)."""
    keys = [k.strip().encode() for k in api_key.split(",")]
    if not all(keys):
        raise ValueError("api_key: an empty key in the list")
    return keys

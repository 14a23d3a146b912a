"""Putting a server together (engine, engine thread, metrics, application) and running it under uvicorn, with a
graceful SIGTERM: stop accepting, let what runs finish within the grace period, cancel the rest, exit 0."""

from __future__ import annotations

import os
import signal
import socket
import sys

import torch

from ..generation.engine.speculative_engine import SpeculativeEngine
from .app import ServedModel, ServerState, build_app
from .metrics import ServerMetrics
from .worker import EngineWorker


def _random_generator(device) -> torch.Generator:
    """A generator of the server's own, seeded from the OS (sampled requests never draw from torch's global one)."""
    return torch.Generator(device=device).manual_seed(int.from_bytes(os.urandom(8), "little"))


def context_length(target) -> int | None:
    config = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    return getattr(config, "max_position_embeddings", None)


def build_state(target, tokenizer, drafter=None, *, model_name: str, max_running: int = 32, max_queued: int = 256,
                api_key: str | None = None, engine_options: dict | None = None) -> ServerState:
    """The engine (`SpeculativeEngine(target, drafter, **engine_options)`; `drafter=None`: plain continuous
    batching), its worker (not started: the application's lifespan starts it), metrics and model description."""
    device = target.device
    engine = SpeculativeEngine(target, drafter, generator=_random_generator(device), **(engine_options or {}))
    plain = None
    if drafter is not None:  # seeded sampled requests, if the drafter engine takes no generators of their own
        def plain():
            return SpeculativeEngine(target, None, generator=_random_generator(device))
    positions = getattr(engine, "draft_length", 0) if drafter is not None else 0
    metrics = ServerMetrics(model_name, positions)
    worker = EngineWorker(engine, max_running=max_running, max_queued=max_queued, plain_engine=plain, metrics=metrics)
    metrics.watch(worker)
    model = ServedModel(tokenizer, model_name, context_length(target), target.get_input_embeddings().weight.shape[0])
    return ServerState(worker, model, metrics, api_key=api_key)


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound now (a port in use fails before any model loads); port 0 picks a free one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def uvicorn_server(state: ServerState, shutdown_timeout: float = 30.0, log_level: str = "info"):
    """A `uvicorn.Server` for `build_app(state)` that marks the server draining on SIGTERM / SIGINT (new requests
    get 503, `/health` too) and waits up to `shutdown_timeout` seconds for the requests in flight."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            state.draining = True
            state.worker.stop_accepting()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(build_app(state), log_level=log_level, timeout_graceful_shutdown=shutdown_timeout,
                            lifespan="on", access_log=False)
    return Server(config)


def run(state: ServerState, sock: socket.socket, shutdown_timeout: float = 30.0, log_level: str = "info") -> None:
    """Serve on `sock` until SIGTERM or Ctrl-C (main thread); returns once everything has stopped."""
    server = uvicorn_server(state, shutdown_timeout, log_level)
    host, port = sock.getsockname()[:2]
    print(f"hf-dspark serve: {state.model.name} on http://{host}:{port}/v1 (Ctrl-C or SIGTERM to stop)",
          file=sys.stderr, flush=True)
    # uvicorn raises the signal it stopped for again once it has shut down, so that the default handler ends the
    # process; with these handlers in place that raise is absorbed and the command exits 0 after a graceful stop.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if state.worker.failure is not None:
        raise RuntimeError(f"the engine thread failed: {state.worker.failure}") from state.worker.failure

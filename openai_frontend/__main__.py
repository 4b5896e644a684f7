"""Run the OpenAI-compatible API in front of a running tritonserver.

    python -m openai_frontend --triton-url 127.0.0.1:8001 [--port 9000] [--tokenizer DIR]

It reads the tokenizer folder and token limits from the ensemble's model parameters over gRPC
(so it needs only Triton's address), loads the tokenizer for chat templates, and serves on
127.0.0.1 unless `--host` says otherwise. Ctrl-C or SIGTERM stops it; requests in flight are
cancelled in Triton. `--workers N` runs N such processes on one port (openai_frontend/workers.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import socket
import sys
import time
from email.utils import formatdate
from pathlib import Path

from ensemble.limits import PromptLimits
from openai_frontend.app import ServedModel, create_app
from openai_frontend.body_limit import DEFAULT_MAX_BODY_BYTES
from openai_frontend.chat import ChatRenderer
from openai_frontend.errors import APIError
from openai_frontend.sampling import Limits
from openai_frontend.tool_parsers import FORMATS
from openai_frontend.triton_client import ModelInfo, TritonClient
from openai_frontend.workers import auto_workers

logger = logging.getLogger("openai_frontend")
FALLBACK_CONTEXT_LENGTH = 2048
TOOL_PARSERS = [name for name in FORMATS if name != "json_array"]  # json_array: tool_choice required
GRACEFUL_SHUTDOWN_S = 5  # after the drain: for the streams ended with a 503 to close


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--triton-url", default="127.0.0.1:8001", help="Triton's gRPC address")
    parser.add_argument("--model", default="ensemble", help="the Triton model to call")
    parser.add_argument("--served-model-name", help="the model id clients send (default: --model)")
    parser.add_argument("--tokenizer", help="tokenizer folder for chat templates (default: the "
                        "ensemble's tokenizer_dir parameter, read from Triton)")
    parser.add_argument("--tool-call-parser", default="auto", choices=["auto", "none", *TOOL_PARSERS],
                        help="the model's tool-call format, read back into tool_calls when tool_choice is "
                             "auto (default auto: detected from the chat template's markers)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all)")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--triton-timeout-s", type=float, default=60.0,
                        help="how long to wait for Triton at start-up to read the model's parameters")
    parser.add_argument("--drain-timeout-s", type=float, default=30.0,
                        help="on SIGTERM/SIGINT, seconds the answers in flight get to finish (new "
                             "requests and readiness get 503 at once); then they end with a 503 "
                             "error event. A second signal ends them at once (default 30)")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="larger request bodies get a 413 before they are read (default 16 MiB); "
                             "prompts are bounded again by the model's max_input_bytes")
    parser.add_argument("--workers", default="auto",
                        help="frontend processes sharing the port (default auto: 1 below 8 cores, "
                             "else cores/4, at most 4); see openai_frontend/workers.py")
    parser.add_argument("--listen-fd", type=int, help=argparse.SUPPRESS)  # a worker's inherited socket
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = parser.parse_args(argv)
    if args.workers == "auto":
        args.workers = auto_workers()
    elif not args.workers.isdigit() or int(args.workers) < 1:
        parser.error(f"--workers must be 'auto' or a positive integer, got {args.workers!r}")
    args.workers = int(args.workers)
    if args.max_body_bytes < 1:
        parser.error(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    return args


async def _read_model_info(client: TritonClient, timeout_s: float) -> ModelInfo:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await client.check_ready()
            return await client.model_info()
        except APIError as exc:
            if time.monotonic() > deadline:
                raise SystemExit(f"error: cannot read the model's parameters from Triton at "
                                 f"{client.url}: {exc.message}") from None
            await asyncio.sleep(0.5)


def context_length(info: ModelInfo, tokenizer) -> int:
    """The engine's rule: max_seq_len if set, capped by the model's max_position_embeddings."""
    limits = [info.max_seq_len] if info.max_seq_len else []
    if info.engine_dir and (Path(info.engine_dir) / "config.json").is_file():
        config = json.loads((Path(info.engine_dir) / "config.json").read_text())
        config = config.get("text_config", config)
        if config.get("max_position_embeddings"):
            limits.append(int(config["max_position_embeddings"]))
    if not limits and 0 < getattr(tokenizer, "model_max_length", 0) < 10**7:
        limits.append(int(tokenizer.model_max_length))
    if not limits:
        logger.warning("the model's context length is unknown; assuming %d tokens", FALLBACK_CONTEXT_LENGTH)
    return min(limits) if limits else FALLBACK_CONTEXT_LENGTH


def lora_adapters(prefetch_dir: str | None) -> dict[str, int]:
    """The LoRA adapters served by name: `lora_modules.json` ({name: task id}) in the engine's
    `lora_prefetch_dir`, as tools/build_repository.py --lora_modules writes it."""
    path = Path(prefetch_dir) / "lora_modules.json" if prefetch_dir else None
    if path is None or not path.is_file():
        return {}
    names = json.loads(path.read_text())
    logger.info("LoRA adapters: %s", ", ".join(f"{n} (task {t})" for n, t in names.items()))
    return {str(name): int(task_id) for name, task_id in names.items()}


async def build(args) -> tuple[TritonClient, ServedModel]:
    from preprocessing.loader import load_tokenizer

    client = TritonClient(args.triton_url, args.model)
    if args.tokenizer:  # Triton may be down: that must not stop the frontend from starting
        try:
            info = await client.model_info()
        except APIError:
            info = ModelInfo(args.tokenizer, None, None, args.tokenizer)
    else:
        info = await _read_model_info(client, args.triton_timeout_s)
    tokenizer_dir = args.tokenizer or info.tokenizer_dir
    if not tokenizer_dir:
        raise SystemExit(f"error: model {args.model} has no tokenizer_dir parameter; pass --tokenizer")
    tokenizer = load_tokenizer(tokenizer_dir)
    name = args.served_model_name or args.model
    context = context_length(info, tokenizer)
    prompt = PromptLimits.derive(info.max_input_len, context, info.max_input_bytes)
    renderer = ChatRenderer(tokenizer, name, args.tool_call_parser)
    logger.info("tool-call format: %s", renderer.tool_format.name if renderer.tool_format else
                "none (tool_choice auto is refused; required and named functions are served)")
    served = ServedModel(name=name, renderer=renderer,
                         limits=Limits(context, info.max_output_len, prompt, vocab_size=len(tokenizer)),
                         created=int(time.time()), adapters=lora_adapters(info.lora_prefetch_dir))
    return client, served


def _server(config, client: TritonClient, drain_s: float):
    import uvicorn
    from uvicorn.server import ServerState

    class State(ServerState):
        """uvicorn's shared state, whose `default_headers` (the Date header) are made when a
        request reads them, once a second at most, not refreshed by a timer."""

        def __init__(self):
            self._date = (-1, [])  # (the second, the headers for it)
            super().__init__()

        @property
        def default_headers(self) -> list[tuple[bytes, bytes]]:
            second = int(time.time())
            if second != self._date[0]:
                date = [(b"date", formatdate(second, usegmt=True).encode())] if config.date_header else []
                self._date = (second, date + config.encoded_headers)
            return self._date[1]

        @default_headers.setter
        def default_headers(self, value) -> None:  # uvicorn's start value; its tick is not run
            pass

    class Server(uvicorn.Server):
        """Drains when asked to stop: the listening socket closes and readiness turns 503 at
        once, the answers in flight get `drain_s` to finish, then end with a 503 error event
        (their Triton requests cancelled), so every stream closes cleanly.

        Idle, it does nothing: uvicorn's main loop wakes ten times a second to look for a stop
        and refresh the Date header (most of an idle worker's CPU, with the readiness polling
        that is gone too); here a stop signal wakes it, and `State` makes the header."""

        def __init__(self, config):
            super().__init__(config)
            self.server_state = State()
            self._stop_asked = asyncio.Event()
            self._loop = None

        async def main_loop(self):  # uvicorn's also enforces limit_max_requests: not set here
            self._loop = asyncio.get_running_loop()
            while not self.should_exit:
                await self._stop_asked.wait()
                self._stop_asked.clear()

        def handle_exit(self, sig, frame):
            super().handle_exit(sig, frame)
            if self._loop is not None:  # a signal handler: the loop may be anywhere, hence threadsafe
                self._loop.call_soon_threadsafe(self._stop_asked.set)

        async def shutdown(self, sockets=None):
            client.start_draining()
            timer = asyncio.get_running_loop().call_later(drain_s, client.stop_streams)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    return Server(config)


async def serve(args) -> None:
    import uvicorn

    client, served = await build(args)
    app = create_app(client, served, args.max_body_bytes)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=args.log_level == "debug", http="httptools", lifespan="off",
                            timeout_graceful_shutdown=args.drain_timeout_s + GRACEFUL_SHUTDOWN_S)
    server = _server(config, client, args.drain_timeout_s)
    logger.info("serving model %r (Triton model %r at %s)", served.name, args.model, args.triton_url)
    sockets = None if args.listen_fd is None else [socket.socket(fileno=args.listen_fd)]
    try:
        await server.serve(sockets)
    finally:
        await client.close()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(name)s: %(message)s")
    if args.workers > 1 and args.listen_fd is None:
        from openai_frontend import workers

        return workers.run(argv, args.host, args.port, args.workers, args.drain_timeout_s)
    try:
        import uvloop
    except ImportError:  # optional: only faster
        uvloop = None
    try:
        (uvloop.run if uvloop else asyncio.run)(serve(args))
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled: already stopped cleanly
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())

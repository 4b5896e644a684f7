"""A stand-in for tritonserver that answers at once: the OpenAI frontend's own cost, measured alone.

    python bench/triton_stub.py --port 8001 [--first-token-ms 0] [--token-ms 0]

It speaks Triton's gRPC inference protocol for one decoupled model, `ensemble`, well enough for
the frontend and the benchmark's direct client: server and model readiness, and
`ModelStreamInfer`, which streams `max_tokens` responses ("tok" each, with running
`num_output_tokens` and a fixed `num_input_tokens`) after optional delays. `ModelConfig` is
refused, so start the frontend with `--tokenizer`. No engine runs, so the time and CPU that a request costs
through the frontend, minus the same request sent straight to the stub, is the frontend's own.
Benchmark tool only: it checks no input.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import struct

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

TOKEN_TEXT = b"tok"
NUM_INPUT_TOKENS = 16  # the same whatever the prompt, so both paths of the benchmark agree


def _int(request, name: str, default: int) -> int:
    for spec, raw in zip(request.inputs, request.raw_input_contents):
        if spec.name == name:
            return int.from_bytes(raw[:4], "little", signed=True)
    return default


def _response(request, text: bytes, num_input_tokens: int, num_output_tokens: int):
    response = service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)
    for name, datatype in (("text_output", "BYTES"), ("num_input_tokens", "INT32"),
                           ("num_output_tokens", "INT32")):
        response.outputs.add(name=name, datatype=datatype, shape=[1, 1])
    response.raw_output_contents.extend([
        struct.pack("<I", len(text)) + text, struct.pack("<i", num_input_tokens),
        struct.pack("<i", num_output_tokens)])
    return service_pb2.ModelStreamInferResponse(infer_response=response)


class Stub(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, first_token_s: float, token_s: float) -> None:
        self.first_token_s = first_token_s
        self.token_s = token_s

    async def ServerLive(self, request, context):
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return service_pb2.ServerReadyResponse(ready=True)

    async def ModelReady(self, request, context):
        return service_pb2.ModelReadyResponse(ready=True)

    async def ModelStreamInfer(self, request_iterator, context):
        async for request in request_iterator:
            max_tokens = _int(request, "max_tokens", 16)
            for i in range(max_tokens):
                delay = self.first_token_s if i == 0 else self.token_s
                if delay:
                    await asyncio.sleep(delay)
                yield _response(request, TOKEN_TEXT, NUM_INPUT_TOKENS, i + 1)


async def serve(port: int, first_token_s: float, token_s: float) -> None:
    server = grpc.aio.server()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Stub(first_token_s, token_s), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"triton stub on 127.0.0.1:{port}", flush=True)
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    await stop.wait()
    await server.stop(grace=None)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--first-token-ms", type=float, default=0.0, help="delay before the first response")
    parser.add_argument("--token-ms", type=float, default=0.0, help="delay before each later response")
    args = parser.parse_args(argv)
    asyncio.run(serve(args.port, args.first_token_ms / 1000, args.token_ms / 1000))


if __name__ == "__main__":
    main()

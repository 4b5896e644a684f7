"""Send a prompt to the ensemble and print the answer as it streams.

    python tools/client.py "What is the capital of France?"            # gRPC stream, chat template
    python tools/client.py --http "Tell me a story" --max-tokens 64      # HTTP /generate_stream
    python tools/client.py --no-stream --raw "Once upon a time"          # one response, no template
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import urllib.request

import numpy as np

from ensemble.io_contract import ENSEMBLE


def build_inputs(args) -> dict:
    values = {"text_input": args.prompt, "max_tokens": args.max_tokens,
              "apply_chat_template": not args.raw, "exclude_input_in_output": True}
    for name in ("temperature", "top_k", "top_p", "seed", "repetition_penalty",
                 "presence_penalty", "frequency_penalty", "min_tokens"):
        value = getattr(args, name)
        if value is not None:
            values[name] = value
    if args.stop:
        values["stop_words"] = args.stop
    return values


def grpc_generate(args, values: dict, stream: bool) -> None:
    import tritonclient.grpc as grpcclient

    inputs = []
    values = dict(values, stream=stream)
    for name, value in values.items():
        spec = ENSEMBLE.input(name)
        if spec.dtype == "TYPE_STRING":
            items = value if isinstance(value, list) else [value]
            array = np.array([[v.encode("utf-8") for v in items]], dtype=np.object_)
        else:
            array = np.array([[value]], dtype=spec.numpy_dtype)
        tensor = grpcclient.InferInput(name, list(array.shape), spec.client_dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(args.url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer("ensemble", inputs, enable_empty_final_response=True)
    try:
        while True:
            result, error = results.get(timeout=args.timeout)
            if error is not None:
                raise SystemExit(f"\nerror: {error}")
            output = result.as_numpy("text_output")
            if output is not None and output.size:
                sys.stdout.write(output.reshape(-1)[0].decode("utf-8"))
                sys.stdout.flush()
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
    finally:
        client.stop_stream()
    print()


def http_generate(args, values: dict, stream: bool) -> None:
    host = args.http_url
    path = "generate_stream" if stream else "generate"
    body = json.dumps(dict(values, stream=stream)).encode()
    request = urllib.request.Request(f"http://{host}/v2/models/ensemble/{path}", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=args.timeout) as reply:
        for line in reply:
            line = line.decode("utf-8").strip()
            if not line:
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                raise SystemExit(f"\nerror: {event['error']}")
            sys.stdout.write(event.get("text_output", ""))
            sys.stdout.flush()
    print()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt")
    parser.add_argument("--url", default="localhost:8001", help="gRPC address")
    parser.add_argument("--http", action="store_true", help="use HTTP generate(_stream) instead of gRPC")
    parser.add_argument("--http-url", default="localhost:8000")
    parser.add_argument("--no-stream", action="store_true", help="one response with the whole answer")
    parser.add_argument("--raw", action="store_true", help="send the prompt as is (no chat template)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--top-k", dest="top_k", type=int)
    parser.add_argument("--top-p", dest="top_p", type=float)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--repetition-penalty", dest="repetition_penalty", type=float)
    parser.add_argument("--presence-penalty", dest="presence_penalty", type=float)
    parser.add_argument("--frequency-penalty", dest="frequency_penalty", type=float)
    parser.add_argument("--min-tokens", dest="min_tokens", type=int)
    parser.add_argument("--stop", action="append", help="a stop word (repeatable)")
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args(argv)
    values = build_inputs(args)
    (http_generate if args.http else grpc_generate)(args, values, stream=not args.no_stream)


if __name__ == "__main__":
    main()

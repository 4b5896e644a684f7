"""Compare NVIDIA's `inflight_batcher_llm` configs with ours, tensor by tensor.

    python checks/nvidia_configs.py --nvidia-repo PATH

PATH is a tensorrtllm_backend checkout (`all_models/inflight_batcher_llm/`) or a TensorRT-LLM
one (`triton_backend/all_models/inflight_batcher_llm/`). For each model it prints the tensors
whose name, dtype, dims or optionality differ from `ensemble/io_contract.py`, NVIDIA's tensors we
lack (exit 1 if any), ours that NVIDIA lacks (our extensions), and NVIDIA's parameter keys our
template lacks. Reshape and ragged-batching flags are how a model sees its inputs, not what a
client sends, so they are not compared.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from ensemble.io_contract import MODELS

TEMPLATE_DIR = Path(__file__).resolve().parents[1] / "model_repository"
# What NVIDIA's docs fill the dtype placeholders with.
DTYPE_VALUES = {"logits_datatype": "TYPE_FP32", "encoder_input_features_data_type": "TYPE_FP16",
                "prompt_embedding_table_data_type": "TYPE_FP16"}


def parse(text: str):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    def fill(match):
        name = match.group(1)
        return DTYPE_VALUES.get(name, "1" if name.endswith(("count", "size", "microseconds")) else "true"
                                if name == "decoupled_mode" else f'"{name}"')

    text = re.sub(r'"\$\{(\w+)\}"', lambda m: f'"{m.group(1)}"', text)
    text = re.sub(r"\$\{(\w+)\}", fill, text)
    return text_format.Parse(text, model_config_pb2.ModelConfig(), allow_unknown_field=True)


def tensors(config) -> dict[str, tuple]:
    from tritonclient.grpc import model_config_pb2

    out = {}
    for kind, items in (("input", config.input), ("output", config.output)):
        for t in items:
            out[(kind, t.name)] = (model_config_pb2.DataType.Name(t.data_type), tuple(t.dims),
                                   kind == "input" and t.optional)
    return out


def ours(model: str) -> dict[str, tuple]:
    io = MODELS[model]
    out = {}
    for kind, specs in (("input", io.inputs), ("output", io.outputs)):
        for s in specs:
            out[(kind, s.name)] = (DTYPE_VALUES.get(s.dtype_var, s.dtype), s.dims, kind == "input" and s.optional)
    return out


def compare(model: str, nvidia_dir: Path) -> list[str]:
    """Lines describing the differences; lines starting with "MISSING" are failures."""
    path = nvidia_dir / model / "config.pbtxt"
    if not path.is_file():
        return [f"{model}: NVIDIA has no {path}"]
    theirs_config = parse(path.read_text())
    theirs, mine = tensors(theirs_config), ours(model)
    lines = []
    for key in sorted(theirs.keys() - mine.keys()):
        lines.append(f"MISSING {model} {key[0]} {key[1]} {theirs[key]}")
    for key in sorted(mine.keys() - theirs.keys()):
        lines.append(f"ours    {model} {key[0]} {key[1]} {mine[key]}")
    for key in sorted(theirs.keys() & mine.keys()):
        if theirs[key] != mine[key]:
            lines.append(f"MISSING {model} {key[0]} {key[1]}: NVIDIA {theirs[key]}, ours {mine[key]}")
    our_keys = set(re.findall(r'key: "(\w+)"', (TEMPLATE_DIR / model / "config.pbtxt").read_text()))
    for key in sorted(set(theirs_config.parameters) - our_keys):
        lines.append(f"param   {model} {key}: NVIDIA's parameter, not in our template")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nvidia-repo", required=True, type=Path)
    args = parser.parse_args(argv)
    root = next((p for p in (args.nvidia_repo / "all_models/inflight_batcher_llm",
                             args.nvidia_repo / "triton_backend/all_models/inflight_batcher_llm") if p.is_dir()),
                None)
    if root is None:
        print(f"error: no all_models/inflight_batcher_llm under {args.nvidia_repo}", file=sys.stderr)
        return 2
    lines = [line for model in MODELS for line in compare(model, root)]
    print("\n".join(lines) or "no differences")
    return 1 if any(line.startswith("MISSING") for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Convert a Hugging Face PEFT LoRA adapter folder into TensorRT-LLM's request layout: the
equivalent of NVIDIA's `examples/hf_lora_convert.py`, with the same flags.

    python3 tools/lora_convert.py -i PEFT_DIR -o OUT_DIR [--storage-type float16] [--model MODEL_DIR]

Writes `model.lora_weights.npy` [1, N, W] and `model.lora_config.npy` [1, N, 3] int32 into
OUT_DIR: the files a `lora_prefetch_dir/<task_id>/` folder holds and NVIDIA's client reads with
`--lora-path`. Each row is one (layer, module), A then B (scale folded in) row-major, zero-padded
(see inflight/lora/nvidia.py).

The adapter is read by the server's own reader, so anything it would refuse (DoRA, biases,
per-module ranks, extra trained modules, embeddings / LM head) is refused here, before upload.
`--model` (the base model's folder) is optional: with it, every module's shape and layer is
checked against the model; without it, in/out sizes are taken from the tensors themselves.

Storage types: float16 (the default, what clients send) and float32. bfloat16 is refused:
numpy has no bfloat16, and NVIDIA's script writes it as an untyped 2-byte void dtype that no
reader can tell from other data; use float16, or float32 when a value exceeds float16's range
(the tool says so), and let the server cast to its own dtype.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from inflight.lora.nvidia import to_nvidia
from inflight.lora.peft import read_peft
from inflight.model.config import ModelConfig

STORAGE_TYPES = {"float32": np.float32, "float16": np.float16}
WEIGHTS_FILE, CONFIG_FILE = "model.lora_weights.npy", "model.lora_config.npy"


def convert(in_dir: Path, out_dir: Path, storage_type: str = "float16",
            model_dir: Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Reads the PEFT folder, writes the two .npy files into `out_dir` (created if missing) and
    returns them ([1, N, W] weights, [1, N, 3] int32 config). Raises InputError for an adapter
    the server would refuse."""
    config = ModelConfig.from_dir(model_dir) if model_dir is not None else None
    # Read in float32 so the scale is folded once and the only rounding is to the storage type.
    adapter = read_peft(in_dir, config)
    weights, rows = to_nvidia(adapter, STORAGE_TYPES[storage_type])
    weights, rows = weights[np.newaxis], rows[np.newaxis]  # the batch-of-one layout NVIDIA writes
    out_dir.mkdir(parents=True, exist_ok=True)
    np.save(out_dir / WEIGHTS_FILE, weights)
    np.save(out_dir / CONFIG_FILE, rows)
    return weights, rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-i", "--in-file", required=True, type=Path, help="PEFT adapter folder")
    parser.add_argument("-o", "--out-dir", required=True, type=Path,
                        help="folder for model.lora_weights.npy and model.lora_config.npy")
    parser.add_argument("--storage-type", default="float16", choices=(*STORAGE_TYPES, "bfloat16"),
                        help="dtype of model.lora_weights.npy (bfloat16 is refused: numpy has none)")
    parser.add_argument("--model", type=Path, default=None,
                        help="base model folder, to check the adapter against its shapes (optional)")
    parser.add_argument("--verbose", action="store_true", help="accepted for NVIDIA's flags; no effect")
    args = parser.parse_args(argv)
    if args.storage_type == "bfloat16":
        parser.error("--storage-type bfloat16 is not supported: numpy has no bfloat16 dtype, so the "
                     ".npy could not say what it holds; use float16 (the default) or float32")
    try:
        weights, rows = convert(args.in_file, args.out_dir, args.storage_type, args.model)
    except (OSError, ValueError) as exc:  # InputError is a ValueError
        print(f"lora_convert: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {rows.shape[1]} LoRA modules (max rank {int(rows[0, :, 2].max())}) of {args.in_file} to "
          f"{args.out_dir}: {WEIGHTS_FILE} {list(weights.shape)} {weights.dtype}, {CONFIG_FILE} "
          f"{list(rows.shape)} int32")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Builds a model from a Hugging Face checkpoint directory and allocates its paged KV cache.

The model is constructed on the `meta` device (no memory, no random init), then each tensor
from the `*.safetensors` files is cast and moved straight to its final device, so peak host
memory stays about one tensor above the model's size.

With tensor parallelism each rank reads only its shard of every tensor (safetensors'
`get_slice`: the file's bytes of the other ranks' rows or columns are never touched), as
`inflight.model.sharding.shard_for` decides from the tensor's name.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, MutableMapping

import torch
from safetensors import safe_open
from torch import nn

from inflight import kernels
from inflight.distributed.group import TensorParallel
from inflight.model.config import ModelConfig
from inflight.model.llama import LlamaForCausalLM
from inflight.model.quantization import (FP8, KV_SCALE_SUFFIXES, RESHAPED_SUFFIXES, SCALE_SUFFIXES,
                                         finalize_linears, fuse_input_quantization, quantize_linears,
                                         scheme_for)
from inflight.model.sharding import Shard, check_divisible, shard_for
from inflight.model.skinny import use_skinny_gemv
from inflight.platform import packs_projections, to_cpu_gemm_layout, uses_cpu_gemm_layout

# Checkpoint entries that are derived state, not weights (old Llama exports carry these).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


@dataclass(frozen=True)
class _Target:
    """Where a checkpoint tensor goes: rows [start, start + shape[0]) of model parameter `param`."""

    param: str
    start: int
    shape: torch.Size
    is_part: bool  # a block of a PackedLinear's rows, not the whole parameter


def checkpoint_layout(model: nn.Module) -> dict[str, _Target]:
    """Every checkpoint (HF) tensor name the model needs -> where it goes in the model.

    Unpacked parameters are their own HF names; a packed projection (`PackedLinear`, or an
    `Fp8Linear` with parts) named `...qkv_proj` stands for `...q_proj`, `...k_proj`,
    `...v_proj` (its `parts`), each filling a slice of its parameters (`part_slices`).
    """
    layout = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        if not getattr(module, "parts", None):
            layout[name] = _Target(name, 0, param.shape, False)
            continue
        prefix = module_name.rpartition(".")[0]
        for part, (part_attr, start, size) in module.part_slices(attr).items():
            layout[f"{prefix}.{part}.{part_attr}"] = _Target(name, start, torch.Size((size, *param.shape[1:])), True)
    return layout


def _set_tensor(model: nn.Module, target: _Target, tensor: torch.Tensor) -> None:
    module_path, _, attr = target.param.rpartition(".")
    module = model.get_submodule(module_path)
    if not target.is_part:
        setattr(module, attr, nn.Parameter(tensor, requires_grad=False))
        return
    param = getattr(module, attr)
    if param.is_meta:  # first part of a packed weight: allocate the whole of it
        param = nn.Parameter(torch.empty(param.shape, dtype=tensor.dtype, device=tensor.device),
                             requires_grad=False)
        setattr(module, attr, param)
    param.data[target.start:target.start + target.shape[0]].copy_(tensor)


def _load_dtype(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """The dtype a checkpoint tensor is kept in: FP8 weights and integer tensors (packed
    weights, zero points, shapes) as they are, quantization scales in fp32, everything else
    in the model's `dtype`."""
    if tensor.dtype == FP8 or not tensor.dtype.is_floating_point:
        return tensor.dtype
    return torch.float32 if name.endswith(SCALE_SUFFIXES) else dtype


def _owned(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype,
           from_file: bool = True) -> torch.Tensor:
    """`tensor` cast and moved, in memory of its own.

    safetensors hands out CPU tensors backed by the file's mmap; when the cast and the move
    are no-ops (a bf16 checkpoint loaded as bf16 on the CPU) the weights would stay file
    pages (evictable, re-read from disk, and not aligned for vector loads), so copy them.
    In-memory weights handed over by the caller are kept as they are.
    """
    out = tensor.to(device=device, dtype=dtype)
    if from_file and out.data_ptr() == tensor.data_ptr():
        out = out.clone(memory_format=torch.contiguous_format)
    return out.contiguous()


def _take(source, shape: tuple[int, ...], shard: Shard | None, rank: int) -> torch.Tensor:
    """`shard` of a tensor: `source` is the tensor or a safetensors slice (indexing it reads
    only those bytes)."""
    if shard is None:
        return source if isinstance(source, torch.Tensor) else source[:]
    if shard.zeros_off_leader:
        if rank == 0:
            return source if isinstance(source, torch.Tensor) else source[:]
        return torch.zeros(shape, dtype=_dtype_of(source))
    index = (slice(None),) * shard.dim + (slice(shard.start, shard.start + shard.length),)
    part = source[index]
    if isinstance(source, torch.Tensor):  # a view would keep the whole tensor's memory alive
        part = part.clone(memory_format=torch.contiguous_format)
    if shard.pad_to > shard.length:  # the last vocabulary shard: zero rows up to its size
        pad = list(part.shape)
        pad[shard.dim] = shard.pad_to - shard.length
        part = torch.cat([part, part.new_zeros(pad)], dim=shard.dim)
    return part


def _dtype_of(source) -> torch.dtype:
    if isinstance(source, torch.Tensor):
        return source.dtype
    return getattr(torch, {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}
                   .get(source.get_dtype(), "float32"))


def _checkpoint_tensors(model_dir: Path, weights: MutableMapping[str, torch.Tensor] | None,
                        tp: TensorParallel) -> Iterator[tuple[str, str, object]]:
    """(name, where, tensor getter) for every tensor of the checkpoint files, or of `weights`
    (popped one by one, so their memory is released as the model takes it over). The getter
    returns this rank's shard."""
    def getter(name, source_of):
        def get():
            source = source_of()
            shape = tuple(source.shape) if isinstance(source, torch.Tensor) else tuple(source.get_shape())
            return _take(source, shape, shard_for(name, shape, tp.rank, tp.size), tp.rank)
        return get

    if weights is not None:
        for name in list(weights):
            yield name, "weights", getter(name, lambda name=name: weights.pop(name))
        return
    for path in _checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if tp.size == 1:
                    yield name, path.name, lambda name=name, f=f: f.get_tensor(name)
                else:
                    yield name, path.name, getter(name, lambda name=name, f=f: f.get_slice(name))


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device | str,
               attention_backend: str = "torch",
               weights: MutableMapping[str, torch.Tensor] | None = None,
               tp: TensorParallel | None = None,
               quantization: str | None = None) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Loads a Llama/Mistral/Qwen2 checkpoint for inference.

    A quantized checkpoint (its format read from the folder, `inflight.model.quantization`)
    loads into `Fp8Linear` or `Int4Linear` projections; `quantization="fp8"` quantizes an
    unquantized one at load.

    The tensors come from the folder's safetensors files, or from `weights` (HF names, e.g. a
    random model built on the GPU for a benchmark; its entries are consumed) next to the
    folder's config.json.

    Whether q/k/v and gate/up are packed follows `platform.packs_projections(device)`; either
    way every checkpoint tensor is checked by its HF name and shape. Raises ValueError naming
    the tensors when the checkpoint lacks a model tensor, carries one the model does not have,
    or has a shape that does not match the config. With `tp` of several ranks, loads this
    rank's shards (shapes are checked per shard); ConfigError if the head counts do not divide.
    """
    model_dir = Path(model_dir)
    device = torch.device(device)
    config = ModelConfig.from_dir(model_dir)
    tp = tp or TensorParallel.single()
    check_divisible(config, tp.size)
    scheme = scheme_for(model_dir, quantization, tp.size)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, attention_backend, pack_projections=packs_projections(device),
                                 tp=tp)
        if scheme is not None:
            quantize_linears(model, scheme)
    expected = checkpoint_layout(model)

    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, where, get_tensor in _checkpoint_tensors(model_dir, weights, tp):
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if scheme is not None and scheme.kv_cache and name.endswith(KV_SCALE_SUFFIXES):
            _set_kv_scale(model, name, get_tensor())  # used where the KV cache is FP8
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # tied: the head is the embedding matrix
        if name not in expected:
            unexpected.append(name)
            continue
        tensor = get_tensor()
        if tensor.shape != expected[name].shape and not (name.endswith(RESHAPED_SUFFIXES)
                                                          and tensor.numel() == expected[name].shape.numel()):
            raise ValueError(f"tensor {name} has shape {tuple(tensor.shape)} in {where}, "
                             f"expected {tuple(expected[name].shape)} from config.json")
        tensor = tensor.reshape(expected[name].shape)  # a per-tensor scale: [] or [1]
        _set_tensor(model, expected[name], _owned(tensor, device, _load_dtype(name, tensor, dtype),
                                                  from_file=weights is None))
        loaded.add(name)
    if unexpected:
        raise ValueError(f"checkpoint {model_dir} has tensors the model does not use: "
                         f"{', '.join(sorted(unexpected)[:10])}"
                         + (" ..." if len(unexpected) > 10 else ""))
    if "lm_head.weight" not in loaded:
        # Tied by config, or a checkpoint that simply omits the head (it reuses embeddings).
        model.tie_weights()
        loaded.add("lm_head.weight")
    missing = sorted(set(expected) - loaded)
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks tensors: {', '.join(missing[:10])}"
                         + (" ..." if len(missing) > 10 else ""))
    finalize_linears(model, dtype)
    fuse_input_quantization(model, dtype)  # FP8 inputs made by the kernels before (CUDA)
    if uses_cpu_gemm_layout(device, dtype):
        _use_cpu_gemm_layout(model)
    if device.type == "cuda" and attention_backend == "triton" and kernels.triton_available():
        use_skinny_gemv(model)  # plain bf16/fp16 projections only; see inflight/model/skinny.py
    model.model.rotary_emb.reset_cache(device)
    model.eval()
    return model, config


def _use_cpu_gemm_layout(model: LlamaForCausalLM) -> None:
    """Stores each decoder projection's weight column-major (`platform.uses_cpu_gemm_layout`).

    The tied embedding / LM head stays row-major (embedding lookups read rows).
    """
    for layer in model.model.layers:
        for linear in layer.modules():
            if isinstance(linear, nn.Linear):
                linear.weight = nn.Parameter(to_cpu_gemm_layout(linear.weight.detach()),
                                             requires_grad=False)


def _set_kv_scale(model: LlamaForCausalLM, name: str, tensor: torch.Tensor) -> None:
    """A layer's `k_scale` / `v_scale` (ModelOpt: `self_attn.k_proj.k_scale`; compressed-tensors:
    `self_attn.k_scale`) into its attention's `kv_scales`."""
    match = re.search(r"layers\.(\d+)\.", name)
    if match is None or tensor.numel() != 1:
        raise ValueError(f"KV-cache scale {name}: expected one value of a decoder layer, got shape "
                         f"{tuple(tensor.shape)}")
    attn = model.model.layers[int(match[1])].self_attn
    k_scale, v_scale = attn.kv_scales
    value = float(tensor.float())
    attn.kv_scales = (value, v_scale) if name.endswith(".k_scale") else (k_scale, value)


def allocate_kv_caches(config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device | str) -> list[torch.Tensor]:
    """One zeroed [2, num_blocks, block_size, num_kv_heads, head_dim] tensor per layer (`dtype`:
    the model's, or `torch.float8_e4m3fn` for an FP8 cache).

    Zeroed, not empty: attention backends read whole blocks and rely on unwritten slots being
    finite (masked weights are exactly zero, but 0 * NaN is NaN).
    """
    shape = (2, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]

"""TensorRT-LLM's LoRA request layout: `lora_weights` [N, W] and `lora_config` [N, 3] int32.

Each `lora_config` row `[module_id, layer, r]` describes the `lora_weights` row of the same index:
A [r, in] flattened row-major (r*in values), then B [out, r] flattened row-major (out*r values,
the scale already folded in), zero-padded to W. This is what NVIDIA's `hf_lora_convert.py`
writes (as [1, N, W] / [1, N, 3] .npy files) and what its clients send, so the ids and the HF
module mapping below are theirs; note gate_proj -> mlp_h_to_4h and up_proj -> mlp_gate.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ensemble.errors import InputError
from inflight.lora.adapter import MODULES, LoraAdapter, module_shapes
from inflight.model.config import ModelConfig

MODULE_IDS = {"attn_qkv": 0, "attn_q": 1, "attn_k": 2, "attn_v": 3, "attn_dense": 4,
              "mlp_h_to_4h": 5, "mlp_4h_to_h": 6, "mlp_gate": 7}
# TensorRT-LLM ids this server has no module for (cross-attention, MoE, fused gate/up): named in
# the refusal so a client sees what it sent.
UNSUPPORTED_IDS = {8: "cross_attn_qkv", 9: "cross_attn_q", 10: "cross_attn_k", 11: "cross_attn_v",
                   12: "cross_attn_dense", 13: "moe_h_to_4h", 14: "moe_4h_to_h", 15: "moe_gate",
                   16: "moe_router", 17: "mlp_router", 18: "mlp_gate_up"}
# HF module -> TensorRT-LLM id, as hf_lora_convert.py maps them (attn_qkv has no HF module of its
# own in a Llama checkpoint: it arrives only from clients and is split into q/k/v).
HF_TO_ID = {"q_proj": 1, "k_proj": 2, "v_proj": 3, "o_proj": 4, "gate_proj": 5, "down_proj": 6,
            "up_proj": 7}
ID_TO_HF = {module_id: name for name, module_id in HF_TO_ID.items()}
_ID_NAMES = {module_id: name for name, module_id in MODULE_IDS.items()}
_QKV = 0


def _as_tensor(value: Any, name: str) -> torch.Tensor:
    """A numpy array or torch tensor on the host, with a leading batch dimension of 1 dropped."""
    if isinstance(value, np.ndarray):
        try:
            tensor = torch.from_numpy(np.ascontiguousarray(value))
        except TypeError as exc:  # object, string or non-native byte order arrays
            raise InputError(f"{name} has unsupported dtype {value.dtype}") from exc
    elif isinstance(value, torch.Tensor):
        tensor = value.detach().cpu()
    else:
        raise InputError(f"{name} must be an array, got {type(value).__name__}")
    # The converter's .npy files and Triton's batched inputs carry a batch of one request.
    if tensor.dim() == 3 and tensor.shape[0] == 1:
        tensor = tensor[0]
    if tensor.dim() != 2:
        raise InputError(f"{name} must have shape [N, {'3' if name == 'lora_config' else 'W'}] "
                         f"(or [1, N, ...]), got {list(tensor.shape)}")
    return tensor


def _unsupported(row: int, module_id: int) -> InputError:
    supported = ", ".join(f"{name} ({i})" for name, i in MODULE_IDS.items())
    if module_id in UNSUPPORTED_IDS:
        return InputError(f"lora_config row {row}: module id {module_id} ({UNSUPPORTED_IDS[module_id]}) is "
                          f"not supported; this server's LoRA modules are {supported}")
    return InputError(f"lora_config row {row}: module id {module_id} is unknown; this server's LoRA "
                      f"modules are {supported}")


def from_nvidia(weights: Any, config_rows: Any, model_config: ModelConfig, max_rank: int | None = None,
                dtype: torch.dtype = torch.float32) -> LoraAdapter:
    """The adapter a request's `lora_weights` [N, W] and `lora_config` [N, 3] describe (either may
    carry a leading dimension of 1; weights in any float dtype, numpy or torch).

    An attn_qkv row becomes q/k/v entries sharing one A (the same tensor), B split by rows into
    the q, k and v output sizes. Factors are copied (never views of the request's buffers) and
    cast to `dtype`. Raises InputError, naming the row, for anything the model cannot apply.
    """
    w = _as_tensor(weights, "lora_weights")
    rows = _as_tensor(config_rows, "lora_config")
    if not w.is_floating_point():
        raise InputError(f"lora_weights must be floating point, got {w.dtype}")
    if rows.is_floating_point() or rows.is_complex() or rows.dtype == torch.bool:
        raise InputError(f"lora_config must be integers, got {rows.dtype}")
    if rows.shape[1] != 3:
        raise InputError(f"lora_config rows must be [module_id, layer, adapter_size], got "
                         f"{rows.shape[1]} columns")
    if rows.shape[0] != w.shape[0]:
        raise InputError(f"lora_config has {rows.shape[0]} rows but lora_weights has {w.shape[0]}: "
                         "each config row describes the weights row of the same index")
    if rows.shape[0] == 0:
        raise InputError("lora_config has no rows: a LoRA request needs at least one module")
    shapes, num_layers = module_shapes(model_config), model_config.num_hidden_layers
    q_size = model_config.num_attention_heads * model_config.head_dim
    kv_size = model_config.num_key_value_heads * model_config.head_dim
    width = w.shape[1]
    out: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for i, (module_id, layer, rank) in enumerate(rows.tolist()):
        if module_id != _QKV and module_id not in ID_TO_HF:
            raise _unsupported(i, module_id)
        name = _ID_NAMES[module_id]
        if not 0 <= layer < num_layers:
            raise InputError(f"lora_config row {i}: layer {layer} is out of range (the model has "
                             f"{num_layers} layers)")
        if rank < 1 or (max_rank is not None and rank > max_rank):
            limit = f" and at most {max_rank} (lora_cache_max_adapter_size)" if max_rank is not None else ""
            raise InputError(f"lora_config row {i}: adapter size {rank} must be at least 1{limit}")
        if module_id == _QKV:
            in_features, out_features = shapes["q_proj"][0], q_size + 2 * kv_size
        else:
            in_features, out_features = shapes[ID_TO_HF[module_id]]
        needed = rank * (in_features + out_features)
        if needed > width:
            raise InputError(f"lora_config row {i}: {name} of adapter size {rank} needs {needed} values "
                             f"(r*in + out*r = {rank}*{in_features} + {out_features}*{rank}) but "
                             f"lora_weights rows have {width}")
        row = w[i, :needed]
        # Checked here, not left to the kernels: one NaN would poison every token of the request.
        if not bool(torch.isfinite(row).all()):
            raise InputError(f"lora_weights row {i} ({name}, layer {layer}) holds NaN or infinite values")
        a = row[:rank * in_features].reshape(rank, in_features).to(dtype, copy=True)
        b = row[rank * in_features:].reshape(out_features, rank).to(dtype, copy=True)
        if module_id == _QKV:
            parts = zip(("q_proj", "k_proj", "v_proj"), b.split([q_size, kv_size, kv_size]))
            entries = [(module, a, part.contiguous()) for module, part in parts]
        else:
            entries = [(ID_TO_HF[module_id], a, b)]
        for module, a_part, b_part in entries:
            if (layer, module) in out:
                raise InputError(f"lora_config row {i}: layer {layer} {module} is given twice "
                                 f"({name} overlaps an earlier row)")
            out[(layer, module)] = (a_part, b_part)
    adapter = LoraAdapter(weights=out)
    adapter.check(model_config, max_rank)
    return adapter


def to_nvidia(adapter: LoraAdapter, dtype: Any = np.float16) -> tuple[np.ndarray, np.ndarray]:
    """`(lora_weights [N, W] of `dtype`, lora_config [N, 3] int32)` for `adapter`: one row per
    (layer, module), sorted by layer then `MODULES` order, zero-padded to the longest row.
    Raises InputError when a value does not fit `dtype` (float16 tops out at 65504)."""
    order = {module: i for i, module in enumerate(MODULES)}
    keys = sorted(adapter.weights, key=lambda key: (key[0], order[key[1]]))
    flat = []
    for key in keys:
        a, b = adapter.weights[key]
        # Through float32 so bfloat16 factors (which numpy cannot hold) convert too.
        flat.append(torch.cat([a.reshape(-1), b.reshape(-1)]).to(torch.float32).numpy())
    width = max((row.size for row in flat), default=0)
    lora_weights = np.zeros((len(keys), width), dtype=dtype)
    for i, row in enumerate(flat):
        with np.errstate(over="ignore"):  # overflow is reported below, by the layer it is in
            lora_weights[i, :row.size] = row
        if not np.isfinite(lora_weights[i, :row.size]).all() and np.isfinite(row).all():
            layer, module = keys[i]
            raise InputError(f"LoRA weights of layer {layer} {module} exceed {np.dtype(dtype).name}'s "
                             "range; store them as float32")
    lora_config = np.array([[HF_TO_ID[module], layer, adapter.weights[(layer, module)][0].shape[0]]
                            for layer, module in keys], dtype=np.int32).reshape(len(keys), 3)
    return lora_weights, lora_config

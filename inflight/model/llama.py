"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) over flattened, paged batches.

Parameter names are Hugging Face's, so a checkpoint's tensors load by name. With
`pack_projections` q/k/v become one `qkv_proj` and gate/up one `gate_up_proj` (one GEMM each
instead of three and two); `PackedLinear.parts` keeps the HF names of the rows it packs, and
the loader fills each part from the checkpoint tensor of that name. The math follows
transformers' modeling_llama / modeling_qwen2 / modeling_mistral (RMSNorm in fp32, rotate_half
RoPE, SiLU-gated MLP), so fp32 results match HF to float noise.

Norms, rotary and the MLP activation go through `self.ops` (`inflight.model.ops`): plain torch
with the torch attention backend, fused Triton kernels with the triton backend (which needs
the packed projections, so it always gets them).

Tensor parallelism (`tp`, see `inflight.model.sharding`): each rank builds the model of
`shard_config` (its heads, KV heads and MLP channels) and holds its shard of the vocabulary;
the partial sums of o_proj and down_proj are all-reduced (one all-reduce after attention, one
after the MLP), the embedding is all-reduced and the logits all-gathered. With one rank those
calls are no-ops.

LoRA: a step whose rows use adapters passes a `LoraBatch` (`inflight.lora.batch`, a layer
above this one: any object with its `apply`); each projection's output then gains its tokens'
adapter deltas. Without one nothing extra runs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from inflight.distributed.group import TensorParallel
from inflight.model.attention import AttentionBackend, get_attention_backend
from inflight.model.config import ModelConfig
from inflight.model.ops import TorchOps, select_ops
from inflight.model.rotary import RotaryEmbedding
from inflight.model.sharding import shard_config, vocab_shard_size
from inflight.platform import lm_head_padded_rows


class RMSNorm(nn.Module):
    """HF's LlamaRMSNorm; with `residual`, the residual add before it too (`TorchOps.add_rms_norm`)."""

    def __init__(self, hidden_size: int, eps: float, ops: TorchOps | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.ops = ops or TorchOps()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x), or (norm(residual + x), residual + x) when `residual` is given."""
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class PackedLinear(nn.Linear):
    """Several projections of the same input in one weight: rows of `parts` stacked in order.

    `parts` names each block of output rows with its checkpoint name (e.g. ("q_proj", 576));
    the weight is [sum of sizes, in_features] and `forward` returns the stacked outputs.
    """

    def __init__(self, in_features: int, parts: tuple[tuple[str, int], ...], bias: bool) -> None:
        super().__init__(in_features, sum(size for _, size in parts), bias=bias)
        self.parts = parts

    def part_slices(self, attr: str) -> dict[str, tuple[str, int, int]]:
        """Checkpoint part name -> (its tensor's name in the part, first row, number of rows)
        of parameter `attr` (weight or bias) that the part fills."""
        slices, start = {}, 0
        for name, size in self.parts:
            slices[name] = (attr, start, size)
            start += size
        return slices


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows [start, start + num_embeddings) of the embedding; ids outside them
    look up zeros, and the sum over the ranks is the full lookup."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__(vocab_shard_size(vocab_size, tp.size), hidden_size)
        self.tp = tp
        self.start = tp.rank * self.num_embeddings

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.is_parallel:
            return super().forward(input_ids)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        hidden = super().forward(local.masked_fill(outside, 0))  # [T, hidden]
        return self.tp.all_reduce(hidden.masked_fill_(outside.unsqueeze(-1), 0.0))


def _projected(linear: nn.Module, x: Any, lora: Any, layer: int,
               parts: tuple[tuple[str, int], ...]) -> torch.Tensor:
    """linear(x), plus the step's adapter deltas of `parts` ((module, output width) in column
    order) when there are adapters."""
    return linear(x) if lora is None else lora.project(layer, parts, x, linear)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, pack_projections: bool,
                 ops: TorchOps, tp: TensorParallel) -> None:
        super().__init__()
        self.ops = ops
        self.tp = tp
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim ** -0.5
        hidden = self.hidden = config.hidden_size
        bias = config.attention_bias
        self.sizes = (self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                      self.num_kv_heads * self.head_dim)
        self.packed = pack_projections
        if pack_projections:
            self.qkv_proj = PackedLinear(hidden, tuple(zip(("q_proj", "k_proj", "v_proj"), self.sizes)),
                                         bias=bias)
        else:
            self.q_proj = nn.Linear(hidden, self.sizes[0], bias=bias)
            self.k_proj = nn.Linear(hidden, self.sizes[1], bias=bias)
            self.v_proj = nn.Linear(hidden, self.sizes[2], bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=config.o_proj_bias)
        self.backend = backend
        # (k_scale, v_scale): an FP8 KV cache holds K and V divided by them (the checkpoint's,
        # set by the loader, else 1.0); a cache in the model's dtype ignores them.
        self.kv_scales = (1.0, 1.0)

    def forward(self, x: torch.Tensor, rope: Any, kv_cache: torch.Tensor, attn_metadata: Any, lora: Any = None,
                layer: int = 0, residual: torch.Tensor | None = None) -> torch.Tensor:
        """`rope` comes from `ops.rope_context`; `attn_metadata` from the backend's
        `build_metadata` (or `graph_metadata`); `lora`: the step's adapters, `layer` this one's
        index, `residual` the stream this layer's output is added to next (`SlotBatch.project`)."""
        num_tokens = x.shape[0]
        if self.packed:
            qkv = _projected(self.qkv_proj, x, lora, layer,
                             tuple(zip(("q_proj", "k_proj", "v_proj"), self.sizes)))  # [T, Hq*D + 2*Hkv*D]
            q, k, v = qkv.split(self.sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            if lora is not None:
                for name, out, size in zip(("q_proj", "k_proj", "v_proj"), (q, k, v), self.sizes):
                    lora.apply(layer, ((name, size),), x, out)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        q, k = self.ops.apply_rotary(q, k, rope)
        out = self.backend.forward(q, k, v, kv_cache, attn_metadata, self.scale, self.kv_scales)  # [T, Hq, D]
        out = out.reshape(num_tokens, self.num_heads * self.head_dim)
        if lora is None:
            projected = self.o_proj(out)  # [T, hidden]
        else:
            projected = lora.project(layer, (("o_proj", self.hidden),), out, self.o_proj,
                                     None if self.tp.is_parallel else residual)
        return self.tp.all_reduce(projected)


class SiluAndMul(nn.Module):
    """silu(gate) * up of the packed gate/up output: [T, 2I] -> [T, I] (`ops.silu_and_mul`)."""

    def __init__(self, ops: TorchOps) -> None:
        super().__init__()
        self.ops = ops

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(gate_up)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, pack_projections: bool, ops: TorchOps,
                 tp: TensorParallel) -> None:
        super().__init__()
        self.ops = ops
        self.tp = tp
        hidden, inter, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.hidden, self.inter = hidden, inter
        self.packed = pack_projections
        if pack_projections:
            self.gate_up_proj = PackedLinear(hidden, (("gate_proj", inter), ("up_proj", inter)),
                                             bias=bias)
            self.act_fn = SiluAndMul(ops)
        else:
            self.gate_proj = nn.Linear(hidden, inter, bias=bias)
            self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor, lora: Any = None, layer: int = 0,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        if lora is not None:
            return self.tp.all_reduce(self._forward_lora(x, lora, layer, residual))
        if self.packed:
            out = self.down_proj(self.act_fn(self.gate_up_proj(x)))  # [T, 2I] -> [T, I]
        else:
            gate = F.silu(self.gate_proj(x), inplace=True)  # in place: one activation buffer less
            out = self.down_proj(gate.mul_(self.up_proj(x)))
        return self.tp.all_reduce(out)

    def _forward_lora(self, x: torch.Tensor, lora: Any, layer: int,
                      residual: torch.Tensor | None) -> torch.Tensor:
        """The MLP with the step's adapter deltas on gate/up and down. The activation is the
        plain one (`ops.silu_and_mul`, not an FP8-writing fusion): the adapters need down_proj's
        input in the activation dtype. `residual`: as `Attention.forward`'s."""
        if self.packed:
            parts = (("gate_proj", self.inter), ("up_proj", self.inter))
            gate_up = lora.project(layer, parts, x, self.gate_up_proj)  # [T, 2I]
            hidden = self.ops.silu_and_mul(gate_up)  # [T, I]
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
            lora.apply(layer, (("gate_proj", gate.shape[-1]),), x, gate)
            lora.apply(layer, (("up_proj", up.shape[-1]),), x, up)
            hidden = F.silu(gate, inplace=True).mul_(up)  # as the base path computes it
        return lora.project(layer, (("down_proj", self.hidden),), hidden, self.down_proj,
                            None if self.tp.is_parallel else residual)  # [T, hidden]


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, pack_projections: bool,
                 ops: TorchOps, tp: TensorParallel, index: int = 0) -> None:
        super().__init__()
        self.index = index
        self.self_attn = Attention(config, backend, pack_projections, ops, tp)
        self.mlp = MLP(config, pack_projections, ops, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: Any,
                kv_cache: torch.Tensor, attn_metadata: Any,
                lora: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """HF's `h = h + attn(norm(h)); h = h + mlp(norm(h))` with each add carried into the
        next norm: returns (this layer's MLP output, the residual stream before adding it)."""
        if residual is None:  # the first layer: the residual stream is the embeddings
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if lora is None:
            hidden = self.self_attn(hidden, rope, kv_cache, attn_metadata)
            hidden, residual = self.post_attention_layernorm(hidden, residual)
            return self.mlp(hidden), residual
        hidden = self.self_attn(hidden, rope, kv_cache, attn_metadata, lora, self.index, residual)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden, lora, self.index, residual), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, pack_projections: bool,
                 ops: TorchOps, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        layer_config = shard_config(config, tp.size)
        self.layers = nn.ModuleList(DecoderLayer(layer_config, backend, pack_projections, ops, tp, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                          config.rope_theta, config.rope_scaling)


class LlamaForCausalLM(nn.Module):
    """Decoder-only LM computing a step's flattened tokens against the paged KV cache.

    `forward(input_ids [T], positions [T], kv_caches, attn_metadata) -> hidden [T, hidden]`
    writes each layer's K/V for the T tokens into `kv_caches[layer]` and returns final-norm
    hidden states; `attn_metadata` is `attention_backend.build_metadata(step)` for the step's
    `StepMetadata`. Select the rows to sample (e.g. `step.last_token_indices`) and call
    `compute_logits`. Positions must be < `max_position_embeddings` (the RoPE table's length).
    With `tp` of several ranks every rank runs the same calls (see the module docstring);
    `config` is the whole model's, and `kv_caches` are this rank's (`shard_config` heads).
    """

    def __init__(self, config: ModelConfig, attention_backend: str | AttentionBackend = "torch",
                 pack_projections: bool = False, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp or TensorParallel.single()
        backend = (attention_backend if isinstance(attention_backend, AttentionBackend)
                   else get_attention_backend(attention_backend))
        self.attention_backend = backend
        self.ops = select_ops(backend.name)
        self.packed = pack_projections or self.ops.requires_packed_projections
        self.model = LlamaModel(config, backend, self.packed, self.ops, self.tp)
        self.lm_head = nn.Linear(config.hidden_size, vocab_shard_size(config.vocab_size, self.tp.size),
                                 bias=False)
        if config.tie_word_embeddings:
            self.tie_weights()

    def tie_weights(self) -> None:
        """Shares the embedding matrix with the LM head (one Parameter, one copy in memory)."""
        self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: Any,
                lora: Any = None) -> torch.Tensor:
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"expected {len(self.model.layers)} KV caches, got {len(kv_caches)}")
        hidden = self.model.embed_tokens(input_ids)  # [T, hidden]
        # RoPE inputs for this step's positions, shared by every layer.
        rope = self.ops.rope_context(self.model.rotary_emb, positions, hidden.dtype)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            hidden, residual = layer(hidden, residual, rope, kv_cache, attn_metadata, lora)
        return self.model.norm(hidden, residual)[0]  # [T, hidden]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [S, hidden] -> logits [S, vocab] in float32 (written into `out` if given: a
        CUDA graph's static buffer, so the cast to fp32 is the copy into it)."""
        if out is not None:
            return out.copy_(self._gather_vocab(self.lm_head(hidden)))
        num_rows = hidden.shape[0]
        padded_rows = lm_head_padded_rows(num_rows, hidden.device, hidden.dtype)
        if padded_rows != num_rows:  # a faster GEMM shape on this platform; zero rows are free
            padded = hidden.new_zeros(padded_rows, hidden.shape[1])
            padded[:num_rows] = hidden
            return self._gather_vocab(self.lm_head(padded)[:num_rows]).float()
        return self._gather_vocab(self.lm_head(hidden)).float()

    def _gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary shard [S, V/tp] -> the whole vocabulary [S, V] on every rank."""
        if not self.tp.is_parallel:
            return logits
        return self.tp.all_gather_last(logits)[:, :self.config.vocab_size]

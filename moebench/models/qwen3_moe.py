"""Qwen3-MoE (Qwen3-30B-A3B and relatives): what differs from Qwen2-MoE, and nothing else.

- attention: no q/k/v bias (unless attention_bias), an RMSNorm over each head of q and of k before
  RoPE, and an explicit head_dim;
- MoE block: no shared expert; the top-k probabilities are renormalised when norm_topk_prob
  (true for Qwen3-30B-A3B). Routing, experts, the fused kernel and recording are the shared ones.
"""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx

from ..checkpoint.config import ModelArgs
from ..errors import ConfigError
from . import qwen2_moe
from .qwen2_moe import Attention, Builder, Linear, Qwen2MoeModel, RMSNorm


class Qwen3Attention(Attention):
    """Attention with per-head RMSNorm on q and k."""

    kernel_decline = "per-head q/k RMSNorm before RoPE (not in the decode-attention kernel)"

    def __init__(self, args: ModelArgs, projections: tuple[Linear, Linear, Linear, Linear], q_norm: RMSNorm,
                 k_norm: RMSNorm):
        super().__init__(args, *projections)
        self.q_norm, self.k_norm = q_norm, k_norm

    def project(self, x: mx.array, stack: bool) -> tuple[mx.array, mx.array, mx.array]:
        q, k, v = super().project(x, stack)
        return self.q_norm(q), self.k_norm(k), v


class Qwen3Builder(Builder):
    def attention(self, prefix: str) -> Qwen3Attention:
        hd = self.args.head_dim
        return Qwen3Attention(self.args, self.attention_projections(prefix, self.args.qkv_bias),
                              self.norm(f"{prefix}.q_norm.weight", hd), self.norm(f"{prefix}.k_norm.weight", hd))


def build(args: ModelArgs, store, dtype: mx.Dtype) -> Qwen2MoeModel:
    """Build a Qwen3-MoE model from a checkpoint's tensors."""
    if args.shared_expert_intermediate_size:
        raise ConfigError("qwen3_moe config sets shared_expert_intermediate_size, but Qwen3-MoE has no shared expert")
    return Qwen3Builder(args, store, dtype).model()


def tensor_shapes(args: ModelArgs) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Qwen2-MoE's tensors plus the per-head q/k norms (no shared expert, no biases by config)."""
    for name, shape in qwen2_moe.tensor_shapes(args):
        yield name, shape
        if name.endswith("self_attn.o_proj.weight"):
            prefix = name[: -len("o_proj.weight")]
            yield f"{prefix}q_norm.weight", (args.head_dim,)
            yield f"{prefix}k_norm.weight", (args.head_dim,)

"""A tiny decoder-only byte-level MoE language model whose feed-forward layers are :class:`lrmoe.nn.LRMoE`.

Shapes: B batch, L sequence length, D model dim, H attention heads, C head dim (D = H * C), V vocab.

Each block is pre-norm: ``x + attn(norm(x))`` then ``x + moe(norm(x))``. Attention is causal
``F.scaled_dot_product_attention`` with rotary position embeddings. Only the MoE layers differ between a dense
run (``retain=1.0``) and a selective-backward run; everything else is plain PyTorch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from lrmoe.demo.data import VOCAB_SIZE
from lrmoe.nn import LRMoE

__all__ = ["ModelConfig", "MoELM", "lrmoe_layers"]


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of :class:`MoELM` plus the LRMoE options passed to every MoE layer."""

    vocab_size: int = VOCAB_SIZE
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    max_seq_len: int = 128
    num_experts: int = 8
    top_k: int = 2
    expert_hidden_dim: int = 128
    tie_embeddings: bool = True
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-6
    init_std: float = 0.02
    # LRMoE options (see lrmoe.nn.LRMoE).
    retain: float = 1.0
    metric: str = "lrm"
    selection: str = "sample"
    policy: str = "waterfill"
    min_retain: float = 0.0
    backward_capacity: float | None = None  # LRMoE's (retain < 1 only)

    def __post_init__(self) -> None:
        if self.dim % self.n_heads != 0 or (self.dim // self.n_heads) % 2 != 0:
            raise ValueError(f"dim={self.dim} must split into {self.n_heads} heads of even size")


def _rotary_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each [L, C], for rotate-half rotary embeddings."""
    inv_freq_C2 = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles_LC2 = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq_C2)
    angles_LC = torch.cat([angles_LC2, angles_LC2], dim=-1)
    return angles_LC.cos(), angles_LC.sin()


def _apply_rotary(x_BHLC: torch.Tensor, cos_LC: torch.Tensor, sin_LC: torch.Tensor) -> torch.Tensor:
    x1, x2 = x_BHLC.chunk(2, dim=-1)
    rotated_BHLC = torch.cat([-x2, x1], dim=-1)
    return x_BHLC * cos_LC + rotated_BHLC * sin_LC


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with rotary positions."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wqkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x_BLD: torch.Tensor, cos_LC: torch.Tensor, sin_LC: torch.Tensor) -> torch.Tensor:
        B, L, D = x_BLD.shape
        qkv_BL3HC = self.wqkv(x_BLD).view(B, L, 3, self.n_heads, self.head_dim)
        q_BHLC, k_BHLC, v_BHLC = qkv_BL3HC.permute(2, 0, 3, 1, 4).unbind(0)
        q_BHLC = _apply_rotary(q_BHLC, cos_LC, sin_LC)
        k_BHLC = _apply_rotary(k_BHLC, cos_LC, sin_LC)
        out_BHLC = F.scaled_dot_product_attention(q_BHLC, k_BHLC, v_BHLC, is_causal=True)
        return self.wo(out_BHLC.transpose(1, 2).reshape(B, L, D))


class Block(nn.Module):
    """Pre-norm transformer block: attention then an LRMoE feed-forward, each with a residual."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.moe_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.moe = LRMoE(
            cfg.dim,
            cfg.expert_hidden_dim,
            cfg.num_experts,
            cfg.top_k,
            retain=cfg.retain,
            metric=cfg.metric,
            selection=cfg.selection,
            policy=cfg.policy,
            min_retain=cfg.min_retain,
            backward_capacity=cfg.backward_capacity,
        )

    def forward(self, x_BLD: torch.Tensor, cos_LC: torch.Tensor, sin_LC: torch.Tensor) -> torch.Tensor:
        x_BLD = x_BLD + self.attn(self.attn_norm(x_BLD), cos_LC, sin_LC)
        return x_BLD + self.moe(self.moe_norm(x_BLD))


class MoELM(nn.Module):
    """Byte embedding, ``n_layers`` blocks, final RMSNorm, LM head (tied to the embedding by default)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos_LC, sin_LC = _rotary_tables(cfg.max_seq_len, cfg.dim // cfg.n_heads, cfg.rope_theta)
        self.register_buffer("rope_cos_LC", cos_LC, persistent=False)
        self.register_buffer("rope_sin_LC", sin_LC, persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 style: N(0, 0.02) everywhere, output projections (attention ``wo``, expert ``down_proj``)
        scaled by 1/sqrt(2 * n_layers); norms at one. Expert weights are set here too, so the model's
        initialisation does not depend on how LRMoE initialises itself."""
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, param in self.named_parameters():
            if "norm" in name:
                nn.init.ones_(param)
            elif name.endswith("wo.weight") or name.endswith("down_proj"):
                nn.init.normal_(param, std=out_std)
            else:
                nn.init.normal_(param, std=std)

    def forward(self, tokens_BL: torch.Tensor) -> torch.Tensor:
        """[B, L] int64 bytes -> [B, L, V] logits (L <= max_seq_len)."""
        L = tokens_BL.shape[1]
        cos_LC, sin_LC = self.rope_cos_LC[:L], self.rope_sin_LC[:L]
        h_BLD = self.embed(tokens_BL)
        for block in self.blocks:
            h_BLD = block(h_BLD, cos_LC, sin_LC)
        h_BLD = self.norm(h_BLD)
        weight_VD = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(h_BLD, weight_VD)


def lrmoe_layers(model: nn.Module) -> Iterator[LRMoE]:
    """The model's LRMoE layers, in module order (works on a ``torch.compile``-wrapped model too)."""
    for module in model.modules():
        if isinstance(module, LRMoE):
            yield module

"""A DeiT-style Transformer block built from Mesa layers, with explicit attention.

Used by the memory tests and ``tools/benchmark_ops.py`` as the unit the paper's savings are
measured on (DeiT-Ti width: dim 192, 3 heads, 197 tokens). ``models/`` holds the full models.

Shapes: x (B, N, C) -> (B, N, C); attention tensors (B, H, N, D) with one quantization group per
head (Pan et al., Sec. 3.3, head-wise quantization).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from . import layers as L


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = L.Linear(dim, dim * 3, quant_groups=num_heads)
        self.qk = L.MatMul(quant_groups=num_heads)
        self.softmax = L.Softmax(dim=-1, quant_groups=num_heads)
        self.av = L.MatMul(quant_groups=num_heads)
        self.proj = L.Linear(dim, dim, quant_groups=num_heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, c // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = self.softmax(self.qk(q * self.scale, k.transpose(-2, -1)))
        return self.proj(self.av(attn, v).transpose(1, 2).reshape(b, n, c))


class Block(nn.Module):
    """Pre-norm Transformer block: x + Attn(LN(x)); x + MLP(LN(x)), MLP = fc1 -> GELU -> fc2."""

    def __init__(self, dim: int = 192, num_heads: int = 3, mlp_ratio: float = 4.0):
        super().__init__()
        hidden = int(dim * mlp_ratio)
        self.norm1 = L.LayerNorm(dim, quant_groups=num_heads)
        self.attn = Attention(dim, num_heads)
        self.norm2 = L.LayerNorm(dim, quant_groups=num_heads)
        self.fc1 = L.Linear(dim, hidden, quant_groups=num_heads)
        self.act = L.GELU(quant_groups=num_heads)
        self.fc2 = L.Linear(hidden, dim, quant_groups=num_heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))

"""The benchmarks' decoder-only transformer in plain torch (RMSNorm, grouped-query attention with
rotary embeddings, SwiGLU), its configurations and its token batches.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


CONFIGS = {
    # Finishes in seconds on a 2-core CPU; the default without a GPU.
    "small": dict(layers=4, hidden=64, heads=4, kv_heads=2, mlp=176, seqs="64", batch=2, dtype="float32",
                  vocab=256, warmup=1, steps=7),
    # Llama-3-8B-shaped layers; the default with a GPU.
    "standard": dict(layers=8, hidden=4096, heads=32, kv_heads=8, mlp=14336, seqs="4096,8192", batch=1,
                     dtype="bfloat16", vocab=1024, warmup=2, steps=5),
}


class RMSNorm(nn.Module):
    def __init__(self, hidden, eps=1e-5, **fk):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden, **fk))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


@functools.lru_cache(maxsize=16)
def rope_tables(seq, head_dim, device, dtype, base=500000.0):
    """Rotary cos/sin tables, cached: computed once per shape, shared by every block."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    emb = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq).repeat(1, 2).to(device)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


class Attention(nn.Module):
    def __init__(self, hidden, heads, kv_heads, rope, **fk):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.q = nn.Linear(hidden, heads * self.head_dim, bias=False, **fk)
        self.k = nn.Linear(hidden, kv_heads * self.head_dim, bias=False, **fk)
        self.v = nn.Linear(hidden, kv_heads * self.head_dim, bias=False, **fk)
        self.o = nn.Linear(heads * self.head_dim, hidden, bias=False, **fk)
        self.rope = rope

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.rope:
            cos, sin = rope_tables(s, self.head_dim, x.device, x.dtype)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return self.o(a.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, hidden, width, **fk):
        super().__init__()
        self.gate = nn.Linear(hidden, width, bias=False, **fk)
        self.up = nn.Linear(hidden, width, bias=False, **fk)
        self.down = nn.Linear(width, hidden, bias=False, **fk)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, hidden, heads, kv_heads, mlp, rope, **fk):
        super().__init__()
        self.attn_norm = RMSNorm(hidden, **fk)
        self.attn = Attention(hidden, heads, kv_heads, rope, **fk)
        self.mlp_norm = RMSNorm(hidden, **fk)
        self.mlp = SwiGLU(hidden, mlp, **fk)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class MLPBlock(nn.Module):
    """LayerNorm and a GELU MLP with a residual: at small sizes a block whose compute is negligible
    beside the host's work per layer (the host-overhead benchmark's block)."""

    def __init__(self, hidden, width, **fk):
        super().__init__()
        self.norm = nn.LayerNorm(hidden, **fk)
        self.up = nn.Linear(hidden, width, **fk)
        self.down = nn.Linear(width, hidden, **fk)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Decoder(nn.Module):
    """Embedding, blocks, norm, a small LM head (small vocab: the blocks' activations dominate).
    block="mlp": MLPBlock blocks instead of transformer blocks."""

    def __init__(self, a, device, dtype, block="transformer"):
        super().__init__()
        fk = dict(device=device, dtype=dtype)
        self.embed = nn.Embedding(a.vocab, a.hidden, **fk)
        if block == "mlp":
            self.layers = nn.ModuleList(MLPBlock(a.hidden, a.mlp, **fk) for _ in range(a.layers))
        else:
            self.layers = nn.ModuleList(Block(a.hidden, a.heads, a.kv_heads, a.mlp, a.rope, **fk)
                                        for _ in range(a.layers))
        self.norm = RMSNorm(a.hidden, **fk)
        self.head = nn.Linear(a.hidden, a.vocab, bias=False, **fk)
        self.layer_call = None  # set by the sync_offload mode: how each block is called
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.layers:
            x = block(x) if self.layer_call is None else self.layer_call(block, x)
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def make_ids(a, seq, device):
    g = torch.Generator().manual_seed(seq)
    return torch.randint(0, a.vocab, (a.batch, seq), generator=g).to(device)

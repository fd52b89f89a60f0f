"""A small GPT-like model in plain torch, shared by the tests."""
import torch
from torch import nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, hidden, heads, dropout=0.0):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.dropout(self.proj(a.transpose(1, 2).reshape(b, s, h)))
        return x + self.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class TinyGPT(nn.Module):
    def __init__(self, vocab=97, hidden=32, heads=4, layers=6, max_len=64, dropout=0.0):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(max_len, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)
        self.register_buffer("positions", torch.arange(max_len), persistent=False)

    def forward(self, ids):
        x = self.embed(ids) + self.pos(self.positions[: ids.shape[1]])
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def make_model(seed=0, device="cpu", **kw):
    torch.manual_seed(seed)
    return TinyGPT(**kw).to(device)


def make_batch(seed=1, batch=2, seq=16, vocab=97, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g).to(device)


def loss_of(model, ids):
    logits = model(ids)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

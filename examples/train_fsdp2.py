"""Trains a small Llama-shaped model with FSDP2 (fully_shard per block), each block compiled, and
every n-th block checkpointed with its input offloaded to pinned host memory; prints each rank's
share of its node's host memory, loss, peak memory and ckpt_offload.stats().

    torchrun --nproc-per-node 2 examples/train_fsdp2.py            # GPUs (nccl), or CPU (gloo)
    torchrun --nproc-per-node 2 examples/train_fsdp2.py --device cpu --backend aot_eager
    # two nodes (here both on one machine), 2 ranks each: start both
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29400 \
        examples/train_fsdp2.py --device cpu --no-compile
    torchrun --nnodes 2 --node-rank 1 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29400 \
        examples/train_fsdp2.py --device cpu --no-compile
"""
import argparse
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def rotary(seq, head_dim, device, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv)
    return torch.cos(angles), torch.sin(angles)


def apply_rotary(x, cos, sin):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Block(nn.Module):
    """Pre-norm attention (grouped-query, rotary) and a SwiGLU MLP, as in Llama."""

    def __init__(self, hidden, heads, kv_heads, ffn):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.attn_norm = RMSNorm(hidden)
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.kv = nn.Linear(hidden, 2 * kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = RMSNorm(hidden)
        self.gate_up = nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x, cos, sin):
        b, s, h = x.shape
        y = self.attn_norm(x)
        q = self.q(y).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(y).view(b, s, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, h))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Llama(nn.Module):
    def __init__(self, vocab, hidden, layers, heads, kv_heads, ffn):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Block(hidden, heads, kv_heads, ffn) for _ in range(layers))
        self.norm = RMSNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head_dim = hidden // heads

    def forward(self, ids):
        cos, sin = rotary(ids.shape[1], self.head_dim, ids.device)
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.head(self.norm(x))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (inductor, aot_eager, eager)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="compile every block (--no-compile: eager, which starts in seconds on the CPU)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=None, help="default: 1024 on cuda, 64 on cpu")
    p.add_argument("--seq", type=int, default=None, help="default: 2048 on cuda, 64 on cpu")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--every-n-layers", type=int, default=2, help="checkpoint (and offload) every n-th block")
    p.add_argument("--offload", action=argparse.BooleanOptionalAction, default=True,
                   help="offload the checkpointed blocks' inputs (--no-offload: plain checkpointing, to compare)")
    args = p.parse_args()
    cuda = args.device == "cuda"
    hidden = args.hidden or (1024 if cuda else 64)
    seq = args.seq or (2048 if cuda else 64)
    if not cuda:
        # On the CPU there is no device memory to free: this test path sends CPU tensors through the
        # same pinned pool and copy engine, so the run exercises what a GPU run does.
        os.environ.setdefault("CKPT_OFFLOAD_TEST_CPU", "1")
    import ckpt_offload  # after the switch above: sessions read it when created
    from ckpt_offload.sizing import hostmem
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (world,))
    # The ranks of one node share its host memory: each one's pinned budget is its node's share
    # (LOCAL_WORLD_SIZE ranks), not the job's (WORLD_SIZE). Half of what is available, split, is
    # the pool's cap; past it a tensor stays on the device.
    available = hostmem.memory_available_bytes()
    ckpt_offload.host_pool().set_capacity("auto")
    share = ckpt_offload.stats()["host_capacity_bytes"]
    print(f"rank {rank}: local world size {hostmem.local_world_size()} of world {world}, "
          f"host share {share} bytes of {available} available", flush=True)

    torch.manual_seed(0)
    model = Llama(vocab=1024, hidden=hidden, layers=args.layers, heads=8, kv_heads=2, ffn=hidden * 8 // 3).to(device)
    if cuda:
        model = model.to(torch.bfloat16)
    # Every block compiled: the checkpointed ones by enable_checkpointing (the checkpoint and the
    # offload stay eager around the compiled forward), the others with block.compile().
    compile_options = {"backend": args.backend} if args.compile else False
    checkpointed = ckpt_offload.enable_checkpointing(
        model, every_n_layers=args.every_n_layers, offload=args.offload, compile=compile_options
    )
    for i, layer in enumerate(model.layers):
        if args.compile and i not in checkpointed:
            layer.compile(**compile_options)
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if rank == 0:
        state = ckpt_offload.checkpointing_state(model)
        print(f"{world} x {device.type}, {args.layers} layers, hidden {hidden}, seq {seq}, "
              f"backend {args.backend if args.compile else 'none (eager)'}; "
              f"checkpointed {state[0]}, offloaded {state[1]}", flush=True)

    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    for step in range(args.steps):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        ckpt_offload.reset_stats()
        ids = torch.randint(0, 1024, (args.batch, seq + 1), generator=g).to(device)
        t0 = time.perf_counter()
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ckpt_offload.synchronize()
        dt = time.perf_counter() - t0
        loss = loss.detach()
        dist.all_reduce(loss)
        if cuda:
            peak = f"peak allocated {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB"
        else:  # ru_maxrss: KiB on Linux; the process's peak resident set, not tensors alone
            peak = f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.1f} MiB"
        if rank == 0:
            print(f"step {step}: loss {loss.item() / world:.4f}, {peak}, {dt:.2f} s"
                  + (" (includes compiling)" if step == 0 and args.compile else ""), flush=True)
    s = ckpt_offload.stats()
    if rank == 0:
        keys = ("bytes_offloaded", "tensors_offloaded", "tensors_prefetched", "reloads_on_demand",
                "host_reserved_bytes", "host_in_use_bytes", "host_alloc_calls")
        print("stats (last step, rank 0):", {k: s[k] for k in keys}, flush=True)
        if args.compile:
            from torch._dynamo.utils import counters

            print(f"torch.compile: {counters['stats']['unique_graphs']} graphs, "
                  f"{sum(counters['graph_break'].values())} graph breaks", flush=True)
    # Every rank done before any tears its process group down: a rank that destroys it while another
    # still prints can abort in gloo's teardown at exit.
    dist.barrier()
    dist.destroy_process_group()
    if not cuda:
        # gloo's worker thread can release the last collective's tensors after the interpreter has
        # begun to shut down; taking the GIL then aborts the process ("terminate called without an
        # active exception", about one run in fifteen on two cores). Everything is done and
        # printed: leave without the interpreter's teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()

"""A training step's timeline on the CPU, with the copy streams simulated (CKPT_OFFLOAD_TEST_ASYNC=1): each copy
takes a random delay of up to --max-us microseconds. Writes OUT.png and OUT.json (a Chrome trace) and prints
the summary. The pictures in docs/timeline.md come from here; they are simulated, not GPU timings.

Each layer is a small residual MLP plus a stand-in for a GPU layer's compute: --compute-ms of sleep in its
forward and twice that in its backward (so a layer's backward, recompute included, takes about three times its
forward), which keeps the picture readable on a busy CPU.

    python examples/timeline_sim.py --max-us 50000 --out docs/img/timeline_healthy   # the copies hide
    python examples/timeline_sim.py --max-us 600000 --out docs/img/timeline_starved   # the link is too slow
"""
import argparse
import json
import os
import time


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-us", type=int, default=100_000, help="longest simulated copy, in microseconds")
    p.add_argument("--prefetch", type=int, default=1, help="layers on their way back ahead of need (0: none)")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--compute-ms", type=float, default=20.0, help="stand-in compute per layer forward (0: none)")
    p.add_argument("--seed", type=int, default=5, help="seeds the simulated delays")
    p.add_argument("--out", default="timeline_sim", help="path without extension")
    args = p.parse_args()
    # Read by the engine when it is created: before the first offload.
    os.environ.update(CKPT_OFFLOAD_TEST_CPU="1", CKPT_OFFLOAD_TEST_ASYNC="1",
                      CKPT_OFFLOAD_TEST_ASYNC_MAX_US=str(args.max_us), CKPT_OFFLOAD_TEST_SEED=str(args.seed))
    import torch

    import ckpt_offload

    class Compute(torch.autograd.Function):  # time a GPU layer would spend, forward and backward
        @staticmethod
        def forward(ctx, x):
            time.sleep(args.compute_ms / 1e3)
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            time.sleep(2 * args.compute_ms / 1e3)
            return grad

    class Block(torch.nn.Module):  # a residual MLP block: one checkpointed layer
        def __init__(self, w):
            super().__init__()
            self.up, self.act, self.down = torch.nn.Linear(w, 2 * w), torch.nn.GELU(), torch.nn.Linear(2 * w, w)

        def forward(self, x):
            return x + self.down(self.act(self.up(Compute.apply(x))))

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Block(args.width) for _ in range(args.layers)])
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=0, prefetch=args.prefetch)
    x = torch.randn(args.batch, args.width, requires_grad=True)

    def step():
        model(x).square().mean().backward()

    step()  # the first step pins the pool's blocks; the recorded one reuses them
    with ckpt_offload.timeline() as tl:
        step()
    tl.plot(args.out + ".png")
    tl.save_chrome_trace(args.out + ".json")
    print(json.dumps(tl.summary(), indent=1))


if __name__ == "__main__":
    main()

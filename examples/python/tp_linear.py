"""A row-parallel linear layer (as tensor-parallel LLM inference splits an MLP's down
projection or an attention output projection) whose all-reduce is the ``allreduce`` package
instead of ``torch.distributed.all_reduce``.

    torchrun --nproc-per-node 2 examples/python/tp_linear.py                  # CPU, host backend
    torchrun --nproc-per-node 4 examples/python/tp_linear.py --device cuda    # one process per rank

Rank r of N holds a slice of the input features: columns r*k..(r+1)*k of the input X and of
the weight W (out_features x in_features). Its partial output X_r @ W_r^T summed over the ranks
is X @ W^T; the bias is added once, after the sum. Each rank checks its output against the
unsplit layer and against ``torch.distributed.all_reduce`` (gloo) of the same partial
outputs, prints both differences, and exits non-zero if either is out of tolerance.

``--device cuda``: each torchrun process is one rank on GPU ``LOCAL_RANK % device_count``,
built with ``Communicator.from_process_group`` over the gloo group (several processes on one
GPU need MPS). ``--device cpu``: the library's host backend runs a group's ranks as threads of
one process (it has no transport between processes), so each torchrun process runs the whole
group of N ranks as threads and checks its own rank's output against
``torch.distributed.all_reduce`` across the torchrun processes.
"""

import argparse
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

import allreduce

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class RowParallelLinear(torch.nn.Module):
    """Rank ``rank``'s part of ``Linear(in_features, out_features)``: its column slice of the
    weight, and the bias (added once, after the all-reduce)."""

    def __init__(self, weight, bias, rank, world, comm):
        super().__init__()
        k = weight.shape[1] // world
        self.weight = torch.nn.Parameter(weight[:, rank * k:(rank + 1) * k].contiguous(),
                                         requires_grad=False)
        self.bias = torch.nn.Parameter(bias.clone(), requires_grad=False)
        self.comm = comm

    def partial(self, x_slice):
        return torch.nn.functional.linear(x_slice, self.weight)

    def forward(self, x_slice):
        y = self.partial(x_slice)
        self.comm.all_reduce(y)  # in place; through torch.ops.allreduce.all_reduce_inplace
        return y + self.bias


def layer(args, device):
    """The unsplit layer and input, the same on every process (one seed)."""
    gen = torch.Generator().manual_seed(args.seed)
    dtype = DTYPES[args.dtype]
    x = torch.randn(args.batch, args.in_features, generator=gen).to(device, dtype)
    w = (torch.randn(args.out_features, args.in_features, generator=gen)
         / args.in_features ** 0.5).to(device, dtype)
    b = torch.randn(args.out_features, generator=gen).to(device, dtype)
    return x, w, b


def shard(x, rank, world):
    k = x.shape[1] // world
    return x[:, rank * k:(rank + 1) * k].contiguous()


def run_rank(args, rank, world, comm, device):
    """This rank's output, and its partial output (what torch.distributed sums)."""
    x, w, b = layer(args, device)
    tp = RowParallelLinear(w, b, rank, world, comm)
    xs = shard(x, rank, world)
    with torch.inference_mode():
        partial = tp.partial(xs)
        y = tp(xs)
    return y, partial


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--in-features", type=int, default=1024)
    p.add_argument("--out-features", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.in_features % world:
        sys.exit(f"--in-features {args.in_features} is not a multiple of {world} ranks")

    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("--device cuda: torch sees no CUDA device")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))
                              % torch.cuda.device_count())
        torch.cuda.set_device(device)
        comm = allreduce.Communicator.from_process_group(backend="cuda", device=device)
        y, partial = run_rank(args, rank, world, comm, device)
        torch.cuda.synchronize(device)
        comm.close()
    else:
        device = torch.device("cpu")
        comms = allreduce.Communicator.group(world)
        with ThreadPoolExecutor(world) as pool:
            results = list(pool.map(lambda r: run_rank(args, r, world, comms[r], device),
                                    range(world)))
        for c in comms:
            c.close()
        y, partial = results[rank]

    # The references, in float32 on the CPU: the unsplit layer, and torch.distributed's sum of
    # the same partial outputs plus the bias.
    x, w, b = (t.cpu().float() for t in layer(args, "cpu"))
    unsplit = torch.nn.functional.linear(x, w, b)
    summed = partial.cpu().clone()  # an inference tensor cannot be written outside inference mode
    dist.all_reduce(summed)
    by_dist = summed.float() + b
    ours = y.cpu().float()

    # float32: the unsplit layer accumulates in another order (a few ulps of the sum); 16-bit
    # dtypes round each partial output and the sum.
    tol = 1e-4 if args.dtype == "float32" else 3e-2
    scale = unsplit.abs().max().item()
    d_dist = (ours - by_dist).abs().max().item()
    d_unsplit = (ours - unsplit).abs().max().item()
    identical = torch.equal(y.cpu(), (summed + b.to(summed.dtype)))
    ok = d_dist <= tol * scale and d_unsplit <= tol * scale
    line = (f"rank {rank}/{world} {args.device} {args.dtype}: max |ours - torch.distributed| "
            f"= {d_dist:.3g}, max |ours - unsplit| = {d_unsplit:.3g} (largest output "
            f"{scale:.3g}); bitwise equal to torch.distributed: {identical}; "
            f"{'ok' if ok else 'FAILED'}\n")
    dist.destroy_process_group()
    # One write: the ranks share torchrun's output, and print's separate writes of the text
    # and the newline interleave.
    os.write(sys.stdout.fileno(), line.encode())
    # os._exit, not sys.exit: torch 2.11's gloo worker thread may drop the last reference to
    # the all-reduced tensor while the interpreter shuts down, and then aborts the process
    # ("terminate called without an active exception").
    os._exit(0 if ok else 1)


if __name__ == "__main__":
    main()

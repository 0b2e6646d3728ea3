#!/usr/bin/env python3
"""The peers that need one GPU per rank, timed with the bench's method on a multi-GPU machine:
NCCL plain, NCCL on symmetric windows, PyTorch symmetric memory one-shot / two-shot / multimem,
and FlashInfer's FP8 quantized all-reduce. Not runnable on virtual ranks (one GPU).

    torchrun --nproc_per_node=8 scripts/peers/torch_peers.py [--min-bytes 16] [--max-bytes 64M] [--graph]

Per size (factor 4, bf16, integer inputs): every contender runs once and is checked (exact
contenders against the exact sum, FP8 by SNR), then warm-up, then two timed loops; rank 0
prints the slowest rank's time per call in us, "-" for a contender that is unavailable here
(with the reason once) or wrong. Compare with `allreduce-bench --backend cuda --peers` on the
same machine and `--devices` listing the GPUs.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist


def size(s):
    m = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * m[s[-1]] if s[-1] in m else int(s)


def contenders(group, n_max, dtype, device):
    """name -> (setup(n) -> (fn, out), exact)."""
    import torch.distributed._symmetric_memory as symm_mem

    out = {}

    def nccl(n):
        t = torch.empty(n, dtype=dtype, device=device)
        return (lambda x: (t.copy_(x), dist.all_reduce(t, group=group))), t

    out["nccl"] = (nccl, True)

    def symm(backend, op):
        def setup(n):
            symm_mem.set_backend(backend)
            buf = symm_mem.empty(n_max, dtype=dtype, device=device)
            symm_mem.rendezvous(buf, group.group_name)
            t = buf[:n]
            name = group.group_name
            if op == "nccl":
                return (lambda x: (t.copy_(x), dist.all_reduce(t, group=group))), t
            if op == "one_shot":
                res = torch.empty(n, dtype=dtype, device=device)
                f = lambda x: (t.copy_(x), torch.ops.symm_mem.one_shot_all_reduce_out(t, "sum", name, res))
                return f, res
            fn = getattr(torch.ops.symm_mem, op)
            return (lambda x: (t.copy_(x), fn(t, "sum", name))), t
        return setup

    out["nccl-symm"] = (symm("NCCL", "nccl"), True)
    out["symm-1shot"] = (symm("CUDA", "one_shot"), True)
    out["symm-2shot"] = (symm("CUDA", "two_shot_all_reduce_"), True)
    out["symm-multimem"] = (symm("CUDA", "multimem_all_reduce_"), False)
    try:
        from flashinfer.comm import quantized_all_reduce

        def fi_fp8(n):
            res = torch.empty(n, dtype=dtype, device=device)
            return (lambda x: res.copy_(quantized_all_reduce(x, group=group))), res

        out["flashinfer-fp8"] = (fi_fp8, False)
    except Exception as e:  # noqa: BLE001 - any import failure means "not here"
        out["flashinfer-fp8"] = (e, False)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--min-bytes", default="16")
    p.add_argument("--max-bytes", default="64M")
    p.add_argument("--graph", action="store_true", help="time 20 captured calls replayed")
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    group = dist.group.WORLD
    dtype = torch.bfloat16
    sizes, b = [], size(args.min_bytes)
    while b <= size(args.max_bytes):
        sizes.append(b)
        b *= 4
    n_max = size(args.max_bytes) // 2
    cands = contenders(group, n_max, dtype, device)
    if rank == 0:
        print(f"# torch_peers: {world} ranks, bf16, torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}, "
              f"{torch.cuda.get_device_name(device)}; us per call, slowest rank{', graphs' if args.graph else ''}")
        print("# bytes " + " ".join(f"{k:>14}" for k in cands))
    said = set()
    for b in sizes:
        n = b // 2
        i = torch.arange(n, device=device, dtype=torch.float32)
        x = (((i * 7 + rank * 13) % 23) - 11).to(dtype)
        exact = sum((((i * 7 + r * 13) % 23) - 11) for r in range(world)).to(dtype)
        row = []
        for name, (setup, is_exact) in cands.items():
            try:
                if isinstance(setup, Exception):
                    raise setup
                fn, res = setup(n)
                fn(x)
                torch.cuda.synchronize()
                err = (res.float() - exact.float())
                ok = bool((err == 0).all()) if is_exact else float(
                    10 * torch.log10(exact.float().pow(2).sum() / err.pow(2).sum().clamp_min(1e-30))) > 20
                if not ok:
                    raise RuntimeError("wrong result")
                call = lambda: fn(x)
                if args.graph:
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        for _ in range(20):
                            fn(x)
                    call = g.replay
                for _ in range(5):
                    call()
                iters = max(20, min(500, (32 << 20) // b))
                best = float("inf")
                for _ in range(2):
                    dist.barrier(group=group)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        call()
                    torch.cuda.synchronize()
                    best = min(best, (time.perf_counter() - t0) / iters / (20 if args.graph else 1))
                t = torch.tensor([best], device=device)
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
                row.append(f"{t.item() * 1e6:14.2f}")
            except Exception as e:  # noqa: BLE001 - report and go on with the others
                if rank == 0 and name not in said:
                    said.add(name)
                    print(f"# {name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                row.append(f"{'-':>14}")
        if rank == 0:
            print(f"  {b:>10} " + " ".join(row), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

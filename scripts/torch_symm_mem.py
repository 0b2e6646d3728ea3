"""PyTorch's symmetric-memory all-reduce (one-shot and two-shot) as a second peer for the
multi-GPU measurement.

Run under torchrun, one process per GPU (scripts/multi-gpu.sh does):
    torchrun --standalone --nproc-per-node N scripts/torch_symm_mem.py
Prints one line per (size, algorithm): bytes, microseconds per call (CUDA-graph replay of 20
calls, median of 5), and algbw/busbw in GB/s, nccl-tests style. Sizes 8 B .. 64 MiB, bf16.
"""
import os

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem


def time_graph(fn, iters=20, reps=5):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / iters)
    times.sort()
    return times[len(times) // 2]


def main():
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl")
    group = dist.group.WORLD.group_name
    max_elems = 32 << 20
    buf = symm_mem.empty(max_elems, dtype=torch.bfloat16, device="cuda")
    symm_mem.rendezvous(buf, group)
    if rank == 0:
        print(f"# torch {torch.__version__} symmetric memory, {world} ranks, bf16")
        print("#      bytes  algorithm       us    algbw    busbw")
    size = 8
    while size <= 2 * max_elems:
        n = size // 2
        x = buf[:n]
        out = torch.empty_like(x)
        for name, fn in [
            ("one_shot", lambda: torch.ops.symm_mem.one_shot_all_reduce_out(x, "sum", group, out)),
            ("two_shot", lambda: torch.ops.symm_mem.two_shot_all_reduce_(x, "sum", group)),
            ("nccl", lambda: dist.all_reduce(x)),
        ]:
            try:
                us = time_graph(fn)
            except Exception as e:  # an algorithm may not take every size
                if rank == 0:
                    print(f"{size:>12}  {name:<10} failed: {type(e).__name__}: {e}")
                continue
            if rank == 0:
                algbw = size / us / 1e3
                print(f"{size:>12}  {name:<10} {us:>8.2f} {algbw:>8.2f} {algbw * 2 * (world - 1) / world:>8.2f}")
        size *= 4
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

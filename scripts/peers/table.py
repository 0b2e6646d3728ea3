#!/usr/bin/env python3
"""Markdown tables for docs/benchmarks.md from scripts/peers/versus.sh's logs.

    scripts/peers/table.py exact OUT/peers_exact.txt
    scripts/peers/table.py fused OUT/peers_fused.txt

exact: per ranks and size, ours (staged and registered) against vLLM (eager staged and
registered), eager and graphs, with ours registered / the faster vLLM. fused: per pattern, a
grid of ours (Auto) / the faster TensorRT-LLM kernel, eager and graph, per shape and ranks.
"""
import re
import sys


def runs(path):
    """(header line, rows) per bench run in the log."""
    out = []
    for line in open(path):
        if line.startswith("# allreduce-bench --peers"):
            out.append((line, []))
        elif out and re.match(r"^\s+\d", line):
            out[-1][1].append(line.split())
    return out


def exact(path):
    print("| ranks | bytes | ours | ours reg | vLLM | vLLM reg | ratio | ours graph | ours reg graph | vLLM graph | graph ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for head, rows in runs(path):
        ranks = re.search(r"--peers: (\d+) ranks", head).group(1)
        for f in rows:
            b = int(f[0])
            size = f"{b >> 20} Mi" if b >= 1 << 20 else f"{b >> 10} Ki" if b >= 1024 else str(b)
            # bytes ran | auto 1s 2s | vllm vllmreg | ratio | graph vllm ratio | oursreg ratio | greg ratio
            print(f"| {ranks} | {size} | {f[3]} | {f[16]} | {f[7]} | {f[8]} | {float(f[17]):.2f} | {f[12]} | {f[19]} | {f[13]} | {float(f[20]):.2f} |")


def fused(path):
    grids = {}
    for head, rows in runs(path):
        ranks = int(re.search(r"--fused: (\d+) ranks", head).group(1))
        pattern = re.search(r"bf16, (\w+);", head).group(1)
        for f in rows:
            # hidden tokens ran | auto 1s 2s | trt1 trt2 | ratio | graph trt1 trt2 ratio | wrong
            key = (int(f[0]), int(f[1]))
            grids.setdefault(pattern, {}).setdefault(key, {})[ranks] = (f[11], f[16], f[2])
    for pattern, grid in grids.items():
        print(f"\n{pattern}: ours (Auto) / the faster TensorRT-LLM kernel, eager / graph\n")
        ranks = sorted({r for v in grid.values() for r in v})
        print("| hidden | tokens | " + " | ".join(f"{r} ranks" for r in ranks) + " |")
        print("|---|---|" + "---|" * len(ranks))
        for (h, t), v in sorted(grid.items()):
            cells = [f"{float(v[r][0]):.2f} / {float(v[r][1]):.2f}" if r in v else "-" for r in ranks]
            print(f"| {h} | {t} | " + " | ".join(cells) + " |")
        ratios = [float(x) for v in grid.values() for r in v.values() for x in r[:2]]
        at_most = sum(x <= 1.0 for x in ratios)
        print(f"\n{at_most} of {len(ratios)} ratios at most 1.0; range {min(ratios):.2f}-{max(ratios):.2f}.")


if __name__ == "__main__":
    {"exact": exact, "fused": fused}[sys.argv[1]](sys.argv[2])

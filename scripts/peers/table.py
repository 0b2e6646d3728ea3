#!/usr/bin/env python3
"""Markdown tables for docs/benchmarks.md from scripts/peers/versus.sh's logs.

    scripts/peers/table.py exact OUT/peers_exact.txt
    scripts/peers/table.py sglang OUT/peers_exact.txt
    scripts/peers/table.py fused OUT/peers_fused.txt
    scripts/peers/table.py push OUT/peers_exact.txt

exact: per ranks and size, ours (staged and registered) against vLLM (eager staged and
registered), FlashInfer's PCIe all-reduce and SGLang's custom all-reduce v2 (its own choice),
eager and graphs, with ours registered / the best peer (logs from before a peer's column: "-"
in its columns, and the best of those there). sglang: per ranks and size, SGLang's choice and
each of its four kernels, eager and graphs, against ours registered. fused:
per pattern, a grid of ours (Auto) / the faster TensorRT-LLM kernel, eager and graph, per
shape and ranks. push: per ranks and size, the push one-shot beside ours staged (Auto), ours
registered, vLLM and FlashInfer, eager and graphs, with push / the best peer (logs of a bench
with the push columns only).
"""
import re
import sys


def runs(path):
    """(header line, column header line, rows) per bench run in the log."""
    out = []
    for line in open(path):
        if line.startswith("# allreduce-bench --peers"):
            out.append([line, "", []])
        elif out and line.startswith("# ") and "bytes" in line and "|" in line:
            out[-1][1] = line
        elif out and re.match(r"^\s+\d", line):
            out[-1][2].append(line.split())
    return out


def two(x):
    """A ratio with two decimals; "-" where the bench printed "-" (nothing to compare)."""
    return "-" if x == "-" else f"{float(x):.2f}"


def size(b):
    return f"{b >> 20} Mi" if b >= 1 << 20 else f"{b >> 10} Ki" if b >= 1024 else str(b)


# bytes ran | auto 1s 2s | vllm vllmreg pcie | ratio | graph vllm pcie ratio | oursreg ratio |
# greg ratio | [push ratio | gpush ratio |] sglang 1push 2push 1pull 2pull |
# graph sglang 1push 2push 1pull 2pull | wrong
SGLANG_EAGER, SGLANG_GRAPH = 24, 30


def has_push(columns):
    """Whether a run's column header has the push one-shot's columns (a word of its own:
    SGLang's kernels are "1push", "sgl-1push")."""
    return "push" in columns.split()


def sglang_at(columns):
    """Where SGLang's eager and graph columns start: after the push one-shot's six fields
    where the run has them."""
    shift = 6 if has_push(columns) else 0
    return SGLANG_EAGER + shift, SGLANG_GRAPH + shift


def exact(path):
    print("| ranks | bytes | ours | ours reg | vLLM | vLLM reg | FI PCIe | SGLang | ratio | ours graph | ours reg graph | vLLM graph | FI PCIe graph | SGLang graph | graph ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for head, columns, rows in runs(path):
        ranks = re.search(r"--peers: (\d+) ranks", head).group(1)
        pcie = "flashinfer pcie" in columns
        sgl = "sglang" in columns
        se, sgr = sglang_at(columns)
        for f in rows:
            b = int(f[0])
            if pcie:
                # bytes ran | auto 1s 2s | vllm vllmreg pcie | ratio | graph vllm pcie ratio | oursreg ratio | greg ratio
                auto, reg, vllm, vllm_reg, fi, r = f[3], f[18], f[7], f[8], f[9], f[19]
                graph, greg, gvllm, gfi, gr = f[13], f[21], f[14], f[15], f[22]
            else:
                # bytes ran | auto 1s 2s | vllm vllmreg | ratio | graph vllm ratio | oursreg ratio | greg ratio
                auto, reg, vllm, vllm_reg, fi, r = f[3], f[16], f[7], f[8], "-", f[17]
                graph, greg, gvllm, gfi, gr = f[12], f[19], f[13], "-", f[20]
            sg, gsg = (f[se], f[sgr]) if sgl else ("-", "-")
            print(f"| {ranks} | {size(b)} | {auto} | {reg} | {vllm} | {vllm_reg} | {fi} | {sg} | {two(r)} | {graph} | {greg} | {gvllm} | {gfi} | {gsg} | {two(gr)} |")


def sglang(path):
    """SGLang's choice (from the "# sglang at" lines) and its kernels, eager / graph, us."""
    print("| ranks | bytes | SGLang picks (eager / graph) | SGLang | 1shot_push | 2shot_push | 1shot_pull | 2shot_pull | ours reg | ours reg / SGLang |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    picks = {}
    ranks = None
    for line in open(path):
        m = re.match(r"# allreduce-bench --peers: (\d+) ranks", line)
        if m:
            ranks = m.group(1)
        m = re.match(r"# sglang at (\S+) B: eager (\S+)(?: \([^)]*\))?, graphs (\S+)", line)
        if m and ranks:
            picks.setdefault(ranks, []).append((m.group(1), m.group(2), m.group(3)))
    for head, columns, rows in runs(path):
        if "sglang" not in columns:
            continue
        ranks = re.search(r"--peers: (\d+) ranks", head).group(1)
        se, sgr = sglang_at(columns)
        for f in rows:
            b = int(f[0])
            pick = next((f"{e} / {g}" for r, e, g in picks.get(ranks, []) if covers(r, b)), "?")
            cells = [f"{f[se + i]} / {f[sgr + i]}" for i in range(5)]
            reg, greg = f[18], f[21]
            ratios = [x if "-" in (a, s) else f"{float(a) / float(s):.2f}"
                      for a, s, x in ((reg, f[se], "-"), (greg, f[sgr], "-"))]
            print(f"| {ranks} | {size(b)} | {pick} | " + " | ".join(cells) + f" | {reg} / {greg} | {ratios[0]} / {ratios[1]} |")


def covers(span, b):
    """Whether "16-64K" (the bench's sizes, K/M/G suffixes) holds b bytes."""
    def n(x):
        m = re.fullmatch(r"(\d+)([KMG]?)", x)
        return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2)]
    lo, _, hi = span.partition("-")
    return n(lo) <= b <= n(hi or lo)


def push(path):
    print("| ranks | bytes | push | ours | ours reg | vLLM | vLLM reg | FI PCIe | push ratio | push graph | ours graph | ours reg graph | vLLM graph | FI PCIe graph | push graph ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for head, columns, rows in runs(path):
        if not has_push(columns):
            continue
        ranks = re.search(r"--peers: (\d+) ranks", head).group(1)
        for f in rows:
            b = int(f[0])
            size = f"{b >> 20} Mi" if b >= 1 << 20 else f"{b >> 10} Ki" if b >= 1024 else str(b)
            # ... | oursreg ratio | greg ratio | push ratio | gpush ratio | #wrong
            auto, reg, vllm, vllm_reg, fi = f[3], f[18], f[7], f[8], f[9]
            graph, greg, gvllm, gfi = f[13], f[21], f[14], f[15]
            p, pr, gp, gpr = f[24], f[25], f[27], f[28]
            print(f"| {ranks} | {size} | {p} | {auto} | {reg} | {vllm} | {vllm_reg} | {fi} | {two(pr)} | {gp} | {graph} | {greg} | {gvllm} | {gfi} | {two(gpr)} |")


def fused(path):
    grids = {}
    for head, _, rows in runs(path):
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
    {"exact": exact, "sglang": sglang, "fused": fused, "push": push}[sys.argv[1]](sys.argv[2])

#!/usr/bin/env python3
"""Median table of `allreduce-bench --fused` runs, per configuration.

Reads logs in which each bench run follows a line `== rep=N R=RANKS cfg=NAME` (what
scripts/fused-sweep.sh writes) and prints, for every (ranks, cfg, hidden, tokens), the median
over repetitions of each column, as a markdown table. The ratio columns are recomputed from
the medians. A run that printed no rows (a failure) is reported and skipped.

    scripts/fused-table.py sweep.log [more.log ...] [--target 0.7]
"""
import argparse
import re
import statistics
import sys
from collections import defaultdict

HEAD = re.compile(r"^== rep=(\S+) R=(\d+) cfg=(\S+)")
# hidden tokens strategy | eager unfused ratio | graph unfused ratio | 1shot 2shot [| enq enq]
ROW = re.compile(r"^\s+(\d+)\s+(\d+)\s+(\S+)\s+\|(.*)$")
COLS = ["eager", "unfused", "graph", "graph_unfused", "1shot", "2shot", "enq", "enq_unfused"]


def parse(paths):
    runs = defaultdict(list)  # (ranks, cfg, hidden, tokens) -> [dict]
    strategy = {}
    empty = []
    for path in paths:
        cur, rows = None, 0
        for line in open(path, encoding="utf-8", errors="replace"):
            m = HEAD.match(line)
            if m:
                if cur and rows == 0:
                    empty.append(cur)
                cur, rows = (m.group(1), int(m.group(2)), m.group(3)), 0
                continue
            m = ROW.match(line)
            if not (m and cur):
                continue
            hidden, tokens, strat = int(m.group(1)), int(m.group(2)), m.group(3)
            nums = [float(x) for x in re.findall(r"-?[\d.]+|NaN|nan", m.group(4).replace("NaN", "nan"))]
            # eager unfused ratio graph unfused ratio 1shot 2shot [enq enq]
            vals = [nums[0], nums[1], nums[3], nums[4], nums[6], nums[7]] + nums[8:10]
            key = (cur[1], cur[2], hidden, tokens)
            runs[key].append(dict(zip(COLS, vals)))
            strategy[key] = strat
            rows += 1
        if cur and rows == 0:
            empty.append(cur)
    return runs, strategy, empty


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--target", type=float, default=0.7)
    a = ap.parse_args()
    runs, strategy, empty = parse(a.logs)
    for rep, r, cfg in empty:
        print(f"no rows: rep={rep} R={r} cfg={cfg}", file=sys.stderr)
    print("| ranks | cfg | hidden | tokens | Auto | reps | fused eager | unfused eager | ratio "
          "| fused graph | unfused graph | graph ratio | enqueue fused | enqueue unfused |")
    print("|" + "---|" * 14)
    met = defaultdict(lambda: [0, 0])
    for key in sorted(runs):
        r, cfg, hidden, tokens = key
        med = {c: statistics.median([x[c] for x in runs[key] if c in x] or [float("nan")]) for c in COLS}
        ratio = med["eager"] / med["unfused"]
        gratio = med["graph"] / med["graph_unfused"]
        bold = lambda v: f"**{v:.3f}**" if v <= a.target else f"{v:.3f}"
        if tokens in (1, 8, 32, 64, 128) and hidden in (4096, 8192):
            met[(r, cfg)][0] += ratio <= a.target
            met[(r, cfg)][1] += 1
        print(f"| {r} | {cfg} | {hidden} | {tokens} | {strategy[key]} | {len(runs[key])} "
              f"| {med['eager']:.2f} | {med['unfused']:.2f} | {bold(ratio)} "
              f"| {med['graph']:.2f} | {med['graph_unfused']:.2f} | {bold(gratio)} "
              f"| {med['enq']:.2f} | {med['enq_unfused']:.2f} |")
    print()
    for (r, cfg), (ok, n) in sorted(met.items()):
        print(f"{r} ranks, {cfg}: {ok} of {n} target rows (1/8/32/64/128 tokens x hidden 4096/8192) "
              f"at most {a.target} eager")


if __name__ == "__main__":
    main()

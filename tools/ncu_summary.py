#!/usr/bin/env python3
"""Summarises an Nsight Compute CSV (`ncu --csv --page details` with the
SpeedOfLight, Occupancy and LaunchStats sections) into a markdown table: one
row per kernel name, the largest summed duration first, with each kernel's
share of the profiled kernels' time, its compute and memory throughput (% of
the H100's peak), DRAM throughput, achieved occupancy, registers and launch
shape. Which limit a kernel is near tells where its time can go.

    ncu --csv --page details --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --launch-count 80 bin/step_bench ... > small.csv
    tools/ncu_summary.py small.csv --title "small, first step" > ncu_small.md
"""
import argparse
import csv
import io
import re
import sys
from collections import OrderedDict

DURATION_SCALE_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3,
                     "second": 1e6, "s": 1e6}
COLUMNS = {  # our column: ncu's metric name
    "sm_pct": "Compute (SM) Throughput",
    "mem_pct": "Memory Throughput",
    "dram_pct": "DRAM Throughput",
    "occupancy_pct": "Achieved Occupancy",
    "registers": "Registers Per Thread",
}


def number(text):
    return float(text.replace(",", "")) if text not in ("", "n/a") else float("nan")


def short_name(name, width):
    """The kernel's name without its template arguments and parameters."""
    name = re.sub(r"\(.*\)$", "", name)
    depth, out = 0, []
    for ch in name:  # drop <...> at any depth
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    name = "".join(out).replace("void ", "").strip()
    return name if len(name) <= width else name[: width - 1] + "…"


def read_launches(text):
    """One dict per profiled launch: name, grid, block, duration_us and COLUMNS."""
    start = text.find('"ID"')
    if start < 0:
        raise SystemExit("ncu_summary: no CSV header (\"ID\", ...) in the input; was ncu run with --csv --page details?")
    launches = OrderedDict()
    for row in csv.DictReader(io.StringIO(text[start:])):
        launch = launches.setdefault(row["ID"], {"name": row["Kernel Name"], "grid": row["Grid Size"],
                                                 "block": row["Block Size"]})
        metric, unit, value = row["Metric Name"], row["Metric Unit"], row["Metric Value"]
        if metric == "Duration" and unit in DURATION_SCALE_US:
            launch["duration_us"] = number(value) * DURATION_SCALE_US[unit]
        for key, wanted in COLUMNS.items():
            if metric == wanted:
                launch[key] = number(value)
    return [l for l in launches.values() if "duration_us" in l]


def summarise(launches, width):
    kernels = OrderedDict()
    for l in launches:
        k = kernels.setdefault(short_name(l["name"], width), {"calls": 0, "total_us": 0.0, "rows": []})
        k["calls"] += 1
        k["total_us"] += l["duration_us"]
        k["rows"].append(l)
    return sorted(kernels.items(), key=lambda item: -item[1]["total_us"])


def weighted(rows, key):
    """The duration-weighted mean of a metric over a kernel's launches."""
    pairs = [(r["duration_us"], r[key]) for r in rows if key in r and r[key] == r[key]]
    total = sum(d for d, _ in pairs)
    return sum(d * v for d, v in pairs) / total if total > 0 else float("nan")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", help="ncu --csv --page details output (text before the header is skipped)")
    parser.add_argument("--title", default="", help="a line above the table")
    parser.add_argument("--top", type=int, default=20, help="rows to print (the rest are summed in one line)")
    parser.add_argument("--name-width", type=int, default=60)
    args = parser.parse_args()
    with open(args.csv, encoding="utf-8", errors="replace") as f:
        launches = read_launches(f.read())
    if not launches:
        raise SystemExit(f"ncu_summary: {args.csv} holds no profiled launch with a Duration")
    kernels = summarise(launches, args.name_width)
    total = sum(k["total_us"] for _, k in kernels)
    out = sys.stdout
    if args.title:
        out.write(f"{args.title}\n\n")
    out.write(f"{len(launches)} launches of {len(kernels)} kernels, {total:.1f} us in all "
              "(SM, memory, DRAM: % of peak throughput; occupancy: achieved %; duration-weighted means)\n\n")
    out.write("| kernel | calls | total us | share | SM % | memory % | DRAM % | occupancy % | registers | grid × block |\n")
    out.write("|---|---|---|---|---|---|---|---|---|---|\n")
    for name, k in kernels[: args.top]:
        first = k["rows"][0]
        out.write(f"| `{name}` | {k['calls']} | {k['total_us']:.1f} | {100 * k['total_us'] / total:.1f}% | "
                  f"{weighted(k['rows'], 'sm_pct'):.1f} | {weighted(k['rows'], 'mem_pct'):.1f} | "
                  f"{weighted(k['rows'], 'dram_pct'):.1f} | {weighted(k['rows'], 'occupancy_pct'):.1f} | "
                  f"{first.get('registers', float('nan')):.0f} | {first['grid']} × {first['block']} |\n")
    rest = kernels[args.top:]
    if rest:
        rest_us = sum(k["total_us"] for _, k in rest)
        out.write(f"| ({len(rest)} more kernels) | {sum(k['calls'] for _, k in rest)} | {rest_us:.1f} | "
                  f"{100 * rest_us / total:.1f}% | | | | | | |\n")


if __name__ == "__main__":
    main()

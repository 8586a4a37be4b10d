#!/usr/bin/env python3
"""Compares the per-step losses of two trainer logs ("step N loss L" lines):
every step of the first must appear in the second with a loss within
--rtol relative. Prints the largest relative difference; exit 1 when a step
is missing or differs more.

    compare_losses.py one_gpu.log dp2.log --rtol 1e-4
"""
import argparse
import re
import sys


def losses(path):
    found = {}
    with open(path) as f:
        for line in f:
            m = re.match(r"step (\d+) loss (\S+)", line)
            if m:
                found[int(m.group(1))] = float(m.group(2))
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("reference")
    parser.add_argument("other")
    parser.add_argument("--rtol", type=float, default=1e-4)
    args = parser.parse_args()
    want, got = losses(args.reference), losses(args.other)
    if not want:
        print(f"compare_losses: no step lines in {args.reference}")
        return 1
    worst, missing = 0.0, [s for s in want if s not in got]
    for step, loss in want.items():
        if step in got:
            worst = max(worst, abs(got[step] - loss) / max(abs(loss), 1e-30))
    ok = not missing and worst <= args.rtol
    print(f"compare_losses: {len(want)} steps, largest relative difference {worst:.3g} (rtol {args.rtol:g})"
          f"{', missing steps ' + str(missing[:5]) if missing else ''}: {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

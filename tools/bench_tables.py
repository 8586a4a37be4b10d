#!/usr/bin/env python3
"""Prints the Markdown tables of benchmarks/README.md from the JSON in a
results folder (default benchmarks/results/), so a fresh run's numbers go into
the README without retyping:

    python3 tools/bench_tables.py [benchmarks/results]

Each table is headed by the file(s) it reads. A file that is missing is
reported and its table skipped. Standard library only.
"""
import json
import sys
from pathlib import Path


def load(folder, name):
    path = folder / name
    if not path.exists():
        print(f"\n({name}: missing, table skipped)")
        return None
    return json.loads(path.read_text())


def us(t):
    return f"{t['median_us']:.0f} µs ({t['min_us']:.0f}–{t['max_us']:.0f})"


def ms(t):
    return f"{t['median_us'] / 1e3:.2f} ms ({t['min_us'] / 1e3:.2f}–{t['max_us'] / 1e3:.2f})"


def gib(b):
    return f"{b / 2**30:.2f} GiB"


def table_head(comment, columns, rule):
    """A table's source comment (which JSON it comes from), header and rule."""
    print(comment)
    print(columns)
    print(rule)


def launch_overhead(folder):
    d = load(folder, "launch_overhead.json")
    if d is None:
        return
    table_head("\n<!-- launch_overhead.json -->", "| kernels × elements | eager median (min–max) | graph median (min–max) | eager / graph |", "|---|---|---|---|")
    print(f"| {d['kernels_per_round']} × {d['elements_per_kernel']} | {us(d['eager'])} | {us(d['graph'])} "
          f"| {d['eager_over_graph_median']:.2f}× |")


def gemm(folder):
    d = load(folder, "gemm_bench.json")
    if d is None:
        return
    best, ours = d["cublaslt_best"], d["ours"]
    table_head("\n<!-- gemm_bench.json -->", "| m × n × k | cuBLASLt best of its candidates | ours (`launch_gemm`) | ours / best |", "|---|---|---|---|")
    print(f"| {d['m']} × {d['n']} × {d['k']} | {us(best)}, {best['tflops_at_median']:.0f} TFLOP/s "
          f"| {us(ours)}, {ours['tflops_at_median']:.0f} TFLOP/s | {d['ours_over_best']:.3f} |")


def memory_bound(folder):
    d = load(folder, "memory_bound.json")
    if d is None:
        return
    table_head(f"\n<!-- memory_bound.json (copy {d['copy_gbps']:.0f} GB/s, {d['repeats']} repeats) -->", "| kernel | median µs (min–max) | GB/s | of copy | goal ≥ 80% |", "|---|---|---|---|---|")
    sweep = []
    for r in d["rows"]:
        if r["kernel"].startswith("copy"):
            continue
        if "_vecs" in r["kernel"]:  # tuning rows of the LayerNorm backward plan, not the default
            sweep.append(r["fraction_of_copy"])
            continue
        mark = "✓" if r["fraction_of_copy"] >= 0.8 else "✗"
        print(f"| `{r['kernel']}` | {r['median_us']:.1f} ({r['min_us']:.1f}–{r['max_us']:.1f}) "
              f"| {r['gbps']:.0f} | {100 * r['fraction_of_copy']:.1f}% | {mark} |")
    if sweep:
        print(f"\nLayerNorm backward tuning rows: {100 * min(sweep):.1f}-{100 * max(sweep):.1f}% of copy")


def pair_rows(folder, ours_name, peer_name, kind):
    """{(E T shape): {routing: (ours, torch, ratio)}} for one kind, and the ratios."""
    ours, peer = load(folder, ours_name), load(folder, peer_name)
    if ours is None or peer is None:
        return None, None
    theirs = {r["name"]: r for r in peer["rows"]}
    table, ratios = {}, []
    for r in ours["rows"]:
        if r["kind"] != kind or r["name"] not in theirs:
            continue
        t = theirs[r["name"]]
        ratios.append(r["tflops"] / t["tflops"])
        key = f"E={r['experts']} T={r['tokens']} {r['in_features']}->{r['out_features']}"
        table.setdefault(key, {})[r["routing"]] = f"{r['tflops']:.0f} / {t['tflops']:.0f} / **{ratios[-1]:.2f}**"
    return table, ratios


def summary(kind, names, ratios):
    return (f"{kind} ({names}): {min(ratios):.2f}-{max(ratios):.2f}x, "
            f"{sum(x >= 1.0 for x in ratios)} of {len(ratios)} rows >= 1.0x, {sum(x >= 0.9 for x in ratios)} >= 0.9x")


def grouped_kind(folder, ours_name, peer_name, kind, label, row_title):
    """One kind's rows from a pair of files (ours, torch), balanced and skewed routing side by side."""
    table, ratios = pair_rows(folder, ours_name, peer_name, kind)
    if table is None:
        return
    table_head("\n<!-- " + summary(label, f"{ours_name} against {peer_name}", ratios) + " -->",
               f"| {row_title} | balanced: ours / torch TFLOP/s / ratio | skewed |", "|---|---:|---:|")
    for key, c in table.items():
        print(f"| {key} | {c.get('balanced', '-')} | {c.get('skewed', '-')} |")


def grouped_forward(folder):
    grouped_kind(folder, "grouped_gemm.json", "grouped_gemm_peer.json", "forward", "forward", "forward row")


def grouped_backward(folder):
    """dgrad and wgrad side by side, from one pair of files (ours, torch)."""
    ours_name, peer_name = "grouped_gemm.json", "grouped_gemm_peer.json"
    tables, notes = {}, []
    for kind in ("dgrad", "wgrad"):
        table, ratios = pair_rows(folder, ours_name, peer_name, kind)
        if table is None:
            return
        tables[kind] = table
        notes.append(summary(kind, f"{ours_name} against {peer_name}", ratios))
    table_head("\n<!-- " + "; ".join(notes) + " -->", "| row | dgrad balanced: ours / torch / ratio | dgrad skewed | wgrad balanced | wgrad skewed |", "|---|---:|---:|---:|---:|")
    for key in tables["dgrad"]:
        d, w = tables["dgrad"][key], tables["wgrad"].get(key, {})
        print(f"| {key} | {d.get('balanced', '-')} | {d.get('skewed', '-')} | {w.get('balanced', '-')} "
              f"| {w.get('skewed', '-')} |")


def grouped_wgrad_bf16_dw(folder):
    """wgrad writing a bf16 dw on both sides (torch._grouped_mm writes nothing else)."""
    grouped_kind(folder, "grouped_gemm_wgrad_bf16_dw.json", "grouped_gemm_wgrad_bf16_dw_peer.json", "wgrad",
                 "wgrad, bf16 dw", "wgrad row, bf16 dw")


def moe_layer(folder):
    d = load(folder, "moe_layer.json")
    if d is None:
        return
    print(f"\n<!-- moe_layer.json ({d['repeats']} repeats) -->")
    print("| experts | graphed (device splits) | eager (device splits) | eager, host splits + per-expert cuBLASLt "
          "| graphed / host-split | y, dx difference |")
    print("|---|---|---|---|---|---|")
    for r in d["rows"]:
        print(f"| {r['experts']} | {ms(r['graphed'])} | {ms(r['eager_device_splits'])} | {ms(r['eager_host_splits'])} "
              f"| {r['speedup_graphed_over_eager_host_splits']:.2f}× "
              f"| {r['relative_difference_y']:g}, {r['relative_difference_dx']:g} |")


def step(folder):
    report = folder / "step_report.md"
    if report.exists():
        print("\n<!-- step_report.md goals (report.py) -->")
        for line in report.read_text().splitlines():
            if line.startswith(("- PASS", "- FAIL", "- NOT MEASURED")):
                print(line)
    ours, peer = load(folder, "step_bench.json"), load(folder, "pytorch_peer.json")
    if ours is None or peer is None:
        return
    theirs = {c["name"]: {s["system"]: s for s in c["systems"]} for c in peer["configs"]}
    print("\n<!-- step_bench.json and pytorch_peer.json (medians; full table: step_report.md) -->")
    print("| config | step ms: our eager / graphed | PyTorch eager / CUDA graph / compile | graphed vs PyTorch graph "
          "| MFU graphed | pool / bound | device memory graphed / eager | tensors graphed / PyTorch eager |")
    print("|---|---|---|---|---|---|---|---|")
    for c in ours["configs"]:
        s = {x["system"]: x for x in c["systems"]}
        t = theirs.get(c["name"], {})
        g, e = s.get("stepgraph_graph"), s.get("stepgraph_eager")
        if not g or not e or g.get("status") != "ok" or e.get("status") != "ok":
            print(f"| {c['name']} | {c.get('status')}: {c.get('reason')} | | | | | | |")
            continue
        step_ms = lambda x: f"{x['step_us']['median_us'] / 1e3:.3f}" if x and x.get("status") == "ok" else "-"
        pg = t.get("pytorch_cuda_graph")
        vs = f"{g['step_us']['median_us'] / pg['step_us']['median_us']:.2f}×" if pg and pg.get("status") == "ok" else "-"
        pe = t.get("pytorch_eager")
        pe_bytes = gib(pe["peak_bytes"]) if pe and pe.get("status") == "ok" else "-"
        print(f"| {c['name']} | {step_ms(e)} / {step_ms(g)} "
              f"| {step_ms(pe)} / {step_ms(pg)} / {step_ms(t.get('pytorch_compile'))} | {vs} "
              f"| {100 * g['mfu']:.1f}% | {g['pool_ratio']:.3f}× "
              f"| {gib(g['device_used_delta_bytes'])} / {gib(e['device_used_delta_bytes'])} "
              f"| {gib(g['peak_bytes'])} / {pe_bytes} |")
    for c in ours["configs"]:
        g = {x["system"]: x for x in c["systems"]}.get("stepgraph_graph")
        if g and g.get("status") == "ok" and c.get("experts") in (0, None):
            print(f"{c['name']}: persistent {g['persistent_bytes'] / c['matmul_params_per_token']:.1f} bytes "
                  f"per matmul parameter")


def main():
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results")
    summary = folder / "summary.txt"
    if summary.exists():
        print("<!-- summary.txt -->\n" + summary.read_text().strip())
    launch_overhead(folder)
    gemm(folder)
    memory_bound(folder)
    grouped_forward(folder)
    grouped_backward(folder)
    grouped_wgrad_bf16_dw(folder)
    moe_layer(folder)
    step(folder)


if __name__ == "__main__":
    main()

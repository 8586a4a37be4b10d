#!/usr/bin/env python3
"""Merges step_bench's and pytorch_peer.py's JSON into a markdown table, a
PNG plot, and the step goals.

    python3 benchmarks/report.py step_bench.json pytorch_peer.json \\
        --markdown step_report.md --png step_report.png
    python3 benchmarks/report.py step_bench_tp2_bulk.json tp_step_peer.json --markdown step_report_tp2_bulk.md
    python3 benchmarks/report.py step_bench_cp2.json cp_step_peer.json --markdown step_report_cp2.md
    python3 benchmarks/report.py step_bench_ep2.json ep_step_peer.json --markdown step_report_ep2.md

Tensor-parallel files (step_bench --tp N and tp_step_peer.py) make the TP
table: the speedup column is against our eager TP=N row, and the goals are
our graphed TP=N step <= 0.9x the fastest PyTorch TP row (DTensor eager,
compiled, async TP compiled, async TP compiled and captured whole), and its
exposed communication <= 10% of the step (step_bench --profile's
profile_exposed_comm_fraction).

Context-parallel files (step_bench --cp N and cp_step_peer.py) make the CP
table: the cp1 rows train sequences of L tokens on each GPU, the cpN rows
sequences of N L tokens over N GPUs; its column "ours / PyTorch" is, on each
PyTorch row where both ran, our row's median step time over the PyTorch
row's, our row being the one of the same job (CP_OURS: eager against our
eager, compiled or captured against our graphed step). The goal is ours: the
graphed cpN row's efficiency (its per-GPU model TFLOP/s over the graphed
cp1 row's, the same tokens per GPU; Note [Context-parallel rows] in
benchmarks/step_runner.h says why not the step time ratio, printed beside
it) >= 0.9.

Expert-parallel files (step_bench --ep N and ep_step_peer.py) make the EP
table: the ep1 rows train the whole config alone on each GPU, the epN rows
its experts spread over N GPUs, each GPU the config's tokens in both. The
goals: our graphed epN row's scaling efficiency (T_ep1 / T_epN, graphed;
Note [Expert-parallel rows] in benchmarks/expert_parallel_step_runner.h)
>= 0.9, and the fastest PyTorch epN row (ep_step_peer.py's eager or
compiled; PyTorch's expert-parallel step reads its split sizes on the host
and is not captured) >= 1.3x our graphed epN step time.

Prints the table, the first losses of every system (a sanity check that the
systems train the same model), each config's MFU (our graphed step and the
best PyTorch system), and one line per goal: PASS, FAIL or NOT MEASURED with
the numbers behind it. The step-time goals are judged against the best
PyTorch system of the same job per config (the fastest median of
pytorch_eager, pytorch_cuda_graph, pytorch_compile, pytorch_compile_graph
that ran): our graphed step <= 0.8x of it on small, <= 1.0x elsewhere. The plot needs matplotlib (Debian's
python3-matplotlib); without it the plot is skipped with a message.
Exit status 0 whatever the goals say; 2 on unreadable or mismatched input.
"""

import argparse
import json
import math
import sys

OUR_EAGER = "stepgraph_eager"
OUR_GRAPH = "stepgraph_graph"
TORCH_EAGER = "pytorch_eager"
TORCH_GRAPH = "pytorch_cuda_graph"
TORCH_COMPILE = "pytorch_compile"
TORCH_COMPILE_GRAPH = "pytorch_compile_graph"
SYSTEM_ORDER = [OUR_EAGER, OUR_GRAPH, TORCH_EAGER, TORCH_GRAPH, TORCH_COMPILE, TORCH_COMPILE_GRAPH]
TORCH_SYSTEMS = [TORCH_EAGER, TORCH_GRAPH, TORCH_COMPILE, TORCH_COMPILE_GRAPH]  # the candidates for "best PyTorch"
# Tensor-parallel configs (step_bench --tp N, tp_step_peer.py): rows in this order, then the rest by name.
TORCH_TP_SYSTEMS = ["pytorch_tp_eager", "pytorch_tp_compile", "pytorch_async_tp_compile",
                    "pytorch_async_tp_compile_graph"]  # the candidates for "fastest PyTorch TP row"
TP_SYSTEM_ORDER = ["stepgraph_eager_tp1", "stepgraph_graph_tp1", "pytorch_eager_tp1", "pytorch_cuda_graph_tp1",
                   "stepgraph_eager_tp{n}", "stepgraph_graph_tp{n}"] + TORCH_TP_SYSTEMS
TP_TIME_GOAL = 0.9  # our graphed TP=N step against the fastest PyTorch TP row
TP_EXPOSED_COMM_GOAL = 0.10  # of our graphed TP=N step
# Context-parallel configs (step_bench --cp N, cp_step_peer.py): rows in this order.
TORCH_CP_SYSTEMS = ["pytorch_cp_eager", "pytorch_cp_compile", "pytorch_cp_cuda_graph", "pytorch_cp_compile_graph"]
CP_SYSTEM_ORDER = ["stepgraph_eager_cp1", "stepgraph_graph_cp1", "pytorch_eager_cp1", "pytorch_cuda_graph_cp1",
                   "stepgraph_eager_cp{n}", "stepgraph_graph_cp{n}"] + TORCH_CP_SYSTEMS
# The CP table's "ours / PyTorch" column: each PyTorch row against our row of the same job.
CP_OURS = {
    "pytorch_eager_cp1": "stepgraph_eager_cp1",
    "pytorch_cuda_graph_cp1": "stepgraph_graph_cp1",
    "pytorch_cp_eager": "stepgraph_eager_cp{n}",
    "pytorch_cp_compile": "stepgraph_graph_cp{n}",
    "pytorch_cp_cuda_graph": "stepgraph_graph_cp{n}",
    "pytorch_cp_compile_graph": "stepgraph_graph_cp{n}",
}
CP_EFFICIENCY_GOAL = 0.9  # our graphed CP=N row: its per-GPU TFLOP/s over the graphed cp1 row's
# Expert-parallel configs (step_bench --ep N, ep_step_peer.py): rows in this order.
TORCH_EP_SYSTEMS = ["pytorch_eager_ep{n}", "pytorch_compile_ep{n}"]  # the candidates for "fastest PyTorch EP row"
EP_SYSTEM_ORDER = ["stepgraph_eager_ep1", "stepgraph_graph_ep1", "pytorch_eager_ep1", "pytorch_compile_ep1",
                   "stepgraph_eager_ep{n}", "stepgraph_graph_ep{n}"] + TORCH_EP_SYSTEMS
EP_EFFICIENCY_GOAL = 0.9  # our graphed EP=N row: T_ep1 / T_epN, the same tokens per GPU
EP_SPEEDUP_GOAL = 1.3  # the fastest PyTorch EP=N row's step time over our graphed EP=N step's
SHAPE_KEYS = ["hidden", "ffn", "layers", "vocab", "tokens", "heads", "kv_heads", "sequences", "seq_len", "experts",
              "topk", "moe_every", "tp", "flops_per_step"]


class ReportError(Exception):
    pass


def load(path, source):
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as error:
        raise ReportError(f"cannot read {path}: {error}")
    if data.get("benchmark") != "training_step" or data.get("source") != source:
        raise ReportError(f"{path} is not a training_step result from {source}")
    return data


def merge(stepgraph, pytorch=None):
    """Returns (configs, warnings): configs is a list of
    {"name", "header", "status", "reason", "systems": {system: result}}."""
    warnings = []
    merged = {}
    for data in [d for d in (stepgraph, pytorch) if d]:
        for c in data["configs"]:
            entry = merged.setdefault(c["name"], {"name": c["name"], "header": c, "notes": [], "systems": {}})
            for key in SHAPE_KEYS:
                ours, theirs = entry["header"].get(key), c.get(key)
                if ours is not None and theirs is not None and ours != theirs:
                    warnings.append(f"{c['name']}: {key} differs between the files ({ours} vs {theirs})")
            if c.get("status") != "ok":
                entry["notes"].append(f"{data['source']}: {c.get('status')}: {c.get('reason')}")
            for system, why in (c.get("unavailable") or {}).items():  # tp_step_peer: a capture PyTorch refused
                entry["notes"].append(f"{data['source']}: {system}: {why}")
            if c.get("tensor_parallel_rows"):
                entry["tp_world"] = c.get("world_size")
            if c.get("context_parallel_rows"):
                entry["cp_world"] = c.get("world_size")
            if c.get("expert_parallel_rows"):
                entry["ep_world"] = c.get("world_size")
            for s in c.get("systems", []):
                entry["systems"][s["system"]] = s
    return list(merged.values()), warnings


def ok(system):
    return system is not None and system.get("status") == "ok"


def median_us(system):
    return system["step_us"]["median_us"]


def fmt_bytes(n):
    if n is None:
        return "-"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def tp_world(config):
    """N of a tensor-parallel config (step_bench --tp N, tp_step_peer.py), else None."""
    return config.get("tp_world")


def cp_world(config):
    """N of a context-parallel config (step_bench --cp N), else None."""
    return config.get("cp_world")


def ep_world(config):
    """N of an expert-parallel config (step_bench --ep N, ep_step_peer.py), else None."""
    return config.get("ep_world")


def our_eager(config):
    """The row the speedup column divides by: our eager step (at TP=N, CP=N or EP=N in a parallel config)."""
    if tp_world(config) is not None:
        return f"{OUR_EAGER}_tp{tp_world(config)}"
    if cp_world(config) is not None:
        return f"{OUR_EAGER}_cp{cp_world(config)}"
    if ep_world(config) is not None:
        return f"{OUR_EAGER}_ep{ep_world(config)}"
    return OUR_EAGER


def system_order(config):
    if tp_world(config) is not None:
        return [s.format(n=tp_world(config)) for s in TP_SYSTEM_ORDER]
    if cp_world(config) is not None:
        return [s.format(n=cp_world(config)) for s in CP_SYSTEM_ORDER]
    if ep_world(config) is not None:
        return [s.format(n=ep_world(config)) for s in EP_SYSTEM_ORDER]
    return SYSTEM_ORDER


def ours_over_pytorch(config, name):
    """The CP table's "ours / PyTorch" cell of row `name`: our row of the same job's median step time over its,
    where both ran; else "-"."""
    ours_name = CP_OURS.get(name, "").format(n=cp_world(config))
    ours, theirs = config["systems"].get(ours_name), config["systems"].get(name)
    if not (ok(ours) and ok(theirs)):
        return "-"
    return f"{median_us(ours) / median_us(theirs):.2f}x ({ours_name})"


def table_rows(configs):
    """One row per (config, system) in a fixed system order, as lists of cells; a CP config's rows end with the
    "ours / PyTorch" cell."""
    rows = []
    for c in configs:
        systems = c["systems"]
        base = systems.get(our_eager(c))
        order = system_order(c)
        names = [s for s in order if s in systems] + sorted(set(systems) - set(order))
        ratio = (lambda name: [ours_over_pytorch(c, name)]) if cp_world(c) is not None else (lambda name: [])
        for note in c["notes"]:  # a whole file's config not run or failed
            source, _, text = note.partition(": ")
            rows.append([c["name"], source, text[:160]] + ["-"] * 7 + ratio(None))
        for name in names:
            s = systems[name]
            if not ok(s):
                rows.append([c["name"], name, f"{s.get('status')}: {str(s.get('reason'))[:120]}"] + ["-"] * 7
                            + ratio(None))
                continue
            t = s["step_us"]
            speedup = f"{median_us(base) / median_us(s):.2f}x" if ok(base) else "-"
            pool = f"{s['pool_ratio']:.3f}x" if "pool_ratio" in s else "-"
            rows.append(
                [
                    c["name"],
                    name,
                    f"{t['median_us'] / 1000:.3f} [{t['min_us'] / 1000:.3f}-{t['max_us'] / 1000:.3f}]",
                    f"{s['tokens_per_s']:,.0f}",
                    speedup,
                    f"{s['tflops']:.1f}",
                    f"{100 * s['mfu']:.1f}%",
                    f"{fmt_bytes(s.get('peak_bytes'))} / {fmt_bytes(s.get('device_used_delta_bytes'))}",
                    pool,
                    f"{s['pipelined_step_us'] / 1000:.3f}" if "pipelined_step_us" in s else "-",
                ]
                + ratio(name)
            )
    return rows


HEADER = [
    "config",
    "system",
    "step ms median [min-max]",
    "tokens/s",
    "speedup vs our eager",
    "TFLOP/s",
    "MFU",
    "peak memory (tensors / device delta)",
    "pool / lower bound",
    "pipelined step ms",
]


CP_HEADER = "ours / PyTorch"  # the CP table's last column (ours_over_pytorch)


def markdown_table(configs):
    header = HEADER + ([CP_HEADER] if any(cp_world(c) is not None for c in configs) else [])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row + ["-"] * (len(header) - len(row))) + " |" for row in table_rows(configs)]
    return "\n".join(lines) + "\n"


def first_losses(configs):
    lines = []
    for c in configs:
        for name, s in c["systems"].items():
            losses = s.get("first_losses")
            if losses is None and "loss_check" in c["header"]:
                losses = c["header"]["loss_check"].get(name)
            if ok(s) and losses:
                lines.append(f"{c['name']} {name}: " + " ".join(f"{v:.4f}" for v in losses))
        check = c["header"].get("loss_check")
        if check and "identical" in check:
            verdict = "identical" if check["identical"] else f"differ (max {check['max_abs_diff']:.3g})"
            lines.append(f"{c['name']}: our eager and graph losses over the first {check['steps']} steps: {verdict}")
    return lines


def best_pytorch(systems):
    """(name, row) of the fastest PyTorch system that ran (median step time), or (None, None)."""
    ran = [(name, systems[name]) for name in TORCH_SYSTEMS if ok(systems.get(name))]
    return min(ran, key=lambda item: median_us(item[1])) if ran else (None, None)


def mfu_lines(configs):
    """Per config: our graphed step's MFU and the best PyTorch system's (model FLOPs / 989 TFLOP/s)."""
    lines = []
    for c in configs:
        if tp_world(c) is not None or cp_world(c) is not None or ep_world(c) is not None:
            continue
        systems = c["systems"]
        graph = systems.get(OUR_GRAPH)
        parts = [f"{OUR_GRAPH} {100 * graph['mfu']:.1f}%" if ok(graph) else f"{OUR_GRAPH} -"]
        name, best = best_pytorch(systems)
        parts.append(f"best PyTorch {name} {100 * best['mfu']:.1f}%" if best else "best PyTorch -")
        flops = c["header"].get("flops_per_step")
        if flops:
            parts.append(f"{flops / 1e12:.3f} TFLOP per step")
        lines.append(f"{c['name']}: " + ", ".join(parts))
    return lines


def goals(configs):
    """The step goals: a list of (verdict, config, goal, detail); tp_goals where the configs are tensor-parallel."""
    if any(tp_world(c) is not None for c in configs):
        return tp_goals(configs)
    if any(cp_world(c) is not None for c in configs):
        return cp_goals(configs)
    if any(ep_world(c) is not None for c in configs):
        return ep_goals(configs)
    by_name = {c["name"]: c["systems"] for c in configs}
    out = []

    def add(verdict, config, goal, detail):
        out.append((verdict, config, goal, detail))

    def ratio_goal(config, text, num, den, bound, at_least):
        systems = by_name.get(config, {})
        a, b = systems.get(num), systems.get(den)
        if not (ok(a) and ok(b)):
            missing = [n for n, s in ((num, a), (den, b)) if not ok(s)]
            add("NOT MEASURED", config, text, f"{', '.join(missing)} missing or failed")
            return
        value = median_us(a) / median_us(b)
        holds = value >= bound if at_least else value <= bound
        add("PASS" if holds else "FAIL", config, text, f"{value:.2f}x")

    def best_goal(config, bound):
        """Our graphed step time against the best PyTorch system of the same job."""
        text = f"graphed step time <= {bound:.1f}x best PyTorch"
        systems = by_name.get(config, {})
        graph = systems.get(OUR_GRAPH)
        name, best = best_pytorch(systems)
        if not (ok(graph) and best):
            missing = ([] if ok(graph) else [OUR_GRAPH]) + ([] if best else ["every PyTorch system"])
            add("NOT MEASURED", config, text, f"{', '.join(missing)} missing or failed")
            return
        value = median_us(graph) / median_us(best)
        add("PASS" if value <= bound else "FAIL", config, text,
            f"{value:.2f}x {name} ({median_us(graph) / 1000:.3f} ms vs {median_us(best) / 1000:.3f} ms)")

    # Speedups are "their median / our graph median"; time ratios the inverse.
    ratio_goal("small", "graphed >= 2x our eager", OUR_EAGER, OUR_GRAPH, 2.0, True)
    ratio_goal("small", "graphed >= 3x PyTorch eager", TORCH_EAGER, OUR_GRAPH, 3.0, True)
    best_goal("small", 0.8)
    for config in [c["name"] for c in configs if c["name"] != "small"]:
        best_goal(config, 1.0)

    graph = by_name.get("large", {}).get(OUR_GRAPH)
    if ok(graph):
        add("PASS" if graph["mfu"] >= 0.60 else "FAIL", "large", "MFU >= 60%", f"{100 * graph['mfu']:.1f}%")
    else:
        add("NOT MEASURED", "large", "MFU >= 60%", "our graphed run missing or failed")

    for c in configs:
        systems = c["systems"]
        graph, eager = systems.get(OUR_GRAPH), systems.get(OUR_EAGER)
        if not ok(graph):
            why = "; ".join(c["notes"]) or "our graphed run missing or failed"
            add("NOT MEASURED", c["name"], "pool <= 1.10x lower bound", why)
            add("NOT MEASURED", c["name"], "graphed peak memory <= eager", why)
            continue
        ratio = graph["pool_ratio"]
        add("PASS" if ratio <= 1.10 else "FAIL", c["name"], "pool <= 1.10x lower bound", f"{ratio:.3f}x")
        if not ok(eager):
            add("NOT MEASURED", c["name"], "graphed peak memory <= eager", "our eager run missing or failed")
            continue
        tensors = (graph["peak_bytes"], eager["peak_bytes"])
        device = (graph.get("device_used_delta_bytes"), eager.get("device_used_delta_bytes"))
        # The device delta is the honest footprint (allocator rounding and
        # reserve, graph execs); the tensor bytes where there is none (host).
        judged = device if None not in device else tensors
        add(
            "PASS" if judged[0] <= judged[1] else "FAIL",
            c["name"],
            "graphed peak memory <= eager",
            f"device delta {fmt_bytes(device[0])} vs {fmt_bytes(device[1])}, tensors {fmt_bytes(tensors[0])} vs "
            f"{fmt_bytes(tensors[1])}" + ("" if judged is device else " (judged on tensors: no device delta)"),
        )
    return out


def tp_goals(configs):
    """Tensor-parallel configs: our graphed TP=N step against the fastest PyTorch TP row, and its exposed
    communication (the profiled step's)."""
    out = []
    for c in configs:
        n = tp_world(c)
        if n is None or n < 2:
            continue
        ours_name = f"{OUR_GRAPH}_tp{n}"
        ours = c["systems"].get(ours_name)
        theirs = [(median_us(c["systems"][name]), name) for name in TORCH_TP_SYSTEMS if ok(c["systems"].get(name))]
        goal = f"graphed TP={n} step time <= {TP_TIME_GOAL}x the fastest PyTorch TP row"
        if ok(ours) and theirs:
            best_us, best = min(theirs)
            value = median_us(ours) / best_us
            out.append(("PASS" if value <= TP_TIME_GOAL else "FAIL", c["name"], goal, f"{value:.2f}x {best}"))
        else:
            missing = [ours_name] if not ok(ours) else []
            missing += [] if theirs else [f"every PyTorch TP row ({', '.join(TORCH_TP_SYSTEMS)})"]
            why = [note for note in c["notes"] if any(f": {name}: " in note for name in TORCH_TP_SYSTEMS)]
            out.append(("NOT MEASURED", c["name"], goal,
                        "; ".join([f"{', '.join(missing)} missing or failed"] + why)))
        goal = f"graphed TP={n} exposed communication <= {TP_EXPOSED_COMM_GOAL:.0%} of the step"
        if ok(ours) and ours.get("profile_exposed_comm_fraction") is not None:
            share = ours["profile_exposed_comm_fraction"]
            out.append(("PASS" if share <= TP_EXPOSED_COMM_GOAL else "FAIL", c["name"], goal,
                        f"{share:.1%} ({ours['profile_exposed_comm_us'] / 1000:.3f} ms of the profiled step)"))
        else:
            out.append(("NOT MEASURED", c["name"], goal, f"{ours_name} has no profile: run step_bench --tp {n} "
                        "with --profile"))
    return out


def cp_goals(configs):
    """Context-parallel configs: the efficiency of our graphed CP=N row against CP=1 at the same tokens per GPU."""
    out = []
    for c in configs:
        n = cp_world(c)
        if n is None or n < 2:
            continue
        name = f"{OUR_GRAPH}_cp{n}"
        ours = c["systems"].get(name)
        goal = f"graphed CP={n} efficiency >= {CP_EFFICIENCY_GOAL} (CP=1 at 1/{n} of the sequence length)"
        if ok(ours) and ours.get("efficiency") is not None:
            value = ours["efficiency"]
            detail = f"{value:.3f}"
            if ours.get("step_time_ratio") is not None:
                detail += f" (step time ratio {ours['step_time_ratio']:.3f})"
            out.append(("PASS" if value >= CP_EFFICIENCY_GOAL else "FAIL", c["name"], goal, detail))
        else:
            out.append(("NOT MEASURED", c["name"], goal, f"{name} missing or failed"))
    return out


def ep_goals(configs):
    """Expert-parallel configs: our graphed EP=N row's efficiency against EP=1 at the same tokens per GPU, and its
    step time against the fastest PyTorch EP=N row's."""
    out = []
    for c in configs:
        n = ep_world(c)
        if n is None or n < 2:
            continue
        name = f"{OUR_GRAPH}_ep{n}"
        ours = c["systems"].get(name)
        goal = (f"graphed EP={n} efficiency >= {EP_EFFICIENCY_GOAL} (EP=1: the whole config alone, the same tokens "
                "per GPU)")
        if ok(ours) and ours.get("scaling_efficiency") is not None:
            value = ours["scaling_efficiency"]
            out.append(("PASS" if value >= EP_EFFICIENCY_GOAL else "FAIL", c["name"], goal,
                        f"{value:.3f} (exposed communication {ours['exposed_comm_us'] / 1000:.3f} ms)"))
        else:
            out.append(("NOT MEASURED", c["name"], goal, f"{name} missing, failed or without its ep1 row"))
        goal = f"graphed EP={n} step >= {EP_SPEEDUP_GOAL}x faster than the fastest PyTorch EP={n} row"
        torch_names = [s.format(n=n) for s in TORCH_EP_SYSTEMS]
        theirs = [(median_us(c["systems"][t]), t) for t in torch_names if ok(c["systems"].get(t))]
        if ok(ours) and theirs:
            best_us, best = min(theirs)
            value = best_us / median_us(ours)
            out.append(("PASS" if value >= EP_SPEEDUP_GOAL else "FAIL", c["name"], goal,
                        f"{value:.2f}x {best} ({median_us(ours) / 1000:.3f} ms vs {best_us / 1000:.3f} ms)"))
        else:
            missing = [] if ok(ours) else [name]
            missing += [] if theirs else [f"every PyTorch EP row ({', '.join(torch_names)})"]
            out.append(("NOT MEASURED", c["name"], goal, f"{', '.join(missing)} missing or failed"))
    return out


def plot(configs, path):
    """Grouped bars: step time (median, min-max whiskers) per config and system, log scale."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (Debian: python3-matplotlib)"
    names = [c["name"] for c in configs]
    order = list(dict.fromkeys(s for c in configs for s in system_order(c)))
    systems = [s for s in order if any(ok(c["systems"].get(s)) for c in configs)]
    if not systems:
        return "plot skipped: no system has results"
    width = 0.8 / len(systems)
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(names)), 4.5))
    for i, system in enumerate(systems):
        xs, ys, lo, hi = [], [], [], []
        for j, c in enumerate(configs):
            s = c["systems"].get(system)
            if ok(s):
                t = s["step_us"]
                xs.append(j + (i - (len(systems) - 1) / 2) * width)
                ys.append(t["median_us"] / 1000)
                lo.append((t["median_us"] - t["min_us"]) / 1000)
                hi.append((t["max_us"] - t["median_us"]) / 1000)
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=system)
    for j, c in enumerate(configs):
        if not any(ok(s) for s in c["systems"].values()):
            ax.annotate("not run", (j, 1), xycoords=("data", "axes fraction"), ha="center", va="top")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names)
    ax.set_yscale("log")
    ax.set_ylabel("step time, ms (median; whiskers min-max)")
    ax.set_title("Whole training step: StepGraph eager/graph vs PyTorch")
    ax.legend(fontsize=8)
    ax.grid(axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot written to {path}"


def main(argv=None):
    parser = argparse.ArgumentParser(description="Merge step_bench and pytorch_peer JSON into a table, plot and goals")
    parser.add_argument("stepgraph", help="step_bench --out JSON")
    parser.add_argument("pytorch", nargs="?", help="pytorch_peer.py --out JSON")
    parser.add_argument("--markdown", help="write the table (and goals) here")
    parser.add_argument("--png", "--plot", dest="png", help="write the plot here")
    args = parser.parse_args(argv)
    try:
        stepgraph = load(args.stepgraph, "stepgraph")
        pytorch = load(args.pytorch, "pytorch") if args.pytorch else None
        configs, warnings = merge(stepgraph, pytorch)
    except ReportError as error:
        print(f"report: {error}", file=sys.stderr)
        return 2
    if warnings:
        for w in warnings:
            print(f"report: {w}", file=sys.stderr)
        return 2
    table = markdown_table(configs)
    goal_lines = [f"- {verdict}: {config}: {goal}: {detail}" for verdict, config, goal, detail in goals(configs)]
    devices = f"StepGraph on {stepgraph.get('device')}" + (
        f"; PyTorch {pytorch.get('torch_version')} on {pytorch.get('device')}" if pytorch else ""
    )
    text = "\n".join(
        [devices, "", table, "First losses:", *[f"    {l}" for l in first_losses(configs)], "",
         "MFU (model FLOPs / 989 TFLOP/s; benchmarks/model_flops.h):", *[f"    {l}" for l in mfu_lines(configs)], "",
         "Goals:", *goal_lines]
    )
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    if args.png:
        print(plot(configs, args.png))
    return 0


if __name__ == "__main__":
    sys.exit(main())

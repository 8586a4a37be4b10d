"""Shared by the PyTorch peers: the single-GPU ones (attention_peer.py,
grouped_gemm_peer.py) and, below, the multi-rank training-step ones
(tp_step_peer.py, cp_step_peer.py, pp_step_peer.py, ep_step_peer.py).

Single-GPU timing: device events around single calls after a warm-up; the
median, min and max of --repeats, in microseconds. The JSON file a peer writes
has the keys of its C++ benchmark's: benchmark, impl, device, torch, repeats,
warmup, rows. The step peers' pieces need no torch (their tests run without
it). tools/gpu_bundle.sh ships this file with the peers (it copies
benchmarks/*.py).
"""
import itertools
import json
import statistics
import sys

try:
    import torch
except ImportError:  # the step peers' pieces below are tested where PyTorch is not installed
    torch = None


def time_call(fn, warmup, repeats):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    stop = torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeats):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        samples.append(1000.0 * start.elapsed_time(stop))
    return {"median_us": statistics.median(samples), "min_us": min(samples), "max_us": max(samples)}


def int_list(text):
    """A flag value "1,2,3" as [1, 2, 3]."""
    return [int(v) for v in text.split(",")]


def str_list(text):
    """A flag value "a,b" as ["a", "b"]."""
    return text.split(",")


def add_run_args(parser):
    """--repeats, --warmup and --out, the flags every peer takes."""
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", default="", help="JSON file to write (none: print the table only)")


def cuda_ready(peer, need="CUDA", available=True):
    """Whether CUDA (and `available`, what else `need` names) is there; says
    so on stderr either way (the device and torch version when it is)."""
    if not torch.cuda.is_available() or not available:
        print(f"{peer}: needs {need}", file=sys.stderr)
        return False
    print(f"device: {torch.cuda.get_device_name()} torch {torch.__version__}", file=sys.stderr)
    return True


def run_rows(axes, run_case, line):
    """run_case(*case) for every case of the product of `axes` (the last
    varies fastest); prints line(row) of each row as it comes and returns the
    rows. A run_case that returns None skips its case. Cached memory is freed
    between cases so that one row's tensors do not crowd the next."""
    rows = []
    for case in itertools.product(*axes):
        row = run_case(*case)
        if row is not None:
            print(line(row), flush=True)
            rows.append(row)
        torch.cuda.empty_cache()
    return rows


def write_result(benchmark, impl, args, rows):
    """Writes the rows to args.out (when given) as the C++ benchmark's JSON."""
    if not args.out:
        return
    result = {
        "benchmark": benchmark,
        "impl": impl,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")


# --- the multi-rank training-step peers (no torch) ---------------------------

def launch_fields(world, local_world, launcher, nccl_version, multicast_env):
    """The keys that open a step peer's parallel header: the launch, NCCL and the multicast variables."""
    return {"world_size": world, "local_world_size": local_world, "launcher": launcher,
            "nccl_version": nccl_version, "multicast_env": multicast_env}


def print_launch(result, world, local_world, launcher, nccl_version, what, note, file=sys.stdout):
    """The leader's first lines: the device, torch and NCCL, the launch and `what` runs; then `note` if any."""
    print(f"device: {result['device']}, torch {result['torch_version']}, NCCL {nccl_version}; {world} rank(s) "
          f"({local_world} per host) via {launcher}; {what}", file=file, flush=True)
    if note:
        print(f"NOTE: {note}", file=file, flush=True)


def run_configs(result, names, run_config, leader, save):
    """Appends run_config(name) of every config to result["configs"]; the leader calls save(result) after each
    (a later crash keeps the earlier configs)."""
    for name in names:
        result["configs"].append(run_config(name))
        if leader:
            save(result)


def per_gpu_row(row, world, combined, per_gpu=("tflops", "mfu")):
    """A row over `world` ranks: pytorch_peer.system_json's `row` of the combined ranks (`combined`, from
    pytorch_peer.combine_ranks) with world_size and rank_median_us, and its `per_gpu` fields divided by `world`."""
    row["world_size"] = world
    row["rank_median_us"] = combined["rank_median_us"]
    for key in per_gpu:
        row[key] /= world
    return row


def first_losses_check(rows, compared):
    """step_bench's loss_check over the rows that ran (`rows`: name -> row): every row's first losses and, with two
    or more `compared` rows, whether theirs are identical and their largest difference."""
    firsts = {n: rows[n]["first_losses"] for n in rows}
    check = {"steps": min((len(v) for v in firsts.values()), default=0), "compared": compared, **firsts}
    if len(compared) >= 2:
        a = firsts[compared[0]]
        check["identical"] = all(firsts[n] == a for n in compared[1:])
        check["max_abs_diff"] = max((abs(x - y) for n in compared[1:] for x, y in zip(a, firsts[n])), default=0.0)
    return check


def first_loss_agreement(first_losses, want, want_key, tolerance):
    """A row's first loss against a reference `want` (reported as `want_key`): {first_loss, <want_key>, abs_diff,
    agrees (within `tolerance`, relative to max(1, |want|))}."""
    got = first_losses[0] if first_losses else float("nan")
    diff = abs(got - want)
    return {"first_loss": got, want_key: want, "abs_diff": diff, "agrees": diff <= tolerance * max(1.0, abs(want))}


def disagreements(result, check_key, got_key, want_key):
    """config/row (got vs want) of every entry of the configs' `check_key` loss checks that does not agree."""
    return [f"{c['name']}/{row} ({d[got_key]:.5f} vs {d[want_key]:.5f})"
            for c in result["configs"] for row, d in c.get(check_key, {}).items() if not d["agrees"]]


def failed_rows(result, refused=lambda system: False):
    """config/row of every row not ok, but for a failed row that refused(system) says PyTorch refused to compile or
    capture: that is a result, said in the row."""
    return [f"{c['name']}/{s['system']}" for c in result["configs"] for s in c["systems"]
            if s["status"] != "ok" and not (s["status"] == "failed" and refused(s["system"]))]


def describe_not_ok(name, r, width, limit=300):
    """The line of a row that did not run ("<name> <system>: <status>: <reason>"), None for a row that did."""
    if r["status"] == "ok":
        return None
    return f"{name:{width}s} {r['system']}: {r['status']}: {str(r['reason'])[:limit]}"

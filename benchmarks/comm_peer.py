#!/usr/bin/env python3
"""PyTorch peer of comm_bench: the same collectives through torch.distributed (NCCL).

    python3 benchmarks/comm_peer.py --out comm_peer.json                      # one process: world size 1
    torchrun --nproc-per-node 8 benchmarks/comm_peer.py --out comm_peer.json

The rows, flags, formulas, timing and JSON schema are comm_bench's
(benchmarks/comm_bench.cc: Note [Bytes and bus bandwidth], Note [Timing]), so
the two files compare row by row; here "source" is "pytorch":
  all_reduce      dist.all_reduce(buf)                          in place, S = buf's bytes
  all_gather      dist.all_gather_into_tensor(out, inp)         S = out's bytes = n * inp's
  reduce_scatter  dist.reduce_scatter_tensor(out, inp)          S = inp's bytes = n * out's
  algbw = S / t; busbw = algbw * 2(n-1)/n (all_reduce), algbw * (n-1)/n (the others); GB/s = 1e9 B/s.
Eager: --iters calls from Python per sample. Graph: torch.cuda.graph
(capture_error_mode "thread_local", as StepGraph's StreamCapture) around
--graph-iters of the same calls, replayed iters / graph_iters times per
sample. CUDA events on the current stream around each sample; eager and graph
samples alternate; a row's sample is the mean over ranks; median, min, max
over --repeats samples after --warmup.

Launch: torchrun (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE: env://),
Slurm srun (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID) or Open MPI mpirun
(OMPI_COMM_WORLD_*), these two meeting at tcp://MASTER_ADDR:MASTER_PORT
(127.0.0.1:29500 if unset); none of them: one process, world size 1, through
a local file store. Each rank uses GPU LOCAL_RANK. At world size 1 NCCL's
collectives are local copies (the in-place all-reduce may move nothing):
busbw is 0 and the output says so.

NVLink multicast stays off: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1
and NVSHMEM_DISABLE_NVLS=1 are set in os.environ before torch is imported
(a different value is replaced, with a warning).
"""

import os
import sys

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def keep_multicast_off():
    for name, value in MULTICAST_OFF.items():
        had = os.environ.get(name)
        if had is not None and had != value:
            print(f"comm_peer: {name}={had} replaced by {value}: NVLink multicast stays off (DESIGN.md)",
                  file=sys.stderr)
        os.environ[name] = value
    return dict(MULTICAST_OFF)


MULTICAST_ENV = keep_multicast_off()  # before torch is imported, so before it can start NCCL

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import struct  # noqa: E402
import tempfile  # noqa: E402
import warnings  # noqa: E402

try:
    import torch
    import torch.distributed as dist
except ImportError:  # the build machines: flags can still be checked
    torch = None
    dist = None

OPS = ("all_gather", "reduce_scatter", "all_reduce")
COPIES_NOTE = (
    "world size 1: NCCL's collectives are local copies (the in-place all_reduce may move nothing): no link is "
    "crossed, busbw is 0 by its formula and algbw is a device-memory rate; launch one rank per GPU (torchrun, srun, "
    "mpirun) to measure the links")
FORMULAS = {
    "bytes": {
        "all_reduce": "count * E, in place",
        "all_gather": "n * per-rank input (the gathered output)",
        "reduce_scatter": "n * per-rank output (the input)",
    },
    "algbw": "bytes / time, GB/s = 1e9 B/s",
    "busbw": {
        "all_reduce": "algbw * 2(n-1)/n",
        "all_gather": "algbw * (n-1)/n",
        "reduce_scatter": "algbw * (n-1)/n",
    },
    "graph_over_eager": "graph median bandwidth / eager median bandwidth",
}


def parse_bytes(flag, text):
    """'64M', '1G', '4096', '512KiB': bytes, 1024-based suffixes (as comm_bench)."""
    match = re.fullmatch(r"(\d{1,12})([A-Za-z]*)", text)
    shifts = {"": 0, "b": 0, "k": 10, "kib": 10, "m": 20, "mib": 20, "g": 30, "gib": 30}
    if not match or match.group(2).lower() not in shifts:
        raise ValueError(f"{flag}: '{text}' is not a size: give bytes, or a number with K, M or G (1024-based), "
                         "e.g. 64M")
    value, shift = int(match.group(1)), shifts[match.group(2).lower()]
    if value <= 0:
        raise ValueError(f"{flag} must be positive, got '{text}'")
    if value << shift > 1 << 40:
        raise ValueError(f"{flag}: '{text}' is more than 1 TiB")
    return value << shift


def make_plan(args):
    """The ops and sizes, with comm_bench's checks and messages."""
    ops = args.ops.split(",") if args.ops else []
    if not ops:
        raise ValueError("--ops: name at least one of all_gather, reduce_scatter, all_reduce")
    for i, op in enumerate(ops):
        if op not in OPS:
            raise ValueError(f"--ops: the collectives are all_gather, reduce_scatter and all_reduce; got '{op}'")
        if op in ops[:i]:
            raise ValueError(f"--ops names {op} twice")
    if args.dtype not in ("bf16", "fp32"):
        raise ValueError(f"--dtype is bf16 or fp32, got '{args.dtype}'")
    if args.factor < 2:
        raise ValueError(f"--factor (between one size and the next) must be at least 2, got {args.factor}")
    if args.iters <= 0:
        raise ValueError(f"--iters (collectives per timed sample) must be positive, got {args.iters}")
    if args.graph_iters <= 0:
        raise ValueError(f"--graph-iters (collectives per graph) must be positive, got {args.graph_iters}")
    if args.iters % args.graph_iters:
        raise ValueError(f"--iters ({args.iters}) must be a multiple of --graph-iters ({args.graph_iters}): "
                         "a graph sample launches the graph iters / graph-iters times")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    if args.repeats <= 0:
        raise ValueError(f"--repeats (timed samples per mode) must be positive, got {args.repeats}")
    if args.timeout_s <= 0:
        raise ValueError(f"--timeout-s must be positive, got {args.timeout_s}")
    low, high = parse_bytes("--min-bytes", args.min_bytes), parse_bytes("--max-bytes", args.max_bytes)
    if high < low:
        raise ValueError(f"--max-bytes ({args.max_bytes}) is below --min-bytes ({args.min_bytes})")
    sizes = []
    size = low
    while size <= high:
        sizes.append(size)
        size *= args.factor
    return ops, sizes


def launch_info():
    """(rank, world_size, local_rank, local_world_size, launcher, init_method) from the launcher's variables."""
    env = os.environ

    def ints(*names):
        present = [n for n in names if n in env]
        if not present:
            return None
        missing = [n for n in names if n not in env]
        if missing:
            raise ValueError(f"launcher variables partly set: {', '.join(present)} set but {', '.join(missing)} not")
        try:
            return [int(env[n]) for n in names]
        except ValueError:
            raise ValueError("launcher variables must be integers: " +
                             ", ".join(f"{n}='{env[n]}'" for n in names)) from None

    meet = f"tcp://{env.get('MASTER_ADDR', '127.0.0.1')}:{env.get('MASTER_PORT', '29500')}"
    found = ints("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    if found:
        return (*found, "torchrun", "env://")
    found = ints("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
    if found:
        per_node = env.get("SLURM_NTASKS_PER_NODE", "")
        local_world = int(per_node) if per_node.isdigit() else found[1]
        return (*found, local_world, "slurm", meet)
    found = ints("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                 "OMPI_COMM_WORLD_LOCAL_SIZE")
    if found:
        return (*found, "mpirun", meet)
    return (0, 1, 0, 1, "none", None)


def make_row(op, requested, element, world):
    per_rank = requested // (element * world)
    if per_rank <= 0:
        raise ValueError(f"--min-bytes: {requested} bytes is less than one element per rank ({world} ranks)")
    elements = per_rank * world
    row = {"op": op, "bytes": elements * element, "elements": elements}
    if op == "all_reduce":
        row.update(count=elements, send_elements=elements, recv_elements=elements)
    elif op == "all_gather":
        row.update(count=per_rank, send_elements=per_rank, recv_elements=elements)
    else:
        row.update(count=per_rank, send_elements=elements, recv_elements=per_rank)
    return row


def fill_value(dtype):
    """The value of an element whose bytes are all 0x3F."""
    if dtype == "bf16":
        return struct.unpack("<f", b"\x00\x00\x3f\x3f")[0]
    return struct.unpack("<f", b"\x3f\x3f\x3f\x3f")[0]


def check_result(row, dtype, recv, world, collectives, mode):
    """'' when recv holds what `collectives` launches of the row's collective leave, else what differs."""
    v = fill_value(dtype)
    expected = v
    if row["op"] == "reduce_scatter":
        expected = v * world
    elif row["op"] == "all_reduce":
        expected = v * float(world) ** collectives
    unit = 2.0 ** -8 if dtype == "bf16" else 2.0 ** -20
    reductions = {"all_gather": 0, "reduce_scatter": 1, "all_reduce": collectives}[row["op"]]
    tolerance = reductions * world * unit * abs(expected)
    for index in (0, row["recv_elements"] - 1):
        got = float(recv[index].float().item())
        ok = (math.isinf(got) and got > 0) if expected > 3.4028234663852886e38 else abs(got - expected) <= tolerance
        if not ok:
            return (f"{row['op']} {row['bytes']} bytes ({mode}, {collectives} collective(s)): element {index} "
                    f"is {got}, expected {expected}")
    return ""


def summarize(samples):
    return {"median_us": statistics.median(samples), "min_us": min(samples), "max_us": max(samples)}


def mode_json(row, world, mean_us, rank_medians):
    time = summarize(mean_us)
    gb = row["bytes"] / 1e9
    factor = 2.0 * (world - 1) / world if row["op"] == "all_reduce" else (world - 1) / world

    def bandwidth(scale):
        return {"median": scale * gb / (time["median_us"] * 1e-6), "min": scale * gb / (time["max_us"] * 1e-6),
                "max": scale * gb / (time["min_us"] * 1e-6)}

    return {"time_us": time, "algbw_gbps": bandwidth(1.0), "busbw_gbps": bandwidth(factor),
            "rank_median_us": rank_medians}


def format_bytes(n):
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def print_header():
    print(f"{'op':<15}{'size':>9} | {'eager us (min-max)':>26}{'algbw':>11}{'busbw':>11} | "
          f"{'graph us (min-max)':>26}{'algbw':>11}{'busbw':>11} | {'graph/eager':>11}  check")


def print_row(row):
    def cell(mode):
        t = mode["time_us"]
        return f"{t['median_us']:.1f} ({t['min_us']:.1f}-{t['max_us']:.1f})"

    e, g = row["eager"], row["graph"]
    print(f"{row['op']:<15}{format_bytes(row['bytes']):>9} | {cell(e):>26}{e['algbw_gbps']['median']:>11.2f}"
          f"{e['busbw_gbps']['median']:>11.2f} | {cell(g):>26}{g['algbw_gbps']['median']:>11.2f}"
          f"{g['busbw_gbps']['median']:>11.2f} | {row['graph_over_eager']:>10.2f}x  {row['check']}", flush=True)


def run_row(row, args, world, send, recv, failures):
    dtype = args.dtype
    send_view = send[:row["send_elements"]]
    recv_view = recv[:row["recv_elements"]]
    op = row["op"]

    def issue():
        if op == "all_reduce":
            dist.all_reduce(recv_view)
        elif op == "all_gather":
            dist.all_gather_into_tensor(recv_view, send_view)
        else:
            dist.reduce_scatter_tensor(recv_view, send_view)

    def reset():
        if op == "all_reduce":
            recv_view.view(torch.uint8).fill_(0x3F)
        else:
            send_view.view(torch.uint8).fill_(0x3F)
            recv_view.zero_()

    checks = []
    reset()
    issue()
    torch.cuda.synchronize()
    checks.append(check_result(row, dtype, recv_view, world, 1, "eager"))

    graph = torch.cuda.CUDAGraph()
    with warnings.catch_warnings():
        if world == 1:  # one rank's in-place all_reduce is no work: torch warns that the graph is empty
            warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for _ in range(args.graph_iters):
                issue()
    torch.cuda.synchronize()
    reset()
    graph.replay()
    torch.cuda.synchronize()
    checks.append(check_result(row, dtype, recv_view, world, args.graph_iters, "graph"))

    def eager_sample():
        for _ in range(args.iters):
            issue()

    def graph_sample():
        for _ in range(args.iters // args.graph_iters):
            graph.replay()

    for _ in range(args.warmup):
        eager_sample()
        graph_sample()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    stop = torch.cuda.Event(enable_timing=True)
    samples = [[], []]
    for _ in range(args.repeats):
        for mode, sample in enumerate((eager_sample, graph_sample)):
            start.record()
            sample()
            stop.record()
            stop.synchronize()
            samples[mode].append(1000.0 * start.elapsed_time(stop) / args.iters)
    del graph

    mine = torch.tensor(samples[0] + samples[1], dtype=torch.float64, device="cuda")
    every = torch.empty(world * mine.numel(), dtype=torch.float64, device="cuda")
    dist.all_gather_into_tensor(every, mine)
    every = every.view(world, 2, args.repeats).cpu().tolist()
    all_checks = [None] * world
    dist.all_gather_object(all_checks, "; ".join(c for c in checks if c))

    check = "ok"
    for rank, text in enumerate(all_checks):
        if text:
            failure = f"rank {rank}: {text}"
            check = failure if check == "ok" else f"{check}; {failure}"
            failures.append(failure)
    result = {k: row[k] for k in ("op", "bytes", "elements", "count")}
    result.update(in_place=op == "all_reduce", dtype=dtype, check=check)
    medians = []
    for mode, name in enumerate(("eager", "graph")):
        mean = [sum(every[r][mode][i] for r in range(world)) / world for i in range(args.repeats)]
        result[name] = mode_json(row, world, mean, [statistics.median(every[r][mode]) for r in range(world)])
        medians.append(result[name]["time_us"]["median_us"])
    result["graph_over_eager"] = medians[0] / medians[1]
    return result


def nccl_version():
    version = torch.cuda.nccl.version()
    if isinstance(version, int):  # older torch: 22803
        version = (version // 10000, version // 100 % 100, version % 100)
    return ".".join(str(v) for v in version[:3])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-bytes", default="1M", help="smallest message: bytes, or with K, M, G (1024-based)")
    parser.add_argument("--max-bytes", default="1G", help="largest message (nccl-tests' size)")
    parser.add_argument("--factor", type=int, default=2, help="each size is the previous one times this")
    parser.add_argument("--ops", default=",".join(OPS), help="all_gather, reduce_scatter, all_reduce")
    parser.add_argument("--dtype", default="bf16", help="bf16 or fp32")
    parser.add_argument("--iters", type=int, default=20, help="collectives per timed sample")
    parser.add_argument("--graph-iters", type=int, default=20, help="collectives captured in one graph")
    parser.add_argument("--warmup", type=int, default=3, help="untimed samples per mode and row first")
    parser.add_argument("--repeats", type=int, default=10, help="timed samples per mode and row")
    parser.add_argument("--timeout-s", type=int, default=300, help="torch.distributed's timeout")
    parser.add_argument("--out", default="", help="write the results as JSON here (rank 0)")
    args = parser.parse_args()
    try:
        ops, sizes = make_plan(args)
        rank, world, local_rank, local_world, launcher, init_method = launch_info()
    except ValueError as error:
        parser.error(str(error))
    if torch is None or not torch.cuda.is_available():
        print("comm_peer: needs PyTorch with CUDA", file=sys.stderr)
        return 1
    if local_rank >= torch.cuda.device_count():
        print(f"comm_peer: local rank {local_rank} but this host has {torch.cuda.device_count()} GPU(s): start at "
              "most one rank per GPU", file=sys.stderr)
        return 1
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    store_dir = None
    if init_method is None:
        store_dir = tempfile.mkdtemp(prefix="comm_peer_")
        init_method = f"file://{store_dir}/store"
    dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world, device_id=device,
                            timeout=datetime.timedelta(seconds=args.timeout_s))
    try:
        dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
        element = 2 if args.dtype == "bf16" else 4
        plans = [make_row(op, size, element, world) for op in ops for size in sizes]
        largest = max(max(p["send_elements"], p["recv_elements"]) for p in plans)
        send = torch.empty(largest, dtype=dtype, device=device)
        recv = torch.empty(largest, dtype=dtype, device=device)
        version = nccl_version()
        leader = rank == 0
        if leader:
            how = (f"rank 0 of {world} ({local_world} per host) via {launcher}" if launcher != "none"
                   else "a single process (rank 0 of 1, no launcher)")
            print(f"comm_peer: torch {torch.__version__}, NCCL {version}, {how}; {torch.cuda.get_device_name()}")
            print(f"  {args.dtype}, {args.iters} collectives per sample, graphs of {args.graph_iters}, "
                  f"{args.warmup} warm-up + {args.repeats} timed samples per mode; sample times are means over ranks, "
                  f"medians (min-max) over samples; GB/s; {json.dumps(MULTICAST_ENV)}")
            if world == 1:
                print(f"  NOTE: {COPIES_NOTE}")
            print_header()
        rows, failures = [], []
        for plan in plans:
            row = run_row(plan, args, world, send, recv, failures)
            if leader:
                print_row(row)
            rows.append(row)
        if leader:
            result = {
                "benchmark": "comm",
                "source": "pytorch",
                "device": torch.cuda.get_device_name(),
                "torch_version": torch.__version__,
                "nccl_version": version,
                "world_size": world,
                "local_world_size": local_world,
                "launcher": launcher,
                "copies_only": world == 1,
                "note": COPIES_NOTE if world == 1 else "",
                "dtype": args.dtype,
                "iters": args.iters,
                "graph_iters": args.graph_iters,
                "warmup": args.warmup,
                "repeats": args.repeats,
                "multicast_env": MULTICAST_ENV,
                "capture": "torch.cuda.graph (capture_error_mode thread_local) around the torch.distributed calls",
                "timing": "CUDA events around iters collectives, per collective; mean over ranks; "
                          "median/min/max over repeats",
                "formulas": FORMULAS,
                "status": "failed" if failures else "ok",
                "rows": rows,
            }
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=2)
            if failures:
                print(f"comm_peer: {len(failures)} check(s) failed:")
                for failure in failures:
                    print(f"  {failure}")
        return 1 if failures else 0
    finally:
        dist.destroy_process_group()
        if store_dir is not None:
            shutil.rmtree(store_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

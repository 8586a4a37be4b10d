#!/usr/bin/env python3
"""cp_step_peer.py: the PyTorch peer of step_bench --cp N, the whole GPT
training step (forward, cross-entropy, backward, AdamW) context-parallel over
the N ranks of a launch with PyTorch's own context parallelism, one process
per GPU:

    torchrun --nproc-per-node 2 benchmarks/cp_step_peer.py --configs long --out cp_step_peer.json

The config is step_configs.cc's `long` (medium's shape: hidden 2048, 16
heads, 8 layers, ffn 8192, vocab 8192; one sequence of L = 16384 tokens).
Weak scaling in sequence length, as step_bench --cp (Note [Context-parallel
rows] in benchmarks/step_runner.h): the cp1 rows train the sequence of L on
each GPU alone, the CP rows one sequence of N L over the N GPUs, the same
tokens per GPU.

The model is tp_step_peer.GPT (nn.Modules: per block LayerNorm -> q, k, v
Linear -> rotary -> causal SDPA -> output Linear, + residual; LayerNorm ->
Linear -> GeLU(tanh) -> Linear, + residual; final LayerNorm; head Linear
without bias; fp32 masters cast to bf16 in the forward) holding
pytorch_peer.make_params' values; fused AdamW, pytorch_peer's lr and weight
decay. What runs for a CP row, on every rank:
  mesh        init_device_mesh("cuda", (N,)): the CP group is the world
  batch       the whole sequence's x [1, N L, hidden], labels [1, N L] and
              the rotary tables cos, sin [N L, head_dim] on every rank
              (pytorch_peer's draws: data seed 2, parameters seed 1)
  sharding    torch.distributed.tensor.experimental.context_parallel(mesh,
              buffers=[x, labels, cos, sin], buffer_seq_dims=[1, 1, 0, 0],
              no_restore_buffers=all four): its default head-tail load
              balancer (chunks r and 2N-1-r of 2N to rank r: the zig-zag
              shard of the sequence dimension, step_bench's layout) cuts the
              buffers in place, and inside the context every
              F.scaled_dot_product_attention(is_causal=True) is its ring
              attention over SDPA (q, k, v sharded on dim 2; KV shards rotated
              by all-gather in the forward, dKV by all-to-all in the backward;
              LSE merge in fp32). The context is entered once per row around
              the build, warm-up and timed steps (each step's forward +
              backward), so no step re-shards the batch (step_bench also loads
              its chunks once). The _attention options are PyTorch 2.11's
              defaults, none set here; the JSON records them (ring_options).
  gradients   the model under DistributedDataParallel over the CP group
              (gradient_as_bucket_view=True): each rank's loss is the mean
              over its N L / N tokens, so DDP's averaged gradients are the
              whole sequence's; the reported loss is the ranks' mean
Rows per config (step_bench's schema, the CP fields of its rows):
  pytorch_eager_cp1, pytorch_cuda_graph_cp1   the baseline: pytorch_peer's
                  eager and whole-step CUDA graph systems at L, every rank
                  training the sequence alone on its GPU, all ranks at once
                  (as step_bench's stepgraph_<mode>_cp1)
  pytorch_cp_eager              the CP step above, eager
  pytorch_cp_compile            as pytorch_cp_eager with each block under
                  torch.compile (Inductor; the ring attention traced inside)
  pytorch_cp_cuda_graph         pytorch_cp_eager's whole step captured with
                  torch.cuda.graph, PyTorch's recipe for DDP (pytorch_peer
                  --ddp's): built on a side stream, 11 eager steps there,
                  capture_error_mode "thread_local", capturable AdamW
  pytorch_cp_compile_graph      pytorch_cp_compile's step captured the same way
The CP rows at N > 1 only. A row PyTorch cannot build, compile or capture is
a row with status "failed" and the reason ("capture failed: ..." where the
capture was refused); such a failure of a compiled or captured CP row is a
result and leaves the exit status 0; any other row not ok makes it 1. Each CP
row's efficiency = its per-GPU TFLOP/s over its baseline_system's (eager and
compiled rows: pytorch_eager_cp1; captured rows: pytorch_cuda_graph_cp1),
and step_time_ratio = the baseline's median step / its own, as step_bench's
(Note [Context-parallel rows] in benchmarks/step_runner.h); tokens_per_s, tflops and mfu per GPU (the row's FLOPs: the N L
sequence's, / N). Loss checks: loss_check, the CP rows' first losses
against each other; cp_loss_check, each CP row's first loss against one GPU's
(pytorch_peer.forward_loss over the whole N L sequence on one GPU, no_grad,
the same parameters and batch; each rank computes it, rank 0's is reported)
within CP_LOSS_TOLERANCE relative, printed. Timing as tp_step_peer's (the ranks meet with dist.barrier before
each sample; a sample is the largest over the ranks; median, min, max over
--steps samples after --warmup steps). Rank 0 writes the JSON after every
config. NVLink multicast stays off: NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 are set
(comm_peer, on import) before torch is imported. The config table, flags and
row arithmetic need no torch (tests).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pytorch_peer as peer  # noqa: E402  (first: comm_peer sets the multicast variables before torch loads)
import peer_common  # noqa: E402
import tp_step_peer  # noqa: E402  (the GPT as nn.Modules)

import contextlib  # noqa: E402
import enum  # noqa: E402
import time  # noqa: E402

torch, dist, F = peer.torch, peer.dist, peer.F

# As benchmarks/step_configs.cc's make_long(): medium's shape, one sequence of 16k tokens.
CONFIGS = {"long": peer.gpt(hidden=2048, heads=16, layers=8, seq_len=16384, sequences=1)}
EAGER_BASE, GRAPH_BASE = "pytorch_eager_cp1", "pytorch_cuda_graph_cp1"
CP_EAGER, CP_COMPILE = "pytorch_cp_eager", "pytorch_cp_compile"
CP_GRAPH, CP_COMPILE_GRAPH = "pytorch_cp_cuda_graph", "pytorch_cp_compile_graph"
CP_ROWS = (CP_EAGER, CP_COMPILE, CP_GRAPH, CP_COMPILE_GRAPH)
# row: (pytorch_peer system of a cp1 row | None, compiled blocks, whole-step graph, baseline row); the captured
# rows last: a refused capture can leave NCCL or the stream in a state the next row should not inherit.
ROWS = {
    EAGER_BASE: ("eager", False, False, None),
    GRAPH_BASE: ("cuda_graph", False, True, None),
    CP_EAGER: (None, False, False, EAGER_BASE),
    CP_COMPILE: (None, True, False, EAGER_BASE),
    CP_GRAPH: (None, False, True, GRAPH_BASE),
    CP_COMPILE_GRAPH: (None, True, True, GRAPH_BASE),
}
CP_LOSS_TOLERANCE = tp_step_peer.TP_LOSS_TOLERANCE  # relative: bf16 partial sums in another order
ONE_GPU = "pytorch_peer.forward_loss over the whole N L sequence on one GPU (no_grad), the parameters and batch " \
          "every CP row starts from"


def check_config(name, world):
    """None when `name` can be context-parallel over `world` ranks, else why not."""
    if name not in CONFIGS:
        return f"config '{name}' has no context-parallel PyTorch peer (configs: {', '.join(CONFIGS)})"
    length = world * CONFIGS[name]["seq_len"]
    if length % (2 * world):
        return (f"config '{name}': its sequence of {length} tokens at {world} ranks does not cut into 2 x {world} "
                "head-tail chunks")
    return None


def wide_config(c, world):
    """The CP rows' config: sequences `world` times as long (step_runner's context_parallel_config)."""
    return dict(c, seq_len=world * c["seq_len"], tokens=world * c["tokens"])


def config_header(name):
    """step_bench's config_header_json of a config here (pytorch_peer.config_header's fields: CONFIGS here are
    not pytorch_peer's)."""
    c = CONFIGS[name]
    return {
        "name": name,
        "hidden": c["hidden"],
        "ffn": c["ffn"],
        "layers": c["layers"],
        "vocab": peer.VOCAB,
        "tokens": c["tokens"],
        "heads": c["heads"],
        "kv_heads": c["heads"],
        "head_dim": peer.head_dim(c),
        "sequences": c["sequences"],
        "seq_len": c["seq_len"],
        "experts": c["experts"],
        "topk": None,
        "moe_every": None,
        "dtype": "bf16",
        "matmul_params_per_token": peer.matmul_params_per_token(c),
        "attention_core_flops_per_step": peer.attention_core_flops(c),
        "flops_per_step": peer.step_flops(c),
    }


def cp_row(name, c, world, combined, baseline=None, baseline_name=None):
    """A row in step_bench's context-parallel fields (step_runner.cc's cp_system_json): pytorch_peer's row of the
    row's own config `c` from the combined ranks, per GPU, and against a baseline the efficiency."""
    row = peer_common.per_gpu_row(peer.system_json(name, c, combined), world, combined,
                                  ("tflops", "mfu", "tokens_per_s"))
    row.update(cp=world, seq_len=c["seq_len"], sequences=c["sequences"], tokens=c["tokens"], baseline_system=None,
               efficiency=None, step_time_ratio=None)
    if baseline is not None:  # Note [Context-parallel rows] in benchmarks/step_runner.h
        row.update(baseline_system=baseline_name, efficiency=row["tflops"] / baseline["tflops"],
                   step_time_ratio=baseline["step_us"]["median_us"] / row["step_us"]["median_us"])
    return row


def loss_checks(rows, one_gpu):
    """(loss_check, cp_loss_check): the CP rows' first losses against each other (as step_bench compares its eager
    and graph rows), and each CP row's first loss against `one_gpu` (ONE_GPU's loss; None: not computed)."""
    cp_rows = [n for n in CP_ROWS if n in rows]
    cp_check = {}
    if one_gpu is not None:
        for n in cp_rows:
            cp_check[n] = peer_common.first_loss_agreement(rows[n]["first_losses"], one_gpu, "one_gpu_first_loss",
                                                           CP_LOSS_TOLERANCE)
    return peer_common.first_losses_check(rows, cp_rows), cp_check


def describe(name, r):
    if r["status"] != "ok":
        return peer_common.describe_not_ok(name, r, 5)
    s = r["step_us"]
    line = (f"{name:5s} {r['system']:26s} {s['median_us'] / 1000:.3f} ms [{s['min_us'] / 1000:.3f}-"
            f"{s['max_us'] / 1000:.3f}] {r['tokens_per_s']:.0f} tok/s/GPU (seq_len {r['seq_len']}")
    if r["efficiency"] is not None:
        line += (f", efficiency {r['efficiency']:.3f} (step time ratio {r['step_time_ratio']:.3f}) vs "
                 f"{r['baseline_system']}")
    return line + f"), per-GPU MFU {100 * r['mfu']:.1f}%, peak {r['peak_bytes'] / 2**20:.0f} MiB"


def describe_loss(name, row, d):
    verdict = "agrees" if d["agrees"] else "DIFFERS"
    return (f"{name:5s} {row}: first loss {d['first_loss']:.5f} vs one GPU's {d['one_gpu_first_loss']:.5f} "
            f"(|diff| {d['abs_diff']:.2e}): {verdict}")


def failures(result):
    """config/row of every config not run and every row not ok, but for a compiled or captured CP row that
    failed: PyTorch refusing to compile or capture its ring is a result, said in the row."""
    def refused(system):
        _, compiled, graph, _ = ROWS[system]
        return system in CP_ROWS and (compiled or graph)

    return ([f"{c['name']}: {c['reason']}" for c in result["configs"] if c["status"] == "not_run"]
            + peer_common.failed_rows(result, refused))


# --- the context-parallel step (torch needed from here on) ----------------

class CaptureFailed(Exception):
    """torch.cuda.graph refused the CP step."""


class CPBatch:
    """The whole sequence of a wide config on every rank, as context_parallel's buffers: x [S, N L, hidden] bf16,
    labels [S, N L] and the rotary tables cos, sin [N L, head_dim] fp32 (pytorch_peer.Setup's draws for the same
    config: data seed 2). Each a tensor of its own (context_parallel resizes them in place)."""

    SEQ_DIMS = [1, 1, 0, 0]

    def __init__(self, wide):
        g = torch.Generator(device="cuda")
        g.manual_seed(2)
        s, length = wide["sequences"], wide["seq_len"]
        x = peer.uniform((wide["tokens"], wide["hidden"]), 1.0, g).to(torch.bfloat16)
        labels = torch.randint(0, peer.VOCAB, (wide["tokens"],), generator=g, device="cuda")
        self.x, self.labels = x.view(s, length, -1).clone(), labels.view(s, length).clone()
        del x, labels
        self.cos, self.sin = (t.clone() for t in peer.rope_tables(wide))
        self.hidden = wide["hidden"]

    def buffers(self):
        return [self.x, self.labels, self.cos, self.sin]

    def rows(self):
        """x [T, hidden] and labels [T] as the model reads them (the rank's share inside context_parallel)."""
        return self.x.view(-1, self.hidden), self.labels.view(-1)


def one_gpu_first_loss(wide):
    """ONE_GPU's loss: the first step's loss of the wide config trained on one GPU."""
    blocks, top, everything = peer.make_params(wide, seed=1)
    batch = CPBatch(wide)
    x, labels = batch.rows()
    with torch.no_grad():
        loss = peer.forward_loss(wide, blocks, top, x, labels, (batch.cos, batch.sin)).item()
    del blocks, top, everything, batch, x, labels
    peer.fresh_memory()
    return loss


def ring_options():
    """The context-parallel attention's options in effect (PyTorch's _ContextParallelOptions), for the JSON."""
    try:
        try:
            from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options
        except ImportError:
            from torch.distributed.tensor.experimental._attention import _cp_options
        return {k: v.name if isinstance(v, enum.Enum) else v for k, v in vars(_cp_options).items()}
    except Exception as error:  # a private name: its absence must not stop the benchmark
        return {"unavailable": f"{type(error).__name__}: {error}"}


if torch is not None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    class CPSetup:
        """One rank's GPT (tp_step_peer.GPT, pytorch_peer.make_params' values) under DDP over the CP group, reading
        the rank's share of `batch`, and fused AdamW; train_step() as pytorch_peer.Setup's. Built and run inside
        context_parallel over batch.buffers(): the model's sequence is the rank's N L / N tokens (= the
        baseline's L) and its rotary tables are the rank's positions."""

        def __init__(self, c, batch, device, compiled, capturable):
            self.model = tp_step_peer.GPT(c, (batch.cos, batch.sin))
            blocks, top, everything = peer.make_params(c, seed=1)
            self.model.load(blocks, top)
            del blocks, top, everything
            if compiled:
                for block in self.model.blocks:
                    block.compile()  # per block, as torchtitan: the ring attention's collectives inside
            self.ddp = torch.nn.parallel.DistributedDataParallel(self.model, device_ids=[device.index],
                                                                 gradient_as_bucket_view=True)
            self.x, self.labels = batch.rows()
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=peer.LR, weight_decay=peer.WEIGHT_DECAY,
                                               fused=True, capturable=capturable)

        def train_step(self):
            """One step; returns this rank's loss tensor (no host read): the mean over its tokens."""
            loss = F.cross_entropy(self.ddp(self.x).float(), self.labels)
            loss.backward()
            self.optimizer.step()
            return loss


def build_cp_system(row, c, batch, group, device):
    """pytorch_peer.build_system's tuple for a CP row (ROWS), inside context_parallel; the losses are the ranks'
    means."""
    _, compiled, graph, _ = ROWS[row]
    start = time.perf_counter()
    if not graph:
        s = CPSetup(c, batch, device, compiled, capturable=False)

        def run_one():
            s.optimizer.zero_grad(set_to_none=True)
            return s.train_step()

        if not compiled:
            return run_one, {}, [], s
        compile_start = time.perf_counter()  # the compilation before the timed warm-up
        losses = [group.global_mean(run_one()) for _ in range(2)]
        return run_one, {"compile_ms": 1000 * (time.perf_counter() - compile_start)}, losses, s
    # PyTorch's recipe for DDP under a whole-step graph (pytorch_peer.build_ddp_system): built on a side stream,
    # DDP_GRAPH_WARMUP eager (compiling) steps there, the capture on that stream.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    losses = []
    warmup_start = time.perf_counter()
    with torch.cuda.stream(side):
        s = CPSetup(c, batch, device, compiled, capturable=True)
        for _ in range(peer.DDP_GRAPH_WARMUP):
            s.optimizer.zero_grad(set_to_none=True)
            losses.append(s.train_step())
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    losses = [group.global_mean(loss) for loss in losses[:peer.LOSS_CHECK_STEPS]]
    warmup_ms = 1000 * (time.perf_counter() - warmup_start)
    s.optimizer.zero_grad(set_to_none=True)  # the capture's backward allocates the grads from its pool
    try:
        run_one, extra, graph = peer.capture_whole_step(s, start, stream=side, capture_error_mode="thread_local")
    except Exception as error:
        raise CaptureFailed(f"capture failed: {type(error).__name__}: {error}") from error
    extra["warmup_ms"] = warmup_ms
    return run_one, extra, losses, (s, graph)


def run_cp_row(row, c, steps, warmup, group, device, mesh):
    """A CP row on every rank: (combined, None) or (None, why), as pytorch_peer.run_everywhere. The wide config's
    batch is cut by context_parallel, whose context holds the build, warm-up and timed steps."""
    wide = wide_config(c, group.world)
    with contextlib.ExitStack() as stack:
        error = None
        try:
            batch = CPBatch(wide)
            buffers = batch.buffers()
            stack.enter_context(context_parallel(mesh, buffers=buffers, buffer_seq_dims=CPBatch.SEQ_DIMS,
                                                 no_restore_buffers=set(buffers)))
        except Exception as e:  # PyTorch refusing the buffers: the row's reason, on every rank alike
            error = f"context_parallel: {type(e).__name__}: {e}"[:2000]
        errors = group.gather(error)
        if any(errors):
            return None, "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
        # run_everywhere turns a build's exception into (None, why) and a timing failure ends the process, so
        # nothing leaves this context by an exception that a later row survives (context_parallel restores SDPA
        # only on a normal exit).
        return peer.run_everywhere(lambda: build_cp_system(row, c, batch, group, device), wide, steps, warmup, group,
                                   loss_of=group.global_mean)


def run_cp_config(name, rows, steps, warmup, deadline, group, device=None, mesh=None):
    """One config's rows on every rank; the config's JSON (the same on every rank)."""
    c = CONFIGS[name]
    n = group.world
    wide = wide_config(c, n)
    out = config_header(name)
    out.update(status="ok", reason=None, world_size=n, cp=n, cp_seq_len=wide["seq_len"], context_parallel_rows=True,
               systems=[])
    why = check_config(name, n)
    if why is not None:
        out.update(status="not_run", reason=why)
        return out
    made = {}  # the rows that ran, by name
    one_gpu, one_gpu_error = None, None
    for row_name in rows:
        system, compiled, graph, baseline_name = ROWS[row_name]
        if system is None and n == 1:
            continue  # the CP rows need N > 1 ranks
        if not group.agree(time.perf_counter() <= deadline):  # rank 0's clock decides for all
            row = {"system": row_name, "status": "not_run", "reason": "the --budget-s time was spent"}
        else:
            if system is not None:
                result, why = peer.run_everywhere(lambda: peer.build_system(system, c, data_seed=2), c, steps, warmup,
                                                  group, world_one=n == 1)
            else:
                if one_gpu is None and one_gpu_error is None:  # before the first CP row: SDPA is not patched yet
                    try:
                        one_gpu = one_gpu_first_loss(wide)
                    except Exception as error:  # no check, the rows still run
                        one_gpu_error = f"{type(error).__name__}: {error}"[:2000]
                result, why = run_cp_row(row_name, c, steps, warmup, group, device, mesh)
            if compiled and torch is not None:
                peer.reset_compiled_state()  # the next row compiles afresh
            if result is None:
                row = {"system": row_name, "status": "failed", "reason": why}
            else:
                base = made.get(baseline_name)
                row = cp_row(row_name, wide if system is None else c, 1 if system else n, result, base,
                             baseline_name if base else None)
                made[row_name] = row
                if baseline_name and base is None:
                    row["reason"] = f"no efficiency: {baseline_name} did not run"
        out["systems"].append(row)
        if group.rank == 0:
            print(describe(name, row), flush=True)
    out["loss_check"], out["cp_loss_check"] = loss_checks(made, one_gpu)
    if one_gpu_error is not None:
        out["cp_loss_check_error"] = f"the one-GPU loss failed: {one_gpu_error}"
    if group.rank == 0:
        for row_name, d in out["cp_loss_check"].items():
            print(describe_loss(name, row_name, d), flush=True)
        if one_gpu_error is not None:
            print(f"{name:5s} {out['cp_loss_check_error'][:300]}", flush=True)
    if not made:
        out["status"], out["reason"] = "failed", "no row ran"
    return out


def main(argv=None):
    args = tp_step_peer.parse_run_flags(argv, "cp_step_peer", __doc__.split("\n")[0], "long", CONFIGS, ROWS)
    for name in args.configs.split(","):
        if name not in CONFIGS:
            raise SystemExit(f"cp_step_peer: {check_config(name, 1)}")
    configs = peer.parse_list(args.configs, list(CONFIGS), "config")
    rows = peer.parse_list(args.systems or ",".join(ROWS), list(ROWS), "system")
    rows = [r for r in ROWS if r in rows]  # baselines before the rows measured against them
    tp_step_peer.check_launch("cp_step_peer")
    group, local_rank, local_world, launcher, device, store_dir = peer.start_process_group(args.timeout_s,
                                                                                         "cp_step_peer")
    try:
        world, leader = group.world, group.rank == 0
        mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("cp",)) if world > 1 else None
        note = "world size 1: the cp1 rows alone; nothing is context-parallel" if world == 1 else ""
        flops_text = peer.FLOPS_TEXT + "; of the row's own config (cpN: the N L sequence); tflops and mfu per GPU"
        result = peer.result_header(args, device, flops_text, "row", " (largest over the ranks)")
        result.update({
            "context_parallel": {
                **peer_common.launch_fields(world, local_world, launcher, peer.comm_nccl_version(),
                                            peer.MULTICAST_ENV),
                "attention": "torch.distributed.tensor.experimental.context_parallel(mesh, buffers=[x, labels, cos, "
                "sin], buffer_seq_dims=[1, 1, 0, 0], no_restore_buffers=all): ring attention over SDPA "
                "(is_causal=True), its default head-tail load balancer, entered once per row",
                "ring_options": ring_options(),
                "gradients": "DistributedDataParallel over the CP group (gradient_as_bucket_view=True)",
                "compile": "each block under torch.compile (Inductor); the head and the loss eager",
                "capture": f"torch.cuda.graph, capture_error_mode thread_local, after {peer.DDP_GRAPH_WARMUP} eager "
                "steps on the capturing side stream (PyTorch's recipe for DDP), capturable fused AdamW",
                "weak_scaling": "the cp1 rows train the config's sequence of seq_len L on each GPU alone; the CP rows "
                "one sequence of N x L over the N GPUs, each holding its head-tail chunks: the same tokens per GPU, "
                "N times the attention work per token",
                "baseline": f"{EAGER_BASE}, {GRAPH_BASE}: pytorch_peer's eager and cuda_graph systems at L, every "
                "rank alone on its GPU, all ranks at the same time",
                "formulas": {"efficiency": "median step time(baseline_system) / median step time(CP row)",
                             "tokens_per_s": "per GPU: the row's tokens / N / median step time"},
                "one_gpu_loss": ONE_GPU,
                "timing": peer.DP_TIMING,
                "rows": "benchmarks/cp_step_peer.py's docstring; Note [Context-parallel rows] in "
                "benchmarks/step_runner.h",
                "note": note,
            },
            "configs": [],
        })
        if leader:
            peer_common.print_launch(result, world, local_world, launcher, peer.comm_nccl_version(),
                                     "context parallel", note)
        deadline = time.perf_counter() + args.budget_s
        peer_common.run_configs(
            result, configs, lambda name: run_cp_config(name, rows, args.steps, args.warmup, deadline, group, device,
                                                        mesh),
            leader, lambda r: peer.save_progress(r, args.out))
        wrong = peer_common.disagreements(result, "cp_loss_check", "first_loss", "one_gpu_first_loss")
        return peer.exit_status("cp_step_peer", failures(result), wrong, "a CP row's first loss differs from one GPU's",
                                leader)
    finally:
        peer.end_process_group(store_dir)


if __name__ == "__main__":
    sys.exit(main())

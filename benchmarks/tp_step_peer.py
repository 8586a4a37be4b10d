#!/usr/bin/env python3
"""tp_step_peer.py: the PyTorch peer of step_bench --tp N, the whole GPT
training step (forward, cross-entropy, backward, AdamW) tensor- and
sequence-parallel over the N ranks of a launch, one process per GPU:

    torchrun --nproc-per-node 2 benchmarks/tp_step_peer.py --configs medium,large --out tp_step_peer.json

The model, configs, parameters and batch are pytorch_peer.py's
(step_configs.cc's GPT configs with attention; the dense ones whose
sequences split over the ranks: medium and large at N = 2; moe has no peer
here, small's one sequence does not split, as step_bench --tp says). The
model is written as nn.Modules (GPT below: per block LayerNorm -> q, k, v
Linear -> rotary -> causal SDPA per sequence -> output Linear, + residual;
LayerNorm -> Linear -> GeLU(tanh) -> Linear, + residual; final LayerNorm;
head Linear without bias; fp32 masters cast to bf16 in the forward as in
pytorch_peer) holding pytorch_peer.make_params' values (the q, k and v
weights are the rows of its fused qkv_w), then sharded with PyTorch's own
tensor parallelism, the Megatron-style plan torchtitan uses:
  parallelize_module over a 1-D device mesh of the N ranks:
    each block's norms        SequenceParallel(sequence_dim=0): rank r holds
                              rows [r T/N, (r+1) T/N) of the residual stream
    attention, MLP inputs     PrepareModuleInput: Shard(0) -> Replicate (the
                              all-gather)
    attention q, k, v         ColwiseParallel: heads / N heads per rank
    attention output, fc2     RowwiseParallel(output_layouts=Shard(0)): the
                              reduce-scatter back to the rank's rows
    fc1                       ColwiseParallel: ffn / N rows per rank
    final norm                SequenceParallel(sequence_dim=0)
    head                      ColwiseParallel(input Shard(0), output
                              Shard(-1)): vocabulary-parallel logits
  loss          F.cross_entropy under loss_parallel() (vocabulary-parallel),
                every token's labels on every rank
  backward      DTensor's autograd (the replicated norms' gradients are
                reduced by DTensor)
  optimizer     torch.optim.AdamW(fused=True) over the DTensor parameters
Same shapes, dtype (bf16 compute, fp32 masters), tokens, batch, learning
rate and weight decay as pytorch_peer and step_bench; the first loss equals
the 1-GPU step's up to rounding (tp_loss_check).

Rows per config (step_bench's schema; Note [Tensor-parallel rows] in
benchmarks/step_runner.h):
  pytorch_eager_tp1, pytorch_cuda_graph_tp1   the baseline: pytorch_peer's
                  eager and whole-step CUDA graph systems, every rank training
                  the whole config (all tokens) alone, all ranks at once
  pytorch_tp_eager              the plan above, eager (DTensor dispatch)
  pytorch_tp_compile            each block under torch.compile (Inductor),
                  the head and loss eager
  pytorch_async_tp_compile      as pytorch_tp_compile with async TP:
                  torch._inductor.config._micro_pipeline_tp (Inductor fuses
                  each all-gather + GEMM and GEMM + reduce-scatter into
                  symmetric-memory pipelined ops) with symmetric memory
                  enabled for the group
  pytorch_async_tp_compile_graph   pytorch_async_tp_compile's whole step
                  captured with torch.cuda.graph (pytorch_peer's recipe: 3
                  steps on a side stream, capture_error_mode "thread_local",
                  capturable AdamW); a capture PyTorch refuses is no row: its
                  error is the config's "unavailable" entry
A row that cannot be built says why in its "reason" (status "failed"); the
async rows fail with the reason when symmetric memory cannot be enabled.
The TP rows at N > 1 only; their baseline_system, speedup_vs_tp1 and
strong_scaling_efficiency against the tp1 row of the same kind (eager and
compiled rows: pytorch_eager_tp1; the graph row: pytorch_cuda_graph_tp1);
tflops and mfu per GPU. Timing as step_bench's (Note [How a step is timed]:
host wall clock around one step plus torch.cuda.synchronize(); the ranks
meet with dist.barrier before each sample; a sample is the largest over the
ranks; median, min, max over --steps samples after --warmup steps;
pipelined: the largest over the ranks of --steps steps and one synchronize,
/ steps). Rank 0 writes the JSON after every config. NVLink multicast stays
off: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and
NVSHMEM_DISABLE_NVLS=1 are set (comm_peer, on import) before torch is
imported. The config table and row arithmetic need no torch (tests).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pytorch_peer as peer  # noqa: E402  (first: comm_peer sets the multicast variables before torch loads)
import peer_common  # noqa: E402
import tp_peer  # noqa: E402

import argparse  # noqa: E402
import time  # noqa: E402

torch, dist, F = peer.torch, peer.dist, peer.F

CONFIGS = ("small", "medium", "large")  # pytorch_peer's dense configs; moe: no TP peer
EAGER_BASE, GRAPH_BASE = "pytorch_eager_tp1", "pytorch_cuda_graph_tp1"
TP_EAGER, TP_COMPILE = "pytorch_tp_eager", "pytorch_tp_compile"
ASYNC, ASYNC_GRAPH = "pytorch_async_tp_compile", "pytorch_async_tp_compile_graph"
TP_ROWS = (TP_EAGER, TP_COMPILE, ASYNC, ASYNC_GRAPH)
# row: (pytorch_peer system of a tp1 row | None, compiled blocks, async TP, whole-step graph, baseline row)
ROWS = {
    EAGER_BASE: ("eager", False, False, False, None),
    GRAPH_BASE: ("cuda_graph", False, False, True, None),
    TP_EAGER: (None, False, False, False, EAGER_BASE),
    TP_COMPILE: (None, True, False, False, EAGER_BASE),
    ASYNC: (None, True, True, False, EAGER_BASE),
    ASYNC_GRAPH: (None, True, True, True, GRAPH_BASE),
}
TP_LOSS_TOLERANCE = 5e-3  # relative: a TP row's first loss against pytorch_eager_tp1's (bf16 partial sums)
SHARDING = ("parallelize_module, torchtitan's Megatron-style plan: SequenceParallel(sequence_dim=0) norms, "
            "ColwiseParallel q, k, v and fc1, RowwiseParallel(output_layouts=Shard(0)) output projection and fc2, "
            "PrepareModuleInput Shard(0) -> Replicate before attention and MLP, ColwiseParallel head to Shard(-1) "
            "logits, loss_parallel cross-entropy")


def check_config(name, world):
    """None when `name` can be sharded over `world` ranks, else why not."""
    if name not in CONFIGS:
        return f"config '{name}' has no tensor-parallel PyTorch peer (dense configs only: {', '.join(CONFIGS)})"
    c = peer.CONFIGS[name]
    for what, size in (("sequences", c["sequences"]), ("heads", c["heads"]), ("ffn", c["ffn"]),
                       ("vocab", peer.VOCAB)):
        if size % world:
            return f"config '{name}': {what} {size} does not divide by {world} ranks"
    return None


def shard(total, rank, world):
    """[start, stop) of rank's 1/world of `total` (which divides by world)."""
    size = total // world
    return rank * size, (rank + 1) * size


def tp_row(name, c, world, combined, baseline=None, baseline_name=None):
    """A row in step_bench's tensor-parallel fields (Note [Tensor-parallel rows]): pytorch_peer's row from the
    combined ranks, tflops and mfu per GPU, and against a baseline the strong scaling."""
    row = peer_common.per_gpu_row(peer.system_json(name, c, combined), world, combined)
    row.update(baseline_system=None, speedup_vs_tp1=None, strong_scaling_efficiency=None)
    if baseline is not None:
        speedup = baseline["step_us"]["median_us"] / row["step_us"]["median_us"]
        row.update(baseline_system=baseline_name, speedup_vs_tp1=speedup, strong_scaling_efficiency=speedup / world)
    return row


def loss_checks(rows):
    """(loss_check, tp_loss_check) from the rows that ran: the TP rows' first losses against each other (as
    step_bench compares its eager and graph rows), and each TP row's first loss against pytorch_eager_tp1's (the
    same global batch and parameters on one GPU)."""
    tp_rows = [n for n in TP_ROWS if n in rows]
    tp_check = {}
    base = rows.get(EAGER_BASE)
    if base is not None and base["first_losses"]:
        want = base["first_losses"][0]
        for n in tp_rows:
            tp_check[n] = peer_common.first_loss_agreement(rows[n]["first_losses"], want, "baseline_first_loss",
                                                           TP_LOSS_TOLERANCE)
    return peer_common.first_losses_check(rows, tp_rows), tp_check


def describe(name, r):
    if r["status"] != "ok":
        return peer_common.describe_not_ok(name, r, 7)
    s = r["step_us"]
    line = (f"{name:7s} {r['system']:28s} {s['median_us'] / 1000:.3f} ms [{s['min_us'] / 1000:.3f}-"
            f"{s['max_us'] / 1000:.3f}] {r['tokens_per_s']:.0f} tok/s")
    if r.get("speedup_vs_tp1") is not None:
        line += (f" (speedup {r['speedup_vs_tp1']:.3f}x vs {r['baseline_system']}, strong-scaling efficiency "
                 f"{r['strong_scaling_efficiency']:.3f})")
    return line + f", per-GPU MFU {100 * r['mfu']:.1f}%, peak {r['peak_bytes'] / 2**20:.0f} MiB"


# --- the tensor-parallel step (torch needed from here on) -----------------

if torch is not None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, loss_parallel, parallelize_module)

    class BfLinear(torch.nn.Linear):
        """nn.Linear (so the TP styles take it) over fp32 masters, computing in bf16 as pytorch_peer.bf."""

        def forward(self, x):
            return F.linear(x, peer.bf(self.weight), None if self.bias is None else peer.bf(self.bias))

    class BfLayerNorm(torch.nn.LayerNorm):
        def forward(self, x):
            return F.layer_norm(x, self.normalized_shape, peer.bf(self.weight), peer.bf(self.bias), self.eps)

    class Attention(torch.nn.Module):
        """pytorch_peer.attention with q, k and v as three Linears (ColwiseParallel shards each by heads): the
        rank's heads are its q's columns / head_dim, whatever N is."""

        def __init__(self, c, rope):
            super().__init__()
            h = c["hidden"]
            self.c, self.rope = c, rope  # rope: plain tensors, not parameters or buffers (nothing to shard)
            self.q, self.k, self.v, self.o = (BfLinear(h, h, device="cuda") for _ in range(4))

        def forward(self, n):
            c = self.c
            s, length, d = c["sequences"], c["seq_len"], peer.head_dim(c)
            q, k, v = (proj(n).view(s, length, -1, d).transpose(1, 2) for proj in (self.q, self.k, self.v))
            out = F.scaled_dot_product_attention(peer.rotate(q, self.rope), peer.rotate(k, self.rope), v,
                                                 is_causal=True)
            return self.o(out.transpose(1, 2).reshape(s * length, -1))

    class Mlp(torch.nn.Module):
        def __init__(self, c):
            super().__init__()
            self.fc1 = BfLinear(c["hidden"], c["ffn"], device="cuda")
            self.fc2 = BfLinear(c["ffn"], c["hidden"], device="cuda")

        def forward(self, n):
            return self.fc2(F.gelu(self.fc1(n), approximate="tanh"))

    class Block(torch.nn.Module):
        def __init__(self, c, rope):
            super().__init__()
            self.attn_norm = BfLayerNorm(c["hidden"], eps=peer.EPS, device="cuda")
            self.attn = Attention(c, rope)
            self.mlp_norm = BfLayerNorm(c["hidden"], eps=peer.EPS, device="cuda")
            self.mlp = Mlp(c)

        def forward(self, h):
            h = h + self.attn(self.attn_norm(h))
            return h + self.mlp(self.mlp_norm(h))

    class GPT(torch.nn.Module):
        def __init__(self, c, rope):
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block(c, rope) for _ in range(c["layers"]))
            self.norm = BfLayerNorm(c["hidden"], eps=peer.EPS, device="cuda")
            self.head = BfLinear(c["hidden"], peer.VOCAB, bias=False, device="cuda")

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))

        @torch.no_grad()
        def load(self, blocks, top):
            """pytorch_peer.make_params' values (the whole model, as one GPU draws it)."""
            h = self.norm.weight.shape[0]
            for mine, p in zip(self.blocks, blocks):
                mine.attn_norm.weight.copy_(p["attn_ln_w"])
                mine.attn_norm.bias.copy_(p["attn_ln_b"])
                for i, proj in enumerate((mine.attn.q, mine.attn.k, mine.attn.v)):  # qkv_w: q's rows, k's, v's
                    proj.weight.copy_(p["qkv_w"][i * h:(i + 1) * h])
                    proj.bias.copy_(p["qkv_b"][i * h:(i + 1) * h])
                mine.attn.o.weight.copy_(p["proj_w"])
                mine.attn.o.bias.copy_(p["proj_b"])
                mine.mlp_norm.weight.copy_(p["ln_w"])
                mine.mlp_norm.bias.copy_(p["ln_b"])
                mine.mlp.fc1.weight.copy_(p["w1"])
                mine.mlp.fc1.bias.copy_(p["b1"])
                mine.mlp.fc2.weight.copy_(p["w2"])
                mine.mlp.fc2.bias.copy_(p["b2"])
            self.norm.weight.copy_(top["ln_w"])
            self.norm.bias.copy_(top["ln_b"])
            self.head.weight.copy_(top["head"])

    def parallelize(model, mesh):
        """torchtitan's plan (the module docstring), along the token dimension 0 of our [T, hidden] rows."""
        rows, gather = Shard(0), PrepareModuleInput(input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),))
        for block in model.blocks:
            parallelize_module(block, mesh, {
                "attn_norm": SequenceParallel(sequence_dim=0),
                "attn": gather,
                "attn.q": ColwiseParallel(),
                "attn.k": ColwiseParallel(),
                "attn.v": ColwiseParallel(),
                "attn.o": RowwiseParallel(output_layouts=rows),
                "mlp_norm": SequenceParallel(sequence_dim=0),
                "mlp": gather,
                "mlp.fc1": ColwiseParallel(),
                "mlp.fc2": RowwiseParallel(output_layouts=rows),
            })
        parallelize_module(model, mesh, {
            "norm": SequenceParallel(sequence_dim=0),
            "head": ColwiseParallel(input_layouts=rows, output_layouts=Shard(-1), use_local_output=False),
        })

    class TPSetup:
        """One rank's GPT under the plan, its rows of pytorch_peer.Setup's batch (every token's labels: the
        vocabulary-parallel loss reads them all) and fused AdamW over its DTensor parameters; train_step() as
        pytorch_peer.Setup's."""

        def __init__(self, c, group, mesh, compiled, capturable, data_seed=2):
            t0, t1 = shard(c["tokens"], group.rank, group.world)
            self.rope = peer.rope_tables(c)
            self.model = GPT(c, self.rope)
            blocks, top, everything = peer.make_params(c, seed=1)
            self.model.load(blocks, top)
            del blocks, top, everything
            parallelize(self.model, mesh)
            if compiled:
                for block in self.model.blocks:
                    block.compile()  # per block, as torchtitan: the collectives inside, Inductor sees them
            g = torch.Generator(device="cuda")
            g.manual_seed(data_seed)
            x = peer.uniform((c["tokens"], c["hidden"]), 1.0, g).to(torch.bfloat16)
            self.labels = torch.randint(0, peer.VOCAB, (c["tokens"],), generator=g, device="cuda")
            self.x = x[t0:t1].clone()
            del x
            torch.cuda.empty_cache()
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=peer.LR, weight_decay=peer.WEIGHT_DECAY,
                                               fused=True, capturable=capturable)

        def train_step(self):
            """One step; returns the loss tensor (no host read): the global mean, the same on every rank."""
            with loss_parallel():
                loss = F.cross_entropy(self.model(self.x).float(), self.labels)
                loss.backward()
            self.optimizer.step()
            return loss.to_local() if isinstance(loss, DTensor) else loss


def set_async_tp(on):
    """Inductor's async TP pass (read when a graph is compiled)."""
    torch._inductor.config._micro_pipeline_tp = on


def build_tp_system(row, c, group, mesh):
    """pytorch_peer.build_system's tuple for a TP row (ROWS)."""
    _, compiled, async_tp, graph, _ = ROWS[row]
    start = time.perf_counter()
    set_async_tp(async_tp)
    s = TPSetup(c, group, mesh, compiled, capturable=graph)
    if graph:
        return peer.warm_up_and_capture(s, start, capture_error_mode="thread_local")

    def run_one():
        s.optimizer.zero_grad(set_to_none=True)
        return s.train_step()

    extra = {}
    if compiled:  # the compilation before the timed warm-up, so that compile time is not a step's
        compile_start = time.perf_counter()
        losses = [run_one().item() for _ in range(2)]
        extra["compile_ms"] = 1000 * (time.perf_counter() - compile_start)
        return run_one, extra, losses, s
    return run_one, extra, [], s


def run_tp_config(name, rows, steps, warmup, deadline, group, async_error, mesh=None):
    """One config's rows on every rank; the config's JSON (the same on every rank). mesh: the ranks' 1-D device
    mesh (the TP rows')."""
    c = peer.CONFIGS[name]
    n = group.world
    out = peer.config_header(name)
    out.update(status="ok", reason=None, world_size=n, tp=n, tensor_parallel_rows=True, unavailable={}, systems=[])
    why = check_config(name, n)
    if why is not None:
        out.update(status="not_run", reason=why)
        return out
    made = {}  # the rows that ran, by name
    for row_name in rows:
        system, compiled, async_tp, graph, baseline_name = ROWS[row_name]
        row = None
        if system is None and n == 1:
            continue  # the TP rows need N > 1 ranks
        if not group.agree(time.perf_counter() <= deadline):  # rank 0's clock decides for all
            row = {"system": row_name, "status": "not_run", "reason": "the --budget-s time was spent"}
        elif async_tp and async_error is not None:
            row = {"system": row_name, "status": "failed", "reason": f"async TP unavailable: {async_error}"}
        else:
            if system is not None:
                build = lambda: peer.build_system(system, c, data_seed=2)  # noqa: E731
            else:
                build = lambda: build_tp_system(row_name, c, group, mesh)  # noqa: E731
            result, why = peer.run_everywhere(build, c, steps, warmup, group, world_one=n == 1)
            if compiled and torch is not None:  # the next row compiles afresh (and with its own async TP setting)
                set_async_tp(False)
                peer.reset_compiled_state()
            if result is None and graph and system is None:
                out["unavailable"][row_name] = f"capture failed: {why}"  # no row for a capture failure
            elif result is None:
                row = {"system": row_name, "status": "failed", "reason": why}
            else:
                base = made.get(baseline_name)
                row = tp_row(row_name, c, 1 if system else n, result, base, baseline_name if base else None)
                made[row_name] = row
                if baseline_name and base is None:
                    row["reason"] = f"no scaling: {baseline_name} did not run"
        if row is not None:
            out["systems"].append(row)
            if group.rank == 0:
                print(describe(name, row), flush=True)
        elif group.rank == 0 and row_name in out["unavailable"]:
            print(f"{name:7s} {row_name}: {out['unavailable'][row_name][:300]}", flush=True)
    out["loss_check"], out["tp_loss_check"] = loss_checks(made)
    if not made:
        out["status"], out["reason"] = "failed", "no system ran"
    return out


def parse_run_flags(argv, tool, description, default_configs, configs, rows, add_flags=None):
    """The flags of a parallel step peer (this script, cp_step_peer.py, pp_step_peer.py and ep_step_peer.py),
    parsed: configs, rows, add_flags(parser)'s own, step counts (pytorch_peer.apply_step_counts), the row budget,
    torch.distributed's timeout (positive) and the output."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--configs", default=default_configs, help=f"of {', '.join(configs)}")
    parser.add_argument("--systems", help=f"rows, of {', '.join(rows)} (default all)")
    if add_flags is not None:
        add_flags(parser)
    parser.add_argument("--steps", type=int, default=50, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first (after compile or capture)")
    parser.add_argument("--quick", action="store_true", help="--steps 20 --warmup 5")
    parser.add_argument("--budget-s", type=float, default=600, help="start no row after this many seconds")
    parser.add_argument("--timeout-s", type=int, default=300, help="torch.distributed's timeout")
    parser.add_argument("--out", help="rank 0 writes the results as JSON here")
    args = parser.parse_args(argv)
    peer.apply_step_counts(args, tool)
    if args.timeout_s <= 0:
        raise SystemExit(f"{tool}: --timeout-s must be positive, got {args.timeout_s}")
    return args


def check_launch(tool):
    """SystemExit naming `tool` for bad launcher variables (before torch is needed), no PyTorch or no CUDA device."""
    try:
        peer.launch_info()
    except ValueError as error:
        raise SystemExit(f"{tool}: {error}")
    if peer.torch is None:
        raise SystemExit(f"{tool}: PyTorch is not installed here (run it on the GPU machines)")
    if not peer.torch.cuda.is_available():
        raise SystemExit(f"{tool}: no CUDA device (torch.cuda.is_available() is False)")


def main(argv=None):
    args = parse_run_flags(argv, "tp_step_peer", __doc__.split("\n")[0], "medium,large", CONFIGS, ROWS)
    configs = peer.parse_list(args.configs, list(peer.CONFIGS), "config")
    for name in configs:
        if name not in CONFIGS:
            raise SystemExit(f"tp_step_peer: {check_config(name, 1)}")
    rows = peer.parse_list(args.systems or ",".join(ROWS), list(ROWS), "system")
    rows = [r for r in ROWS if r in rows]  # baselines before the rows measured against them
    check_launch("tp_step_peer")
    group, local_rank, local_world, launcher, device, store_dir = peer.start_process_group(args.timeout_s,
                                                                                         "tp_step_peer")
    try:
        world, leader = group.world, group.rank == 0
        async_error = None
        mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("tp",)) if world > 1 else None
        if any(ROWS[r][2] for r in rows) and world > 1:
            try:
                tp_peer.enable_async_tp(mesh.get_group())
            except Exception as error:  # every async row fails with it
                async_error = f"{type(error).__name__}: {error}"[:2000]
        note = "world size 1: the tp1 rows alone; nothing is sharded" if world == 1 else ""
        flops_text = peer.FLOPS_TEXT + "; tflops and mfu per GPU (/ world_size for the TP rows)"
        result = peer.result_header(args, device, flops_text, "row", " (largest over the ranks)")
        result.update({
            "tensor_parallel": {
                **peer_common.launch_fields(world, local_world, launcher, peer.comm_nccl_version(),
                                            peer.MULTICAST_ENV),
                "sharding": SHARDING,
                "compile": "each block under torch.compile (Inductor); the head and the loss eager",
                "async_tp": "torch._inductor.config._micro_pipeline_tp with symmetric memory enabled for the group "
                "(Inductor's fused all-gather + GEMM and GEMM + reduce-scatter)",
                "strong_scaling": "every row trains the config's `tokens` per step; the TP rows shard the model over "
                "N GPUs",
                "baseline": f"{EAGER_BASE}, {GRAPH_BASE}: pytorch_peer's eager and cuda_graph systems, every rank "
                "training the whole config alone on its GPU, all ranks at the same time",
                "timing": peer.DP_TIMING,
                "rows": "benchmarks/tp_step_peer.py's docstring; Note [Tensor-parallel rows] in "
                "benchmarks/step_runner.h",
                "note": note,
            },
            "configs": [],
        })
        if leader:
            peer_common.print_launch(result, world, local_world, launcher, peer.comm_nccl_version(), "tensor parallel",
                                     note)
            if async_error:
                print(f"tp_step_peer: async TP unavailable: {async_error}", file=sys.stderr, flush=True)
        deadline = time.perf_counter() + args.budget_s
        peer_common.run_configs(
            result, configs,
            lambda name: run_tp_config(name, rows, args.steps, args.warmup, deadline, group, async_error, mesh),
            leader, lambda r: peer.save_progress(r, args.out))
        failed = peer.failed_systems(result)
        failed += [f"{c['name']}: {c['reason']}" for c in result["configs"] if c["status"] != "ok"]
        wrong = peer_common.disagreements(result, "tp_loss_check", "first_loss", "baseline_first_loss")
        return peer.exit_status("tp_step_peer", failed, wrong, f"a TP row's first loss differs from {EAGER_BASE}'s",
                                leader)
    finally:
        peer.end_process_group(store_dir)


if __name__ == "__main__":
    sys.exit(main())

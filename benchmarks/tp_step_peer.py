#!/usr/bin/env python3
"""tp_step_peer.py: the PyTorch peer of step_bench --tp N, the whole training
step (forward, cross-entropy, backward, AdamW) tensor- and sequence-parallel
over the N ranks of a launch, one process per GPU:

    torchrun --nproc-per-node 2 benchmarks/tp_step_peer.py --configs medium,large --out tp_step_peer.json

The model and configs are pytorch_peer.py's (step_configs.cc; the dense
ones: small, medium, large; moe has no peer here, its experts' sharding is
not written in PyTorch), each config's MLP-only trunk (pytorch_peer.mlp_only:
heads 0, the same tokens; attention is not tensor-parallel in StepGraph yet,
so step_bench --tp runs the same trunk and both say so in "trunk"), sharded
as StepGraph's (Note [Tensor-parallel
ResidualStack] in layers/residual_stack.h, Megatron's tensor and sequence
parallelism): rank r holds tokens / N rows of the residual stream, rows
[r T/N, (r+1) T/N) of one global batch (pytorch_peer's, seed 2), and
  every block   LayerNorm on the shard; all-gather + fc1 on its ffn / N rows
                (column-parallel) + bias; GeLU(tanh); fc2 on its ffn / N
                columns + reduce-scatter (row-parallel), fc2's bias added to
                the shard (its gradient: the gathered dy's column sums, as in
                StepGraph, so no all-reduce); the residual add on the shard
  final norm    LayerNorm on the shard
  head          vocabulary-parallel: all-gather the normed tokens, logits
                [T, vocab / N] of its vocabulary rows (no bias)
  loss          vocabulary-parallel cross-entropy (Megatron's): a max
                all-reduce of each token's largest logit and one sum
                all-reduce of each token's [label logit, sum of exps]; the
                mean over all T tokens (the same on every rank); the labels
                of every rank all-gathered in the step (StepGraph's
                gather_labels)
  backward      autograd through the collectives' own autograd Functions
                (the fused ops have none): an all-gather's backward is the
                reduce-scatter and the reverse; the LayerNorms' gamma and
                beta gradients (of the shard's tokens) summed over the ranks
                with one all-reduce of them all after the backward (Megatron's
                finalize_model_grads)
  optimizer     fp32 master parameters cast to bf16 in the forward (as
                pytorch_peer), torch.optim.AdamW(fused=True) over the rank's
                shards and the replicated norms
Each rank's shards are slices of the parameters one GPU draws
(pytorch_peer.make_params, seed 1), so the first loss equals the 1-GPU
step's on the same batch up to rounding (tp_loss_check).

Rows per config (step_bench's schema; Note [Tensor-parallel rows] in
benchmarks/step_runner.h):
  pytorch_eager_tp1, pytorch_cuda_graph_tp1   the baseline: pytorch_peer's
                  eager and whole-step CUDA graph systems, every rank training
                  the whole config (all tokens) alone, all ranks at once
  pytorch_tp_sequential         the TP step with all_gather_into_tensor /
                  reduce_scatter_tensor beside the GEMMs (no overlap), eager
  pytorch_async_tp              the TP step with PyTorch's async TP over
                  symmetric memory, as tp_peer.py uses it:
                  torch.ops.symm_mem.fused_all_gather_matmul for every
                  all-gather + GEMM (fc1, the head, fc2's data gradient),
                  fused_matmul_reduce_scatter for every GEMM + reduce-scatter
                  (fc2, fc1's and the head's data gradients), eager
  pytorch_async_tp_cuda_graph   pytorch_async_tp's whole step captured with
                  torch.cuda.graph (pytorch_peer's recipe: 3 eager steps on a
                  side stream, capture_error_mode "thread_local", capturable
                  AdamW); a capture PyTorch refuses is no row: its error is
                  the config's "unavailable" entry
The TP rows at N > 1 only; their baseline_system, speedup_vs_tp1 and
strong_scaling_efficiency against the tp1 row of the same kind (eager rows:
pytorch_eager_tp1; the graph row: pytorch_cuda_graph_tp1); tflops and mfu
per GPU. Timing as step_bench's (Note [How a step is timed]: host wall
clock around one step plus torch.cuda.synchronize(); the ranks meet with
dist.barrier before each sample; a sample is the largest over the ranks;
median, min, max over --steps samples after --warmup steps; pipelined: the
largest over the ranks of --steps steps and one synchronize, / steps).
Rank 0 writes the JSON after every config. NVLink multicast stays off:
NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and
NVSHMEM_DISABLE_NVLS=1 are set (comm_peer, on import) before torch is
imported. The config table and row arithmetic need no torch (tests).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pytorch_peer as peer  # noqa: E402  (first: comm_peer sets the multicast variables before torch loads)
import tp_peer  # noqa: E402

import argparse  # noqa: E402
import time  # noqa: E402

torch, dist, F = peer.torch, peer.dist, peer.F

CONFIGS = ("small", "medium", "large")  # pytorch_peer's dense configs; moe: no TP peer
EAGER_BASE, GRAPH_BASE = "pytorch_eager_tp1", "pytorch_cuda_graph_tp1"
SEQUENTIAL, ASYNC, ASYNC_GRAPH = "pytorch_tp_sequential", "pytorch_async_tp", "pytorch_async_tp_cuda_graph"
# row: (pytorch_peer system of a tp1 row | None, async TP, whole-step graph, baseline row)
ROWS = {
    EAGER_BASE: ("eager", False, False, None),
    GRAPH_BASE: ("cuda_graph", False, True, None),
    SEQUENTIAL: (None, False, False, EAGER_BASE),
    ASYNC: (None, True, False, EAGER_BASE),
    ASYNC_GRAPH: (None, True, True, GRAPH_BASE),
}
TP_LOSS_TOLERANCE = 5e-3  # relative: a TP row's first loss against pytorch_eager_tp1's (bf16 partial sums)


def check_config(name, world):
    """None when `name` can be sharded over `world` ranks, else why not."""
    if name not in CONFIGS:
        return f"config '{name}' has no tensor-parallel PyTorch peer (dense configs only: {', '.join(CONFIGS)})"
    c = peer.mlp_only(peer.CONFIGS[name])
    for what, size in (("tokens", c["tokens"]), ("ffn", c["ffn"]), ("vocab", peer.VOCAB)):
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
    row = peer.system_json(name, c, combined)
    row["world_size"] = world
    row["rank_median_us"] = combined["rank_median_us"]
    row["tflops"] /= world
    row["mfu"] /= world
    row.update(baseline_system=None, speedup_vs_tp1=None, strong_scaling_efficiency=None)
    if baseline is not None:
        speedup = baseline["step_us"]["median_us"] / row["step_us"]["median_us"]
        row.update(baseline_system=baseline_name, speedup_vs_tp1=speedup, strong_scaling_efficiency=speedup / world)
    return row


def loss_checks(rows):
    """(loss_check, tp_loss_check) from the rows that ran: the TP rows' first losses against each other (as
    step_bench compares its eager and graph rows), and each TP row's first loss against pytorch_eager_tp1's (the
    same global batch and parameters on one GPU)."""
    tp_rows = [n for n in (SEQUENTIAL, ASYNC, ASYNC_GRAPH) if n in rows]
    firsts = {n: rows[n]["first_losses"] for n in rows}
    check = {"steps": min((len(v) for v in firsts.values()), default=0), "compared": tp_rows, **firsts}
    if len(tp_rows) >= 2:
        a = firsts[tp_rows[0]]
        check["identical"] = all(firsts[n] == a for n in tp_rows[1:])
        check["max_abs_diff"] = max((abs(x - y) for n in tp_rows[1:] for x, y in zip(a, firsts[n])), default=0.0)
    tp_check = {}
    base = rows.get(EAGER_BASE)
    if base is not None and base["first_losses"]:
        want = base["first_losses"][0]
        for n in tp_rows:
            got = firsts[n][0] if firsts[n] else float("nan")
            diff = abs(got - want)
            tp_check[n] = {"first_loss": got, "baseline_first_loss": want, "abs_diff": diff,
                           "agrees": diff <= TP_LOSS_TOLERANCE * max(1.0, abs(want))}
    return check, tp_check


def describe(name, r):
    if r["status"] != "ok":
        return f"{name:7s} {r['system']}: {r['status']}: {str(r['reason'])[:300]}"
    s = r["step_us"]
    line = (f"{name:7s} {r['system']:28s} {s['median_us'] / 1000:.3f} ms [{s['min_us'] / 1000:.3f}-"
            f"{s['max_us'] / 1000:.3f}] {r['tokens_per_s']:.0f} tok/s")
    if r.get("speedup_vs_tp1") is not None:
        line += (f" (speedup {r['speedup_vs_tp1']:.3f}x vs {r['baseline_system']}, strong-scaling efficiency "
                 f"{r['strong_scaling_efficiency']:.3f})")
    return line + f", per-GPU MFU {100 * r['mfu']:.1f}%, peak {r['peak_bytes'] / 2**20:.0f} MiB"


# --- the tensor-parallel step (torch needed from here on) -----------------

if torch is not None:

    class AllGatherMatmul(torch.autograd.Function):
        """Column-parallel: the ranks' row shards all-gathered, times this rank's weight rows (weight [out, in]):
        gathered @ weight.T. Backward: d_shard = (d_out @ weight) reduce-scattered; d_weight = d_out.T @ gathered."""

        @staticmethod
        def forward(ctx, shard_, weight, comm):
            gathered, out = comm.all_gather_mm(shard_, weight.t())
            ctx.save_for_backward(gathered, weight)
            ctx.comm = comm
            return out

        @staticmethod
        def backward(ctx, d_out):
            gathered, weight = ctx.saved_tensors
            d_out = d_out.contiguous()
            d_shard = ctx.comm.mm_reduce_scatter(d_out, weight)
            return d_shard, d_out.t() @ gathered, None

    class MatmulReduceScatter(torch.autograd.Function):
        """Row-parallel: a [T, in / N] @ weight.T (weight [out, in / N]) summed over the ranks, this rank's rows,
        + bias. Backward: dy all-gathered, d_a = dy_all @ weight, d_weight = dy_all.T @ a, d_bias = dy_all's
        column sums (every token's: the whole gradient on every rank)."""

        @staticmethod
        def forward(ctx, a, weight, bias, comm):
            out = comm.mm_reduce_scatter(a, weight.t()) + bias
            ctx.save_for_backward(a, weight)
            ctx.comm = comm
            return out

        @staticmethod
        def backward(ctx, dy):
            a, weight = ctx.saved_tensors
            dy_all, d_a = ctx.comm.all_gather_mm(dy.contiguous(), weight)
            return d_a, dy_all.t() @ a, dy_all.sum(0), None

    class VocabParallelCrossEntropy(torch.autograd.Function):
        """Mean softmax cross-entropy of logits [T, vocab / N] (this rank's vocabulary rows from vocab_start) over
        every token's labels [T] (Megatron's VocabParallelCrossEntropy), in fp32."""

        @staticmethod
        def forward(ctx, logits, labels, vocab_start, group):
            x = logits.float()
            top = x.max(dim=1).values
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            x = x - top.unsqueeze(1)
            local = labels - vocab_start
            here = (local >= 0) & (local < x.shape[1])
            index = local.clamp(0, x.shape[1] - 1).unsqueeze(1)
            picked = torch.where(here, x.gather(1, index).squeeze(1), torch.zeros((), device=x.device))
            x.exp_()
            stats = torch.stack([picked, x.sum(dim=1)])
            dist.all_reduce(stats, group=group)
            loss = (stats[1].log() - stats[0]).mean()
            x.div_(stats[1].unsqueeze(1))  # softmax
            ctx.save_for_backward(x, index, here)
            ctx.logits_dtype = logits.dtype
            return loss

        @staticmethod
        def backward(ctx, grad):
            softmax, index, here = ctx.saved_tensors
            d = softmax  # in place, as Megatron's
            d.scatter_add_(1, index, -here.to(d.dtype).unsqueeze(1))
            d.mul_(grad / d.shape[0])
            return d.to(ctx.logits_dtype), None, None, None

    class TPSetup:
        """One rank's shards of pytorch_peer's model (its parameters sliced), its rows of the global batch and
        AdamW over its parameters; train_step() as pytorch_peer.Setup's."""

        def __init__(self, c, group, comm, capturable, data_seed=2):
            rank, n = group.rank, group.world
            self.c, self.comm, self.pg = c, comm, comm.group
            f0, f1 = shard(c["ffn"], rank, n)
            v0, v1 = shard(peer.VOCAB, rank, n)
            t0, t1 = shard(c["tokens"], rank, n)

            def leaf(t):
                return t.detach().clone(memory_format=torch.contiguous_format).requires_grad_(True)

            blocks, top, everything = peer.make_params(c, seed=1)  # the whole model, as one GPU draws it
            self.blocks = [
                {"ln_w": leaf(p["ln_w"]), "ln_b": leaf(p["ln_b"]), "w1": leaf(p["w1"][f0:f1]),
                 "b1": leaf(p["b1"][f0:f1]), "w2": leaf(p["w2"][:, f0:f1]), "b2": leaf(p["b2"])}
                for p in blocks
            ]
            self.top = {"ln_w": leaf(top["ln_w"]), "ln_b": leaf(top["ln_b"]), "head": leaf(top["head"][v0:v1])}
            del blocks, top, everything
            self.params = [t for p in self.blocks for t in p.values()] + list(self.top.values())
            # Replicated on every rank, gradients from this rank's tokens only: summed over the ranks.
            self.norms = [p[k] for p in self.blocks + [self.top] for k in ("ln_w", "ln_b")]
            self.vocab_start = v0
            g = torch.Generator(device="cuda")
            g.manual_seed(data_seed)  # pytorch_peer.Setup's batch, this rank's rows
            x = peer.uniform((c["tokens"], c["hidden"]), 1.0, g).to(torch.bfloat16)
            labels = torch.randint(0, peer.VOCAB, (c["tokens"],), generator=g, device="cuda")
            self.x, self.labels = x[t0:t1].clone(), labels[t0:t1].clone()
            del x, labels
            torch.cuda.empty_cache()
            self.optimizer = torch.optim.AdamW(self.params, lr=peer.LR, weight_decay=peer.WEIGHT_DECAY, fused=True,
                                               capturable=capturable)

        def forward_loss(self):
            c, bf = self.c, peer.bf
            labels = torch.empty((self.labels.shape[0] * self.pg.size(),), dtype=self.labels.dtype,
                                 device=self.labels.device)
            dist.all_gather_into_tensor(labels, self.labels, group=self.pg)
            h = self.x
            for p in self.blocks:
                n = F.layer_norm(h, (c["hidden"],), bf(p["ln_w"]), bf(p["ln_b"]), peer.EPS)
                a = F.gelu(AllGatherMatmul.apply(n, bf(p["w1"]), self.comm) + bf(p["b1"]), approximate="tanh")
                h = h + MatmulReduceScatter.apply(a, bf(p["w2"]), bf(p["b2"]), self.comm)
            n = F.layer_norm(h, (c["hidden"],), bf(self.top["ln_w"]), bf(self.top["ln_b"]), peer.EPS)
            logits = AllGatherMatmul.apply(n, bf(self.top["head"]), self.comm)
            return VocabParallelCrossEntropy.apply(logits, labels, self.vocab_start, self.pg)

        def train_step(self):
            """One step; returns the loss tensor (no host read): the global mean, the same on every rank."""
            loss = self.forward_loss()
            loss.backward()
            grads = [p.grad for p in self.norms]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.pg)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
            self.optimizer.step()
            return loss


def build_tp_system(row, c, group):
    """pytorch_peer.build_system's tuple for a TP row (ROWS)."""
    _, async_tp, graph, _ = ROWS[row]
    start = time.perf_counter()
    comm = tp_peer.TPComm(dist.group.WORLD, async_tp)
    s = TPSetup(c, group, comm, capturable=graph)
    if graph:
        return peer.warm_up_and_capture(s, start, capture_error_mode="thread_local")

    def run_one():
        s.optimizer.zero_grad(set_to_none=True)
        return s.train_step()

    return run_one, {}, [], s


def run_tp_config(name, rows, steps, warmup, deadline, group, async_error):
    """One config's rows on every rank; the config's JSON (the same on every rank)."""
    c = peer.mlp_only(peer.CONFIGS[name])  # the MLP-only trunk, as step_bench --tp
    n = group.world
    out = peer.config_header(name, trunk=True)
    out.update(status="ok", reason=None, world_size=n, tensor_parallel_rows=True, trunk=peer.TP_TRUNK, unavailable={},
               systems=[])
    why = check_config(name, n)
    if why is not None:
        out.update(status="not_run", reason=why)
        return out
    made = {}  # the rows that ran, by name
    for row_name in rows:
        system, async_tp, graph, baseline_name = ROWS[row_name]
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
                build = lambda: build_tp_system(row_name, c, group)  # noqa: E731
            result, why = peer.run_everywhere(build, c, steps, warmup, group, world_one=n == 1)
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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="small,medium,large", help=f"of {', '.join(CONFIGS)}")
    parser.add_argument("--systems", help=f"rows, of {', '.join(ROWS)} (default all)")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first (after the capture)")
    parser.add_argument("--quick", action="store_true", help="--steps 20 --warmup 5")
    parser.add_argument("--budget-s", type=float, default=600, help="start no row after this many seconds")
    parser.add_argument("--timeout-s", type=int, default=300, help="torch.distributed's timeout")
    parser.add_argument("--out", help="rank 0 writes the results as JSON here")
    args = parser.parse_args(argv)
    peer.apply_step_counts(args, "tp_step_peer")
    if args.timeout_s <= 0:
        raise SystemExit(f"tp_step_peer: --timeout-s must be positive, got {args.timeout_s}")
    configs = peer.parse_list(args.configs, list(peer.CONFIGS), "config")
    for name in configs:
        if name not in CONFIGS:
            raise SystemExit(f"tp_step_peer: {check_config(name, 1)}")
    rows = peer.parse_list(args.systems or ",".join(ROWS), list(ROWS), "system")
    rows = [r for r in ROWS if r in rows]  # baselines before the rows measured against them
    try:
        peer.launch_info()  # bad launcher variables before torch is needed
    except ValueError as error:
        raise SystemExit(f"tp_step_peer: {error}")
    if torch is None:
        raise SystemExit("tp_step_peer: PyTorch is not installed here (run it on the GPU machines)")
    if not torch.cuda.is_available():
        raise SystemExit("tp_step_peer: no CUDA device (torch.cuda.is_available() is False)")
    group, local_rank, local_world, launcher, device, store_dir = peer.start_process_group(args.timeout_s,
                                                                                         "tp_step_peer")
    try:
        world, leader = group.world, group.rank == 0
        async_error = None
        if any(ROWS[r][1] for r in rows) and world > 1:
            try:
                tp_peer.enable_async_tp(dist.group.WORLD)
            except Exception as error:  # every async row fails with it
                async_error = f"{type(error).__name__}: {error}"[:2000]
        note = "world size 1: the tp1 rows alone; nothing is sharded" if world == 1 else ""
        flops_text = peer.FLOPS_TEXT + "; tflops and mfu per GPU (/ world_size for the TP rows)"
        result = peer.result_header(args, device, flops_text, "row", " (largest over the ranks)")
        result.update({
            "tensor_parallel": {
                "world_size": world,
                "local_world_size": local_world,
                "launcher": launcher,
                "nccl_version": peer.comm_nccl_version(),
                "multicast_env": peer.MULTICAST_ENV,
                "sequential": "all_gather_into_tensor / reduce_scatter_tensor, then / before the GEMM (no overlap)",
                "async_tp": "torch.ops.symm_mem.fused_all_gather_matmul and fused_matmul_reduce_scatter",
                "sharding": "Megatron tensor + sequence parallel as StepGraph's ResidualStack: tokens / N outside "
                "the blocks, ffn / N inside, vocabulary-parallel head and cross-entropy, the norms' gradients "
                "all-reduced",
                "strong_scaling": "every row trains the config's `tokens` per step; the TP rows shard the model over "
                "N GPUs",
                "trunk": peer.TP_TRUNK,
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
            print(f"device: {result['device']}, torch {torch.__version__}, NCCL {peer.comm_nccl_version()}; "
                  f"{world} rank(s) ({local_world} per host) via {launcher}; tensor parallel", flush=True)
            if note:
                print(f"NOTE: {note}", flush=True)
            if async_error:
                print(f"tp_step_peer: async TP unavailable: {async_error}", file=sys.stderr, flush=True)
        deadline = time.perf_counter() + args.budget_s
        for name in configs:
            c = run_tp_config(name, rows, args.steps, args.warmup, deadline, group, async_error)
            result["configs"].append(c)
            if leader:
                peer.save_progress(result, args.out)
        failed = peer.failed_systems(result)
        failed += [f"{c['name']}: {c['reason']}" for c in result["configs"] if c["status"] != "ok"]
        wrong = [f"{c['name']}/{row} ({d['first_loss']:.5f} vs {d['baseline_first_loss']:.5f})"
                 for c in result["configs"] for row, d in c["tp_loss_check"].items() if not d["agrees"]]
        return peer.exit_status("tp_step_peer", failed, wrong, f"a TP row's first loss differs from {EAGER_BASE}'s",
                                leader)
    finally:
        peer.end_process_group(store_dir)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""ep_step_peer.py: the PyTorch peer of step_bench --ep N, PyTorch's usual
expert-parallel MoE training step over the N ranks of a launch, one process
per GPU:

    torchrun --nproc-per-node 2 benchmarks/ep_step_peer.py --configs moe --out ep_step_peer.json

The model is pytorch_peer's GPT of a config with experts (moe: hidden 2048,
16 heads, 4 layers, every block MoE with 8 experts of ffn 8192, top-2, two
sequences of 4096 tokens a rank), its parameters pytorch_peer.make_params'
(seed 1: every rank draws the same experts), bf16 compute over fp32
masters, fused AdamW with pytorch_peer's lr and weight decay. Rank r trains
its own batch (seed 2 + r), as step_bench --ep's ranks do. Under expert
parallelism rank r keeps experts [r E/N, (r + 1) E/N) of every MoE block and
each MoE block runs as PyTorch's expert-parallel recipes do (torchtitan's,
Megatron's all-to-all dispatcher):
  router -> top-k, gates -> the rows sorted by expert (x_perm)
  -> every rank's per-expert counts all-gathered, COPIED TO THE HOST
     (.tolist(): the step waits for the GPU here, every MoE block, forward
     and backward alike use these sizes)
  -> all_to_all_single(x_perm, split sizes from the host counts): each row
     to the rank of its expert (backward: the reverse all_to_all_single)
  -> the received rows sorted by local expert -> the local experts as
     torch._grouped_mm over device offsets (a loop over the experts where
     torch has no _grouped_mm) + bias, GeLU(tanh), again
  -> all_to_all_single back -> unpermute, weighted by the gates.
The dense parameters (attention, norms, router, head) are replicated and
their gradients averaged by DistributedDataParallel (bucketed all-reduce
overlapping the backward; the experts are left out of DDP with
_set_params_and_buffers_to_ignore_for_model); each rank's expert gradients
hold every rank's rows and are divided by N (the loss is the ranks' mean).

Rows per config, in step_bench --ep's field names (Note [Expert-parallel
rows] in benchmarks/expert_parallel_step_runner.h):
  pytorch_eager_ep1     every rank the whole config alone (all E experts,
                        pytorch_peer.moe_mlp: dropless, counts on the
                        device, no host read), all ranks at once: the
                        baseline, eager
  pytorch_compile_ep1   the same with each block's attention half under
                        torch.compile (Inductor)
  pytorch_eager_epN     expert parallel, eager: it cannot be anything else,
                        the split sizes are read on the host every block
  pytorch_compile_epN   expert parallel with each block's attention half
                        under torch.compile (the MoE half stays eager: its
                        host reads would break the graph)
There is no graphed expert-parallel row: torch.cuda.graph refuses a step
that copies the split sizes to the host, which is the point of step_bench's
captured exchange. Per row: step_us (median, min, max over --steps samples
after --warmup steps; the ranks meet with dist.barrier before each sample,
a sample is the largest over the ranks; pipelined: the largest over the
ranks of --steps steps and one synchronize, / steps), tokens_per_s per GPU
(the config's tokens), global_tokens_per_s, tflops and mfu per GPU,
peak_bytes (torch.cuda.max_memory_allocated, the largest over the ranks),
device_used_delta_bytes, first_losses (the global mean under EP), and for
the epN rows against the ep1 row of the same mode: scaling_efficiency =
T_ep1 / T_epN, exposed_comm_us = T_epN - T_ep1 and their pipelined_
variants; ep_loss_check: the epN first loss against the mean of the ranks'
ep1 first losses (the same experts and batches), within EP_LOSS_TOLERANCE.
Rows after the --budget-s deadline are "not_run" (rank 0's clock decides).
Rank 0 writes the JSON after every config; progress goes to stderr. NVLink
multicast stays off: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1
and NVSHMEM_DISABLE_NVLS=1 are set before torch is imported. The config
table, flags, expert split, split sizes and row arithmetic need no torch
(tests/benchmarks/ep_step_peer_test.py).
"""

import os
import sys

for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_name, _value)  # comm_peer (imported next) enforces these values too

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pytorch_peer as peer  # noqa: E402  (first: comm_peer sets the multicast variables before torch loads)
import peer_common  # noqa: E402
import tp_step_peer  # noqa: E402  (the launch checks)

import time  # noqa: E402

torch, dist, F = peer.torch, peer.dist, peer.F

CONFIGS = tuple(name for name, c in peer.CONFIGS.items() if c["experts"] > 0)  # moe
EAGER, COMPILE = "eager", "compile"
# row kind: (expert parallel, attention compiled)
KINDS = {"eager_ep1": (False, False), "compile_ep1": (False, True), "eager_epN": (True, False),
         "compile_epN": (True, True)}
EP_LOSS_TOLERANCE = 1e-3  # relative: the epN first loss against the ranks' mean alone (bf16 products regrouped)
DATA_SEED, PARAM_SEED = 2, 1


def row_name(kind, world):
    """pytorch_eager_ep1, pytorch_compile_ep2: step_bench --ep's names with pytorch_ for stepgraph_."""
    return "pytorch_" + kind.replace("epN", f"ep{world}")


def rows_of(world):
    """The rows a world runs, baselines first: at world size 1 the ep1 rows alone."""
    kinds = [k for k, (parallel, _) in KINDS.items() if world > 1 or not parallel]
    return [row_name(k, world) for k in kinds]


def check_config(name, world):
    """None, or why the config cannot run expert parallel over `world` ranks."""
    if name not in CONFIGS:
        return (f"config '{name}' has no experts (expert parallelism spreads MoE experts over the ranks); configs "
                f"with experts: {', '.join(CONFIGS)}")
    experts = peer.CONFIGS[name]["experts"]
    if experts % world:
        return f"config '{name}': its {experts} experts do not divide by the {world} ranks"
    return None


def local_experts(rank, world, experts):
    """[first, last) of the experts rank `rank` keeps."""
    per_rank = experts // world
    return rank * per_rank, (rank + 1) * per_rank


def split_sizes(counts, rank, world):
    """From every rank's per-expert row counts (counts[p][e], host ints): the rows this rank sends each rank (to
    rank q, its rows for q's experts) and receives from each (from rank p, p's rows for this rank's experts)."""
    experts = len(counts[0])
    first, last = local_experts(rank, world, experts)
    send = [sum(counts[rank][slice(*local_experts(q, world, experts))]) for q in range(world)]
    recv = [sum(counts[p][first:last]) for p in range(world)]
    return send, recv


def ep_row(name, c, world, combined, baseline=None, baseline_name=None):
    """A row in step_bench --ep's fields: pytorch_peer.dp_row's (per GPU, the scaling against the baseline) with
    the expert split."""
    row = peer.dp_row(name, c, world, None, combined, baseline, baseline_name)
    del row["dp_mode"]
    row["ep"] = world
    row["experts_per_rank"] = c["experts"] // world
    row["rank_first_loss"] = combined["rank_first_loss"]
    return row


def ep_loss_check(baseline, parallel):
    """The expert-parallel first loss against the mean of the ranks' first losses alone."""
    check = peer.dp_loss_check(baseline, parallel)
    check["ep_first_loss"] = check.pop("dp_first_loss")
    check["agrees"] = check["abs_diff"] <= EP_LOSS_TOLERANCE * max(1.0, abs(check["baseline_mean_first_loss"]))
    return check


def describe(name, r):
    if r["status"] != "ok":
        return peer_common.describe_not_ok(name, r, 7)
    s = r["step_us"]
    text = (f"{name:7s} {r['system']:22s} {s['median_us'] / 1000:.3f} ms [{s['min_us'] / 1000:.3f}-"
            f"{s['max_us'] / 1000:.3f}]  {r['tokens_per_s']:.0f} tok/s/GPU  peak {r['peak_bytes'] / 2**20:.1f} MiB")
    if r.get("scaling_efficiency") is not None:
        text += (f"  efficiency {r['scaling_efficiency']:.3f}, exposed comm {r['exposed_comm_us'] / 1000:.3f} ms "
                 f"({100 * r['exposed_comm_fraction']:.1f}%)")
    return text


# --- the model (torch needed from here on) ---------------------------------


class AllToAll(torch.autograd.Function if torch is not None else object):
    """all_to_all_single with split sizes from the host; its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty((sum(ctx.send),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), output_split_sizes=ctx.send, input_split_sizes=ctx.recv,
                               group=ctx.group)
        return back, None, None, None


def local_experts_mm(x, w, b, row_expert, offsets, sizes):
    """x [rows, in] grouped by local expert (sizes: rows per expert, host ints; offsets: their int32 ends on the
    device) times each expert's w [L, out, in]^T + its bias: torch._grouped_mm, or a loop without it."""
    if hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm(x, peer.bf(w).transpose(-2, -1), offs=offsets) + \
            torch.index_select(peer.bf(b), 0, row_expert)
    parts = [F.linear(part, peer.bf(w[e]), peer.bf(b[e])) for e, part in enumerate(torch.split(x, sizes))]
    return torch.cat(parts) if parts else x.new_empty((0, w.shape[1]))


def ep_moe_mlp(p, n, topk, world, rank, group):
    """PyTorch's expert-parallel MoE block (the module docstring's recipe); p holds this rank's experts."""
    tokens = n.shape[0]
    experts = p["router"].shape[0]
    first, last = local_experts(rank, world, experts)
    logits = F.linear(n, peer.bf(p["router"])).float()
    top_logits, chosen = torch.topk(logits, topk, dim=-1)
    gates = torch.softmax(logits, dim=-1).gather(1, chosen) if topk == 1 else torch.softmax(top_logits, dim=-1)
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)
    positions = torch.empty_like(order).scatter_(0, order, torch.arange(flat.numel(), device=n.device))
    x_perm = torch.index_select(n, 0, order // topk)  # grouped by global expert
    counts = torch.bincount(flat, minlength=experts)
    every = torch.empty(world * experts, dtype=counts.dtype, device=n.device)
    dist.all_gather_into_tensor(every, counts, group=group)
    host = every.view(world, experts).tolist()  # the host read: the step waits for the GPU here
    send, recv = split_sizes(host, rank, world)
    received = AllToAll.apply(x_perm, send, recv, group)  # by source rank, within each by expert
    mine = every.view(world, experts)[:, first:last].reshape(-1)  # rows of (source rank, local expert)
    segment_expert = torch.arange(last - first, device=n.device).repeat(world)
    row_expert = torch.repeat_interleave(segment_expert, mine, output_size=sum(recv))  # no second host read
    by_expert = torch.argsort(row_expert, stable=True)  # by local expert, within each by source rank
    sizes = [sum(host[q][e] for q in range(world)) for e in range(first, last)]
    offsets = torch.cumsum(torch.tensor(sizes, device=n.device), 0).to(torch.int32)
    rows = torch.index_select(received, 0, by_expert)
    sorted_expert = torch.index_select(row_expert, 0, by_expert)
    a = F.gelu(local_experts_mm(rows, p["w1"], p["b1"], sorted_expert, offsets, sizes), approximate="tanh")
    y_rows = local_experts_mm(a, p["w2"], p["b2"], sorted_expert, offsets, sizes)
    arrival = torch.empty_like(by_expert).scatter_(0, by_expert, torch.arange(by_expert.numel(), device=n.device))
    y_received = torch.index_select(y_rows, 0, arrival)  # back in arrival order
    y_perm = AllToAll.apply(y_received, recv, send, group)  # x_perm's order
    y = torch.index_select(y_perm, 0, positions).view(tokens, topk, -1)
    return (y * gates.unsqueeze(-1).to(y.dtype)).sum(dim=1)


def attention_residual(c, rope):
    """h + attention(LayerNorm(h)) of one block, as a function of h and the block's attention parameters."""

    def run(h, ln_w, ln_b, qkv_w, qkv_b, proj_w, proj_b):
        p = dict(qkv_w=qkv_w, qkv_b=qkv_b, proj_w=proj_w, proj_b=proj_b)
        n = F.layer_norm(h, (c["hidden"],), peer.bf(ln_w), peer.bf(ln_b), peer.EPS)
        return h + peer.attention(c, p, n, rope)

    return run


def forward_loss(c, blocks, top, x, labels, attn, moe):
    """pytorch_peer.forward_loss with the attention half and the MoE MLP given (every block of the config is MoE)."""
    h = x
    for block, p in enumerate(blocks):
        h = attn(h, p["attn_ln_w"], p["attn_ln_b"], p["qkv_w"], p["qkv_b"], p["proj_w"], p["proj_b"])
        n = F.layer_norm(h, (c["hidden"],), peer.bf(p["ln_w"]), peer.bf(p["ln_b"]), peer.EPS)
        h = h + (moe(p, n) if peer.is_moe_block(c, block) else peer.dense_mlp(p, n))
    n = F.layer_norm(h, (c["hidden"],), peer.bf(top["ln_w"]), peer.bf(top["ln_b"]), peer.EPS)
    return F.cross_entropy(F.linear(n, peer.bf(top["head"])).float(), labels)


EXPERT_KEYS = ("w1", "b1", "w2", "b2")


class EpSetup:
    """One row's model, optimizer and batch on this rank: every expert (alone) or this rank's share under DDP."""

    def __init__(self, c, group, parallel, compiled, local_rank):
        world, rank = (group.world, group.rank) if parallel else (1, 0)
        self.c, self.world = c, world
        blocks, top, params = peer.make_params(c, seed=PARAM_SEED)
        expert_ids = set()
        first, last = local_experts(rank, world, c["experts"])
        for block, p in enumerate(blocks):
            if peer.is_moe_block(c, block):
                for key in EXPERT_KEYS:
                    p[key] = torch.nn.Parameter(p[key].detach()[first:last].clone())
                    expert_ids.add(id(p[key]))
        for block, p in enumerate(blocks):
            for key, t in p.items():
                if not isinstance(t, torch.nn.Parameter):
                    p[key] = torch.nn.Parameter(t.detach())
        top = {k: torch.nn.Parameter(t.detach()) for k, t in top.items()}
        del params
        self.params = [t for p in blocks for t in p.values()] + list(top.values())
        self.experts = [t for t in self.params if id(t) in expert_ids]
        g = torch.Generator(device="cuda")
        g.manual_seed(DATA_SEED + group.rank)  # each rank its own batch, in both rows
        self.x = peer.uniform((c["tokens"], c["hidden"]), 1.0, g).to(torch.bfloat16)
        self.labels = torch.randint(0, peer.VOCAB, (c["tokens"],), generator=g, device="cuda")
        rope = peer.rope_tables(c)
        attn = attention_residual(c, rope)
        if compiled:
            attn = torch.compile(attn)
        if parallel:
            moe = lambda p, n: ep_moe_mlp(p, n, c["topk"], world, rank, dist.group.WORLD)  # noqa: E731
        else:
            moe = lambda p, n: peer.moe_mlp(p, n, c["topk"])  # noqa: E731
        params = self.params

        class Step(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.weights = torch.nn.ParameterList(params)

            def forward(self, x, labels):
                return forward_loss(c, blocks, top, x, labels, attn, moe)

        self.module = Step()
        if parallel:
            ignored = [f"weights.{i}" for i, t in enumerate(params) if id(t) in expert_ids]
            torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(self.module,
                                                                                                   ignored)
            self.module = torch.nn.parallel.DistributedDataParallel(self.module, device_ids=[local_rank],
                                                                    gradient_as_bucket_view=True)
        self.optimizer = torch.optim.AdamW(params, lr=peer.LR, weight_decay=peer.WEIGHT_DECAY, fused=True)

    def train_step(self):
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.module(self.x, self.labels)
        loss.backward()
        if self.world > 1:
            for t in self.experts:  # their rows came from every rank: the mean over the ranks' losses
                t.grad.div_(self.world)
        self.optimizer.step()
        return loss


def build_row(c, group, parallel, compiled, local_rank):
    """pytorch_peer.build_system's tuple for one row: (run_one, extra, first losses, what to keep alive). A
    compiled row's first steps compile; their losses are its first (the first at the initial parameters, as every
    row's, so the loss checks compare like with like)."""
    start = time.perf_counter()
    s = EpSetup(c, group, parallel, compiled, local_rank)
    extra, losses = {}, []
    if compiled:
        compile_start = time.perf_counter()
        losses = [s.train_step() for _ in range(2)]
        losses = [group.global_mean(loss) if parallel else loss.item() for loss in losses]
        extra["compile_ms"] = 1000 * (time.perf_counter() - compile_start)
    extra["setup_ms"] = 1000 * (time.perf_counter() - start)
    return s.train_step, extra, losses, s


def run_ep_config(name, rows, steps, warmup, deadline, group, local_rank=0, progress=None):
    """One config's rows on every rank; the config's JSON (the same on every rank). progress(config so far), when
    given, after every row: a later row that hangs leaves the earlier ones written."""
    c = peer.CONFIGS[name]
    n = group.world
    out = peer.config_header(name)
    out.update(status="ok", reason=None, world_size=n, ep=n, experts_per_rank=c["experts"] // n,
               global_tokens=n * c["tokens"], expert_parallel_rows=True, systems=[])
    why = check_config(name, n)
    if why is not None:
        out.update(status="not_run", reason=why)
        return out
    made = {}
    for kind, (parallel, compiled) in KINDS.items():
        name_of_row = row_name(kind, n)
        if name_of_row not in rows or (parallel and n == 1):
            continue
        if not group.agree(time.perf_counter() <= deadline):  # rank 0's clock decides for all
            row = {"system": name_of_row, "status": "not_run", "reason": "the --budget-s time was spent"}
        else:
            if group.rank == 0:
                print(f"{name:7s} {name_of_row} ...", file=sys.stderr, flush=True)
            result, why = peer.run_everywhere(
                lambda: build_row(c, group, parallel, compiled, local_rank), c, steps, warmup, group,
                loss_of=group.global_mean if parallel else None, world_one=n == 1)
            if compiled and torch is not None:
                peer.reset_compiled_state()  # the next row compiles afresh
            if result is None:
                row = {"system": name_of_row, "status": "failed", "reason": why}
            else:
                made[name_of_row] = result
                baseline_name = row_name(kind.replace("epN", "ep1"), n) if parallel else None
                baseline = made.get(baseline_name) if parallel else None
                row = ep_row(name_of_row, c, n if parallel else 1, result, baseline,
                             baseline_name if baseline is not None else None)
                if parallel and baseline is None:
                    row["reason"] = f"no scaling: {baseline_name} did not run"
        out["systems"].append(row)
        if group.rank == 0:
            print(describe(name, row), file=sys.stderr, flush=True)
        if progress is not None:
            progress(out)
    compared = [row_name(k, n) for k, (parallel, _) in KINDS.items() if parallel == (n > 1)]
    firsts = {k: v["first_losses"] for k, v in made.items()}
    check = {"steps": min((len(v) for v in firsts.values()), default=0), "compared": compared, **firsts}
    if all(k in firsts for k in compared):
        a, b = firsts[compared[0]], firsts[compared[1]]
        check["max_abs_diff"] = max((abs(x - y) for x, y in zip(a, b)), default=0.0)
    out["loss_check"] = check
    out["ep_loss_check"] = {}
    for mode in (EAGER, COMPILE):
        base, parallel = made.get(row_name(f"{mode}_ep1", n)), made.get(row_name(f"{mode}_epN", n))
        if n > 1 and base is not None and parallel is not None:
            out["ep_loss_check"][mode] = ep_loss_check(base, parallel)
    if out["status"] == "ok" and not made:
        out["status"], out["reason"] = "failed", "no row ran"
    return out


def failures(result):
    """What makes the exit status 1: a config that did not run, a row that failed."""
    out = [f"{c['name']}: {c['reason']}" for c in result["configs"] if c["status"] != "ok"]
    return out + [f"{c['name']}/{s['system']}" for c in result["configs"] for s in c["systems"]
                  if s["status"] == "failed"]


def parse_flags(argv):
    """The flags, checked before torch is needed (SystemExit naming the flag)."""
    args = tp_step_peer.parse_run_flags(argv, "ep_step_peer", __doc__.split("\n")[0], "moe", CONFIGS,
                                        ["eager_ep1", "compile_ep1", "eager_epN", "compile_epN"])
    for name in args.configs.split(","):
        if name not in CONFIGS:
            raise SystemExit(f"ep_step_peer: {check_config(name, 1)}")
    args.configs = peer.parse_list(args.configs, list(CONFIGS), "config")
    kinds = peer.parse_list(args.systems or ",".join(KINDS), list(KINDS), "system")
    args.systems = [k for k in KINDS if k in kinds]  # baselines before the rows measured against them
    return args


def result_json(args, device, world, local_world, launcher):
    """The JSON's header (pytorch_peer.result_header and the expert-parallel description); configs appended later."""
    result = peer.result_header(args, device, peer.FLOPS_TEXT, "row", " (largest over the ranks)")
    result.update({
        "expert_parallel": {
            **peer_common.launch_fields(world, local_world, launcher, peer.comm_nccl_version(), peer.MULTICAST_ENV),
            "exchange": "counts all-gathered and copied to the host (.tolist()) every MoE block, all_to_all_single "
            "with those split sizes to the experts' ranks and back (the backward: the reverse exchanges), the local "
            "experts by torch._grouped_mm (a loop without it); eager: torch.cuda.graph refuses the host read",
            "dense_gradients": "DistributedDataParallel (bucketed all-reduce overlapping the backward), the experts "
            "ignored; the experts' gradients / N",
            "compile": "each block's attention half (LayerNorm, QKV, rotary, SDPA, projection, residual) under "
            "torch.compile (Inductor); the MoE half eager",
            "weak_scaling": "every rank trains the config's `tokens` per step in every row (global batch N x "
            "tokens), its own batch (seed 2 + rank)",
            "baseline": "pytorch_<mode>_ep1: every rank the whole config (every expert, pytorch_peer.moe_mlp: no "
            "host read) alone, all ranks at the same time",
            "timing": peer.DP_TIMING,
            "formulas": {"tokens_per_s": "per GPU: tokens / median step time",
                         "global_tokens_per_s": "world_size x tokens_per_s",
                         "scaling_efficiency": "median step time(ep1) / median step time(epN), same mode",
                         "exposed_comm_us": "median step time(epN) - median step time(ep1), same mode",
                         "exposed_comm_fraction": "exposed_comm_us / median step time(epN) = 1 - scaling_efficiency"},
            "goal": "step_bench's stepgraph_graph_epN >= 1.3x faster than pytorch_eager_epN (the issue's goal)",
            "rows": "benchmarks/ep_step_peer.py's docstring",
            "note": "world size 1: the ep1 rows alone; no experts are spread" if world == 1 else "",
        },
        "configs": [],
    })
    return result


def main(argv=None):
    args = parse_flags(argv)
    tp_step_peer.check_launch("ep_step_peer")
    group, local_rank, local_world, launcher, device, store_dir = peer.start_process_group(args.timeout_s,
                                                                                         "ep_step_peer")
    try:
        world, leader = group.world, group.rank == 0
        rows = [row_name(k, world) for k in args.systems]
        result = result_json(args, device, world, local_world, launcher)
        if leader:
            peer_common.print_launch(result, world, local_world, launcher, peer.comm_nccl_version(),
                                     f"expert parallel, torch._grouped_mm: {hasattr(torch, '_grouped_mm')}",
                                     result["expert_parallel"]["note"], file=sys.stderr)
        deadline = time.perf_counter() + args.budget_s

        def progress(partial):
            if leader:
                peer.save_progress(dict(result, configs=result["configs"] + [partial]), args.out)

        peer_common.run_configs(
            result, args.configs,
            lambda name: run_ep_config(name, rows, args.steps, args.warmup, deadline, group, local_rank, progress),
            leader, lambda r: peer.save_progress(r, args.out))
        wrong = peer_common.disagreements(result, "ep_loss_check", "ep_first_loss", "baseline_mean_first_loss")
        return peer.exit_status("ep_step_peer", failures(result), wrong,
                                "the expert-parallel first loss differs from the ranks' mean alone", leader)
    finally:
        peer.end_process_group(store_dir)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""The PyTorch peers of step_bench: the same configs and the same math.

    python3 benchmarks/pytorch_peer.py --out pytorch_peer.json            # all configs, all systems
    python3 benchmarks/pytorch_peer.py --quick --configs small,large      # fewer steps

The step (as StepGraph's TrainStep on a GPT-style ResidualStack): x
[tokens, hidden] bf16, `sequences` sequences of seq_len tokens packed end to
end -> N TransformerLayers, each
  h = h + MultiheadAttention(h): LayerNorm -> QKV Linear+bias [T, 3 H D]
      (per token q's H heads, then k's, then v's) -> rotary embedding of q
      and k (GPT-NeoX rotate-half over all of head_dim, base 10000, fp32,
      positions restarting per sequence) -> causal
      torch.nn.functional.scaled_dot_product_attention(is_causal=True) on
      [sequences, H, seq_len, D] views (scale 1/sqrt(D)) -> output
      projection Linear+bias
  h = h + MLP(LayerNorm(h)), MLP = Linear+bias -> GeLU(tanh) -> Linear+bias;
      MoE blocks as MoEMLP: router Linear without bias, top-k softmax gates
      renormalized over the k, stable permutation by expert,
      torch._grouped_mm over device offsets + expert bias, GeLU, again +
      bias, unpermute weighted by the gates
-> final LayerNorm -> head Linear without bias -> softmax cross-entropy
(mean, on fp32 logits) -> backward -> AdamW. Parameters are fp32 masters that
the forward casts to bf16 (so gradients and AdamW are fp32, as in StepGraph,
where the optimizer refreshes a bf16 copy instead). A config with heads 0
has MLP blocks alone.

Four systems, each from fresh parameters on one fixed batch:
  pytorch_eager          fused AdamW, zero_grad(set_to_none=True) every step
  pytorch_cuda_graph     the whole step (forward, backward, fused capturable
                         AdamW) captured once with torch.cuda.graph over
                         static inputs and replayed (PyTorch's documented
                         recipe: 3 eager steps on a side stream, grads set to
                         None, then the capture)
  pytorch_compile        the same step function under
                         torch.compile(mode="reduce-overhead") (Inductor and
                         CUDA graph trees; backward() splits it into the
                         forward/backward graph and the optimizer graph)
  pytorch_compile_graph  PyTorch's strongest recipe: the forward and loss
                         under torch.compile in default mode (Inductor;
                         AOTAutograd compiles the backward too), and the
                         whole step (compiled forward, compiled backward,
                         torch.optim.AdamW(fused=True, capturable=True))
                         captured by torch.cuda.graph after 3 warm-up steps
                         (which compile) on a side stream, grads set to None
                         before the capture; replayed

Timing as step_bench (Note [How a step is timed], step_runner.h): host wall
clock around one step followed by torch.cuda.synchronize(); median, min and
max over --steps samples after --warmup steps; pipelined_step_us: --steps
steps back to back, one synchronize. Memory: peak_bytes is
torch.cuda.max_memory_allocated during the system's run (reset before it);
device_used_delta_bytes is cudaMemGetInfo used bytes after the timed steps
minus before the system's setup. The JSON schema is step_bench's (see
docs/step_performance.md).

The config table and the FLOP count (benchmarks/model_flops.h: 6 * tokens *
matmul parameters + the causal attention core, forward 2 * 2 * (L^2 / 2) *
H * D per layer and sequence, backward 2.5x) need no torch (tests import
them).

--ddp: data parallelism, the peer of step_bench --dp (Note [Data-parallel
rows] in step_runner.h), one process per GPU:

    python3 benchmarks/pytorch_peer.py --ddp --out ddp1.json                  # one process: world size 1
    torchrun --nproc-per-node 8 benchmarks/pytorch_peer.py --ddp --out ddp8.json

Rank, world size and local rank come from torchrun, srun or mpirun variables
(comm_peer.launch_info; none set: one process of world size 1 whose process
group meets through a file store); rank r uses GPU LOCAL_RANK and trains on
its own batch of the config's tokens (seed 2 + r): weak scaling, the global
batch is N x tokens. Per config:
  pytorch_eager_dp1, pytorch_cuda_graph_dp1   the baseline: the systems above
                      (the same GPT model),
                      alone on every rank's GPU (no process group in the step),
                      all ranks at the same time
  pytorch_ddp_eager_dpN       the same model as an nn.Module wrapped in
                      torch.nn.parallel.DistributedDataParallel (NCCL,
                      bucketed all-reduce, default bucket_cap_mb,
                      gradient_as_bucket_view=True), fused AdamW,
                      zero_grad(set_to_none=True) every step
  pytorch_ddp_cuda_graph_dpN  the same whole step captured with
                      torch.cuda.graph (capture_error_mode "thread_local"),
                      PyTorch's recipe for DDP: the DDP model built on a side
                      stream, 11 eager DDP steps on it before the capture
                      (recorded on that stream too),
                      TORCH_NCCL_ASYNC_ERROR_HANDLING=0 before the process
                      group starts
At world size 1 the DDP rows run too (pytorch_ddp_*_dp1: DDP's hooks and a
one-rank NCCL all-reduce, no peer): they show DDP's own overhead and that the
capture works, not scaling. Timing, scaling_efficiency and exposed_comm_* as
step_bench's (the ranks meet with dist.barrier before each sample; a sample
is the largest over the ranks); the rows have step_bench's data-parallel
fields; rank 0 writes the JSON. NVLink multicast stays off:
NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and
NVSHMEM_DISABLE_NVLS=1 are set in os.environ (by comm_peer, on import) before
torch is imported.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from comm_peer import MULTICAST_ENV, launch_info  # noqa: E402  (sets the multicast variables before torch loads)

import argparse  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

try:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
except ImportError:  # the build machines: config table and FLOPs still work
    torch = None
    dist = None
    F = None

VOCAB = 8192
ROPE_BASE = 10000.0
PEAK_TFLOPS = 989.0
EPS = 1e-5
LR = 1e-4
WEIGHT_DECAY = 0.01
LOSS_CHECK_STEPS = 5
SYSTEMS = ("eager", "cuda_graph", "compile", "compile_graph")
GRAPH_WARMUP = 3  # eager (compile_graph: compiling) steps on a side stream before a whole-step capture
DDP_SYSTEMS = ("eager", "cuda_graph")
DDP_GRAPH_WARMUP = 11  # eager DDP steps before the capture (PyTorch's CUDA graph notes)
DP_LOSS_TOLERANCE = 1e-4  # relative: DDP's first loss against the mean of the ranks' own


def gpt(hidden, heads, layers, seq_len, sequences, experts=0, topk=2, moe_every=2):
    """A config as benchmarks/step_configs.cc's make(): ffn 4 x hidden, kv_heads = heads, tokens = sequences x
    seq_len."""
    return dict(hidden=hidden, ffn=4 * hidden, layers=layers, heads=heads, seq_len=seq_len, sequences=sequences,
                tokens=sequences * seq_len, experts=experts, topk=topk, moe_every=moe_every)


# As benchmarks/step_configs.cc: GPT-style, every block attention + MLP.
CONFIGS = {
    "small": gpt(hidden=512, heads=8, layers=8, seq_len=256, sequences=1),
    "medium": gpt(hidden=2048, heads=16, layers=8, seq_len=2048, sequences=2),
    "large": gpt(hidden=4096, heads=32, layers=4, seq_len=4096, sequences=2),
    "moe": gpt(hidden=2048, heads=16, layers=4, seq_len=4096, sequences=2, experts=8, topk=2, moe_every=1),
}
FLOPS_TEXT = ("6 * tokens * matmul parameters a token passes through (QKV, output projection, MLP or router + top-k "
              "experts, head) + the attention core: per layer and sequence of L, forward 2 * 2 * (L^2 / 2) * heads * "
              "head_dim (QK^T and PV, causal half), backward 2.5x forward (benchmarks/model_flops.h); nothing else "
              "counted")


def head_dim(c):
    return c["hidden"] // c["heads"]


def is_moe_block(c, block):
    return c["experts"] > 0 and (block + 1) % c["moe_every"] == 0


def matmul_params_per_token(c):
    """As benchmarks/model_flops.cc: matmul parameters one token passes through."""
    mlp = 2 * c["hidden"] * c["ffn"]
    attention = 4 * c["hidden"] * c["hidden"] if c["heads"] else 0  # QKV 3 H D + projection H D, H D = hidden
    params = c["hidden"] * VOCAB
    for block in range(c["layers"]):
        params += attention + (c["hidden"] * c["experts"] + c["topk"] * mlp if is_moe_block(c, block) else mlp)
    return params


def attention_core_flops(c):
    """As benchmarks/model_flops.cc (Note [Attention core FLOPs]): per layer and sequence of L, forward
    2 * 2 * (L^2 / 2) * H * D (QK^T and PV, causal half), the step 3.5x that (backward 2.5x forward)."""
    if not c["heads"]:
        return 0.0
    length = c["seq_len"]
    forward = 2.0 * 2.0 * (length * length / 2.0) * c["heads"] * head_dim(c)
    return c["layers"] * c["sequences"] * 3.5 * forward


def step_flops(c):
    return 6.0 * c["tokens"] * matmul_params_per_token(c) + attention_core_flops(c)


def result_header(args, device, flops_text, unit, over_ranks=""):
    """The keys that open every training_step JSON (this peer's and
    tp_step_peer.py's): the device, the step counts and what the numbers
    mean. `unit` names what one run is ("system", "row"); `over_ranks` says
    how ranks combine the peak memory (empty on one process)."""
    return {
        "benchmark": "training_step",
        "source": "pytorch",
        "device": torch.cuda.get_device_name(device),
        "torch_version": torch.__version__,
        "peak_tflops": PEAK_TFLOPS,
        "steps": args.steps,
        "warmup": args.warmup,
        "timing": "host wall clock around one step followed by torch.cuda.synchronize() (median, min, max over "
        "`steps` samples after `warmup` steps); pipelined_step_us: `steps` steps back to back, one synchronize",
        "flops": flops_text,
        "memory": f"peak_bytes: torch.cuda.max_memory_allocated over the {unit}'s run{over_ranks}; "
        f"device_used_delta_bytes: cudaMemGetInfo used after the timed steps minus before the {unit}'s setup",
        "optimizer": {"name": "AdamW (fused)", "lr": LR, "weight_decay": WEIGHT_DECAY},
    }


def save_progress(result, path):
    """Writes result to path (when given) after every config: a later crash keeps the earlier results."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


def failed_systems(result):
    """config/system of every system whose status is not ok."""
    return [f"{c['name']}/{s['system']}" for c in result["configs"] for s in c["systems"] if s["status"] != "ok"]


def exit_status(peer, failed, wrong=(), wrong_text="", leader=True):
    """1 when a row failed or a loss check disagrees (the leader says which on
    stderr), else 0."""
    if leader and failed:
        print(f"{peer}: failed or not run: {', '.join(failed)}", file=sys.stderr)
    if leader and wrong:
        print(f"{peer}: {wrong_text}: {', '.join(wrong)}", file=sys.stderr)
    return 1 if failed or wrong else 0


def apply_step_counts(args, peer):
    """--quick sets --steps 20 --warmup 5; both must be >= 1."""
    if args.quick:
        args.steps, args.warmup = 20, 5
    if args.steps < 1 or args.warmup < 1:
        raise SystemExit(f"{peer}: --steps and --warmup must be >= 1")


def config_header(name):
    """A config's shape and FLOPs, as step_bench's config_header_json."""
    c = CONFIGS[name]
    moe = c["experts"] > 0
    return {
        "name": name,
        "hidden": c["hidden"],
        "ffn": c["ffn"],
        "layers": c["layers"],
        "vocab": VOCAB,
        "tokens": c["tokens"],
        "heads": c["heads"],
        "kv_heads": c["heads"] if c["heads"] else None,
        "head_dim": head_dim(c) if c["heads"] else None,
        "sequences": c["sequences"],
        "seq_len": c["seq_len"],
        "experts": c["experts"],
        "topk": c["topk"] if moe else None,
        "moe_every": c["moe_every"] if moe else None,
        "dtype": "bf16",
        "matmul_params_per_token": matmul_params_per_token(c),
        "attention_core_flops_per_step": attention_core_flops(c),
        "flops_per_step": step_flops(c),
    }


def parse_list(text, known, what):
    items = text.split(",")
    for item in items:
        if item not in known:
            raise SystemExit(f"pytorch_peer: unknown {what} '{item}'; known: {', '.join(known)}")
    if len(set(items)) != len(items):
        raise SystemExit(f"pytorch_peer: a {what} is listed twice in '{text}'")
    return items


def summarize(samples_us):
    s = sorted(samples_us)
    n = len(s)
    median = s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])
    return {"median_us": median, "min_us": s[0], "max_us": s[-1]}


# --- the model (torch needed from here on) ---------------------------------


def uniform(shape, scale, generator):
    return (torch.rand(shape, generator=generator, device="cuda") * 2 - 1) * scale


def make_params(c, seed):
    """fp32 masters, initialised like StepGraph's layers (uniform +-1/sqrt(fan_in))."""
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    h, f, e = c["hidden"], c["ffn"], c["experts"]
    blocks = []
    for block in range(c["layers"]):
        p = {}
        if c["heads"]:  # the attention's parameters first, as MultiheadAttention::parameters()
            p["attn_ln_w"] = torch.ones(h, device="cuda")
            p["attn_ln_b"] = torch.zeros(h, device="cuda")
            p["qkv_w"] = uniform((3 * h, h), 1 / math.sqrt(h), g)  # [(H + 2 Hkv) D, hidden], H D = hidden
            p["qkv_b"] = uniform((3 * h,), 1 / math.sqrt(h), g)
            p["proj_w"] = uniform((h, h), 1 / math.sqrt(h), g)
            p["proj_b"] = uniform((h,), 1 / math.sqrt(h), g)
        p["ln_w"] = torch.ones(h, device="cuda")
        p["ln_b"] = torch.zeros(h, device="cuda")
        if is_moe_block(c, block):
            p["router"] = uniform((e, h), 1 / math.sqrt(h), g)
            p["w1"] = uniform((e, f, h), 1 / math.sqrt(h), g)  # [E, out, in] as GroupedLinear
            p["b1"] = uniform((e, f), 1 / math.sqrt(h), g)
            p["w2"] = uniform((e, h, f), 1 / math.sqrt(f), g)
            p["b2"] = uniform((e, h), 1 / math.sqrt(f), g)
        else:
            p["w1"] = uniform((f, h), 1 / math.sqrt(h), g)
            p["b1"] = uniform((f,), 1 / math.sqrt(h), g)
            p["w2"] = uniform((h, f), 1 / math.sqrt(f), g)
            p["b2"] = uniform((h,), 1 / math.sqrt(f), g)
        blocks.append(p)
    top = {
        "ln_w": torch.ones(h, device="cuda"),
        "ln_b": torch.zeros(h, device="cuda"),
        "head": uniform((VOCAB, h), 1 / math.sqrt(h), g),
    }
    everything = [t for p in blocks for t in p.values()] + list(top.values())
    for t in everything:
        t.requires_grad_(True)
    return blocks, top, everything


def bf(t):
    return t.to(torch.bfloat16)


def dense_mlp(p, n):
    a = F.gelu(F.linear(n, bf(p["w1"]), bf(p["b1"])), approximate="tanh")
    return F.linear(a, bf(p["w2"]), bf(p["b2"]))


def moe_mlp(p, n, topk):
    """Dropless top-k MoE, all on the device (capturable: no host reads)."""
    tokens, experts = n.shape[0], p["router"].shape[0]
    logits = F.linear(n, bf(p["router"])).float()  # [T, E]
    top_logits, chosen = torch.topk(logits, topk, dim=-1)  # [T, k], best first
    if topk == 1:
        gates = torch.softmax(logits, dim=-1).gather(1, chosen)  # p[e1]
    else:
        gates = torch.softmax(top_logits, dim=-1)  # renormalized over the k
    flat = chosen.reshape(-1)  # entry t*k+j
    order = torch.argsort(flat, stable=True)  # rows in expert order
    counts = torch.zeros(experts, dtype=torch.int64, device=n.device).scatter_add_(0, flat, torch.ones_like(flat))
    offsets = torch.cumsum(counts, 0).to(torch.int32)  # end of each expert's rows
    positions = torch.empty_like(order).scatter_(0, order, torch.arange(flat.numel(), device=n.device))
    row_expert = torch.index_select(flat, 0, order)  # each row's expert, for the biases
    x_perm = torch.index_select(n, 0, order // topk)
    pre = torch._grouped_mm(x_perm, bf(p["w1"]).transpose(-2, -1), offs=offsets)
    a = F.gelu(pre + torch.index_select(bf(p["b1"]), 0, row_expert), approximate="tanh")
    y_perm = torch._grouped_mm(a, bf(p["w2"]).transpose(-2, -1), offs=offsets)
    y_perm = y_perm + torch.index_select(bf(p["b2"]), 0, row_expert)
    y = torch.index_select(y_perm, 0, positions).view(tokens, topk, -1)
    return (y * gates.unsqueeze(-1).to(y.dtype)).sum(dim=1)


def rope_tables(c):
    """cos and sin [seq_len, D] fp32 of the rotary embedding (GPT-NeoX rotate-half over all of head_dim): position
    p, feature f and f + D/2 at angle p * base^(-2f/D), as kernels/rope.h. Every sequence starts at position 0 and
    all have seq_len tokens, so one table serves them all. None without attention."""
    if not c["heads"]:
        return None
    d = head_dim(c)
    theta = ROPE_BASE ** (-torch.arange(0, d // 2, device="cuda", dtype=torch.float32) * 2.0 / d)
    angles = torch.arange(c["seq_len"], device="cuda", dtype=torch.float32)[:, None] * theta[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate(t, rope):
    """t [S, H, L, D] bf16 rotated in fp32 (out[f] = t[f] cos - t[f + D/2] sin, out[f + D/2] = t[f + D/2] cos +
    t[f] sin), back to bf16."""
    cos, sin = rope
    x = t.float()
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat([-x2, x1], dim=-1) * sin).to(t.dtype)


def attention(c, p, n, rope):
    """MultiheadAttention without the residual: n = LayerNorm(h) [T, hidden] -> QKV -> rotary -> causal SDPA per
    sequence -> output projection."""
    s, length, heads = c["sequences"], c["seq_len"], c["heads"]
    d = head_dim(c)
    qkv = F.linear(n, bf(p["qkv_w"]), bf(p["qkv_b"])).view(s, length, 3 * heads, d)  # q's heads, k's, v's
    q, k, v = (t.transpose(1, 2) for t in qkv.split(heads, dim=2))  # [S, H, L, D] views
    out = F.scaled_dot_product_attention(rotate(q, rope), rotate(k, rope), v, is_causal=True)
    out = out.transpose(1, 2).reshape(s * length, heads * d)
    return F.linear(out, bf(p["proj_w"]), bf(p["proj_b"]))


def forward_loss(c, blocks, top, x, labels, rope=None):
    """The step's loss; rope: rope_tables(c) (made here when not given)."""
    if c["heads"] and rope is None:
        rope = rope_tables(c)
    h = x
    for block, p in enumerate(blocks):
        if c["heads"]:
            n = F.layer_norm(h, (c["hidden"],), bf(p["attn_ln_w"]), bf(p["attn_ln_b"]), EPS)
            h = h + attention(c, p, n, rope)
        n = F.layer_norm(h, (c["hidden"],), bf(p["ln_w"]), bf(p["ln_b"]), EPS)
        h = h + (moe_mlp(p, n, c["topk"]) if is_moe_block(c, block) else dense_mlp(p, n))
    n = F.layer_norm(h, (c["hidden"],), bf(top["ln_w"]), bf(top["ln_b"]), EPS)
    logits = F.linear(n, bf(top["head"]))
    return F.cross_entropy(logits.float(), labels)


def step_module(c, blocks, top, params, rope=None):
    """The step's forward as an nn.Module over `params` (nn.Parameters, in
    make_params' order: DDP buckets them in reverse, the order the backward
    finishes them)."""

    class StepModule(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weights = torch.nn.ParameterList(params)

        def forward(self, x, labels):
            return forward_loss(c, blocks, top, x, labels, rope)

    return StepModule()


class Setup:
    """Fresh parameters, optimizer and the fixed batch of one system; with
    `ddp_device` the model is an nn.Module wrapped in DistributedDataParallel
    (default bucket size, gradient_as_bucket_view=True)."""

    def __init__(self, c, capturable, data_seed=2, ddp_device=None):
        self.c = c
        self.blocks, self.top, self.params = make_params(c, seed=1)
        g = torch.Generator(device="cuda")
        g.manual_seed(data_seed)
        self.x = uniform((c["tokens"], c["hidden"]), 1.0, g).to(torch.bfloat16)
        self.labels = torch.randint(0, VOCAB, (c["tokens"],), generator=g, device="cuda")
        self.rope = rope_tables(c)  # made once, as a model's rotary cache
        self.ddp = None
        if ddp_device is not None:
            # The same tensors as nn.Parameters, the very objects the forward reads, so that DDP's hooks see them.
            as_param = {id(t): torch.nn.Parameter(t.detach()) for t in self.params}
            self.blocks = [{k: as_param[id(t)] for k, t in p.items()} for p in self.blocks]
            self.top = {k: as_param[id(t)] for k, t in self.top.items()}
            self.params = [as_param[id(t)] for t in self.params]
            module = step_module(c, self.blocks, self.top, self.params, self.rope)
            self.ddp = torch.nn.parallel.DistributedDataParallel(
                module, device_ids=[ddp_device], gradient_as_bucket_view=True
            )
        self.optimizer = torch.optim.AdamW(
            self.params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True, capturable=capturable
        )
        self.loss_fn = None  # compile_graph: the compiled forward_loss

    def forward_loss(self):
        if self.loss_fn is not None:
            return self.loss_fn(self.x, self.labels)
        return forward_loss(self.c, self.blocks, self.top, self.x, self.labels, self.rope)

    def train_step(self):
        """One step; returns the loss tensor (no host read)."""
        loss = self.ddp(self.x, self.labels) if self.ddp is not None else self.forward_loss()
        loss.backward()
        self.optimizer.step()
        return loss


def capture_whole_step(s, start, **graph_args):
    """Captures one whole training step of `s` into a CUDA graph (torch.cuda.graph with `graph_args`) after its
    warm-up; returns the replaying step function, the capture timings (`start`: when the system began to be
    built) and the graph."""
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    capture_start = time.perf_counter()
    with torch.cuda.graph(graph, **graph_args):
        static_loss = s.train_step()
    torch.cuda.synchronize()
    capture_ms = 1000 * (time.perf_counter() - capture_start)

    def run_one():
        graph.replay()
        return static_loss

    extra = {"capture_ms": {"capture_plus_instantiate": capture_ms, "wall": 1000 * (time.perf_counter() - start)}}
    return run_one, extra, graph


def warm_up_and_capture(s, start, **graph_args):
    """PyTorch's recipe for a whole-step graph of `s` (a Setup, or any object with optimizer and train_step()):
    GRAPH_WARMUP eager steps on a side stream (with a compiled forward: the compilation), grads set to None, then
    the capture (capture_whole_step with `graph_args`). Returns build_system's tuple; extra gets the warm-up's
    milliseconds as "warmup_ms"."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    losses = []
    warmup_start = time.perf_counter()
    with torch.cuda.stream(side):  # warm-up on a side stream, as the recipe asks
        for _ in range(GRAPH_WARMUP):
            s.optimizer.zero_grad(set_to_none=True)
            losses.append(s.train_step())
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    losses = [loss.item() for loss in losses]  # capture runs nothing: replay 1 is step GRAPH_WARMUP + 1
    warmup_ms = 1000 * (time.perf_counter() - warmup_start)
    s.optimizer.zero_grad(set_to_none=True)  # the capture's backward allocates the grads from its pool
    run_one, extra, graph = capture_whole_step(s, start, **graph_args)
    extra["warmup_ms"] = warmup_ms
    return run_one, extra, losses, (s, graph)


def build_system(system, c, data_seed=2):
    """Returns (run_one, extra JSON, the losses of the steps setup ran, what to
    keep alive); run_one() -> the loss tensor."""
    start = time.perf_counter()
    if system == "eager":
        s = Setup(c, capturable=False, data_seed=data_seed)

        def run_one():
            s.optimizer.zero_grad(set_to_none=True)
            return s.train_step()

        return run_one, {}, [], s

    if system == "cuda_graph":
        return warm_up_and_capture(Setup(c, capturable=True, data_seed=data_seed), start)

    if system == "compile":
        s = Setup(c, capturable=True)
        # Fixed addresses, so the CUDA graph trees never copy them in per replay.
        for t in s.params + [s.x, s.labels] + list(s.rope or ()):
            torch._dynamo.mark_static_address(t)
        compiled = torch.compile(s.train_step, mode="reduce-overhead")

        def run_one():
            torch.compiler.cudagraph_mark_step_begin()
            s.optimizer.zero_grad(set_to_none=True)
            return compiled()

        compile_start = time.perf_counter()
        losses = [run_one().item() for _ in range(3)]  # compiles, records the CUDA graph trees, replays
        extra = {"compile_ms": 1000 * (time.perf_counter() - compile_start)}
        return run_one, extra, losses, s

    if system == "compile_graph":
        # PyTorch's strongest recipe: the forward and loss under torch.compile (default mode: Inductor kernels, no
        # CUDA graph of its own; AOTAutograd compiles the backward), the whole step captured by torch.cuda.graph.
        s = Setup(c, capturable=True, data_seed=data_seed)
        blocks, top, rope = s.blocks, s.top, s.rope
        s.loss_fn = torch.compile(lambda x, labels: forward_loss(c, blocks, top, x, labels, rope))
        return warm_up_and_capture(s, start)
    raise ValueError(system)


def reset_compiled_state():
    """Drops compiled code and the CUDA graph trees' memory before the next config."""
    torch._dynamo.reset()
    try:
        from torch._inductor import cudagraph_trees

        cudagraph_trees.reset_cudagraph_trees()
    except (ImportError, AttributeError):
        pass


def device_used_bytes():
    free, total = torch.cuda.mem_get_info()
    return total - free


def fresh_memory():
    """Frees what earlier systems left, resets the peak; the device bytes in use now."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return device_used_bytes()


def time_system(built, steps, warmup, used_before, meet=None, loss_of=None):
    """Times a built system (build_system's tuple): this rank's raw numbers.
    meet(): the ranks' barrier before each timed sample and before the
    pipelined steps (data parallel); loss_of(tensor): the loss reported (the
    global mean under DDP), float(loss) by default."""
    run_one, extra, first_losses, _ = built
    loss_of = loss_of or (lambda t: t.item())
    first_losses = first_losses[:LOSS_CHECK_STEPS]
    loss = None
    for _ in range(warmup):
        loss = run_one()
        if len(first_losses) < LOSS_CHECK_STEPS:
            first_losses.append(loss_of(loss))
    torch.cuda.synchronize()
    samples = []
    for _ in range(steps):
        if meet:
            meet()
        start = time.perf_counter()
        loss = run_one()
        torch.cuda.synchronize()
        samples.append(1e6 * (time.perf_counter() - start))
    if meet:
        meet()
    start = time.perf_counter()
    for _ in range(steps):
        loss = run_one()
    torch.cuda.synchronize()
    pipelined_us = 1e6 * (time.perf_counter() - start) / steps
    final_loss = loss_of(loss)
    if not math.isfinite(final_loss):
        raise RuntimeError(f"the loss after {warmup + 2 * steps} steps is not finite ({final_loss})")
    return {
        "samples_us": samples,
        "pipelined_step_us": pipelined_us,
        "peak_bytes": torch.cuda.max_memory_allocated(),
        "device_used_delta_bytes": device_used_bytes() - used_before,
        "final_loss": final_loss,
        "first_losses": first_losses,
        "extra": extra,
    }


def system_json(name, c, raw):
    """A system's row from its raw numbers (time_system's, or combine_ranks')."""
    step_us = summarize(raw["samples_us"])
    median_s = step_us["median_us"] * 1e-6
    tflops = step_flops(c) / median_s / 1e12
    result = {
        "system": name,
        "status": "ok",
        "reason": None,
        "step_us": step_us,
        "pipelined_step_us": raw["pipelined_step_us"],
        "tokens_per_s": c["tokens"] / median_s,
        "tflops": tflops,
        "mfu": tflops / PEAK_TFLOPS,
        "peak_bytes": raw["peak_bytes"],
        "device_used_delta_bytes": raw["device_used_delta_bytes"],
        "final_loss": raw["final_loss"],
        "first_losses": raw["first_losses"],
    }
    result.update(raw["extra"])
    return result


def run_system(system, c, steps, warmup):
    used_before = fresh_memory()
    built = build_system(system, c)
    result = system_json("pytorch_" + system, c, time_system(built, steps, warmup, used_before))
    del built
    return result


def run_config(name, systems, steps, warmup, deadline):
    c = CONFIGS[name]
    out = config_header(name)
    out["status"] = "ok"
    out["reason"] = None
    out["systems"] = []
    for system in systems:
        start = time.perf_counter()
        if start > deadline:
            result = {"system": "pytorch_" + system, "status": "not_run", "reason": "the --budget-s time was spent"}
        else:
            try:
                result = run_system(system, c, steps, warmup)
            except Exception as error:  # one system's failure must not stop the others
                reason = f"{type(error).__name__}: {error}"[:2000]
                result = {"system": "pytorch_" + system, "status": "failed", "reason": reason}
            if system in ("compile", "compile_graph"):
                reset_compiled_state()
            result["wall_s"] = time.perf_counter() - start  # set-up, compile and every step
        out["systems"].append(result)
        print(describe(name, result), flush=True)
    if all(s["status"] != "ok" for s in out["systems"]):
        out["status"] = "failed"
        out["reason"] = "no system ran"
    firsts = {s["system"]: s["first_losses"] for s in out["systems"] if s["status"] == "ok"}
    if firsts:
        n = min(len(v) for v in firsts.values())
        spread = max((max(v[i] for v in firsts.values()) - min(v[i] for v in firsts.values()) for i in range(n)), default=0.0)
        out["loss_check"] = {"steps": n, **firsts, "max_abs_diff": spread}
    return out


def describe(name, r):
    if r["status"] != "ok":
        return f"{name:7s} {r['system']}: {r['status']}: {r['reason'][:300]}"
    s = r["step_us"]
    return (
        f"{name:7s} {r['system']:21s} {s['median_us'] / 1000:.3f} ms [{s['min_us'] / 1000:.3f}-{s['max_us'] / 1000:.3f}]"
        f"  {r['tflops']:.1f} TFLOP/s (MFU {100 * r['mfu']:.1f}%)  peak {r['peak_bytes'] / 2**20:.1f} MiB"
        f"  ({r['wall_s']:.0f} s in all)"
    )


# --- data parallelism (--ddp; the peer of step_bench --dp) ------------------

DP_SCALING_KEYS = (
    "baseline_system",
    "scaling_efficiency",
    "pipelined_scaling_efficiency",
    "exposed_comm_us",
    "exposed_comm_fraction",
    "pipelined_exposed_comm_us",
    "pipelined_exposed_comm_fraction",
)
DP_FORMULAS = {
    "tokens_per_s": "per GPU: tokens / median step time",
    "global_tokens_per_s": "world_size x tokens_per_s",
    "scaling_efficiency": "tokens_per_s(dpN) / tokens_per_s(dp1), same mode",
    "exposed_comm_us": "median step time(dpN) - median step time(dp1), same mode",
    "exposed_comm_fraction": "exposed_comm_us / median step time(dpN) = 1 - scaling_efficiency",
}
DP_TIMING = (
    "the ranks meet (dist.barrier) before each timed sample; a sample is the largest over the ranks of their step + "
    "synchronize; pipelined: the largest over the ranks of `steps` steps and one synchronize, / steps"
)


def dp_name(system, world, ddp):
    """pytorch_eager_dp1 (alone), pytorch_ddp_cuda_graph_dp8 (under DDP)."""
    return f"pytorch_{'ddp_' if ddp else ''}{system}_dp{world}"


def combine_ranks(raws):
    """One system's raw numbers from every rank (time_system's, rank order):
    samples and pipelined time the largest over the ranks, sample by sample;
    memory the largest; losses, extra fields rank 0's; each rank's median and
    first loss."""
    counts = {len(r["samples_us"]) for r in raws}
    if len(counts) != 1:
        raise RuntimeError(f"the ranks timed different numbers of steps: {sorted(counts)}")
    deltas = [r["device_used_delta_bytes"] for r in raws]
    return {
        "samples_us": [max(values) for values in zip(*(r["samples_us"] for r in raws))],
        "pipelined_step_us": max(r["pipelined_step_us"] for r in raws),
        "peak_bytes": max(r["peak_bytes"] for r in raws),
        "device_used_delta_bytes": None if None in deltas else max(deltas),
        "final_loss": raws[0]["final_loss"],
        "first_losses": raws[0]["first_losses"],
        "extra": raws[0]["extra"],
        "rank_median_us": [summarize(r["samples_us"])["median_us"] for r in raws],
        "rank_first_loss": [r["first_losses"][0] if r["first_losses"] else None for r in raws],
    }


def dp_row(name, c, world, dp_mode, combined, baseline=None, baseline_name=None):
    """A data-parallel row: system_json per GPU plus step_bench's data-parallel
    fields (Note [Data-parallel rows] in benchmarks/step_runner.h)."""
    row = system_json(name, c, combined)
    row["world_size"] = world
    row["dp_mode"] = dp_mode
    row["rank_median_us"] = combined["rank_median_us"]
    row["global_tokens_per_s"] = world * row["tokens_per_s"]
    scaling = dict.fromkeys(DP_SCALING_KEYS)
    if baseline is not None:
        median, pipelined = row["step_us"]["median_us"], row["pipelined_step_us"]
        base, base_pipelined = summarize(baseline["samples_us"])["median_us"], baseline["pipelined_step_us"]
        scaling.update(
            baseline_system=baseline_name,
            scaling_efficiency=base / median,
            pipelined_scaling_efficiency=base_pipelined / pipelined,
            exposed_comm_us=median - base,
            exposed_comm_fraction=(median - base) / median,
            pipelined_exposed_comm_us=pipelined - base_pipelined,
            pipelined_exposed_comm_fraction=(pipelined - base_pipelined) / pipelined,
        )
    row.update(scaling)
    return row


def dp_loss_check(baseline, dp):
    """The data-parallel first loss against the mean of the ranks' first losses alone."""
    losses = baseline["rank_first_loss"]
    mean = sum(losses) / len(losses)
    got = dp["first_losses"][0] if dp["first_losses"] else float("nan")
    diff = abs(got - mean)
    return {
        "baseline_rank_first_losses": losses,
        "baseline_mean_first_loss": mean,
        "dp_first_loss": got,
        "abs_diff": diff,
        "agrees": diff <= DP_LOSS_TOLERANCE * max(1.0, abs(mean)),
    }


class Group:
    """The ranks of the process group, for what the benchmark itself needs."""

    def __init__(self, rank, world):
        self.rank, self.world = rank, world

    def gather(self, value):
        out = [None] * self.world
        dist.all_gather_object(out, value)
        return out

    def agree(self, value):
        """Rank 0's value on every rank."""
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def meet(self):
        dist.barrier()
        torch.cuda.synchronize()

    def global_mean(self, loss):
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        return total.item() / self.world


def build_ddp_system(system, c, group, local_rank):
    """As build_system, the model under DDP and rank r's batch (seed 2 + r);
    losses are global means."""
    start = time.perf_counter()
    if system == "eager":
        s = Setup(c, capturable=False, data_seed=2 + group.rank, ddp_device=local_rank)

        def run_one():
            s.optimizer.zero_grad(set_to_none=True)
            return s.train_step()

        return run_one, {}, [], s
    if system != "cuda_graph":
        raise ValueError(system)
    # PyTorch's recipe for DDP under a whole-step graph: DDP built on a side
    # stream, DDP_GRAPH_WARMUP eager steps there, then the capture (here on that stream too).
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    losses = []
    with torch.cuda.stream(side):
        s = Setup(c, capturable=True, data_seed=2 + group.rank, ddp_device=local_rank)
        for _ in range(DDP_GRAPH_WARMUP):
            s.optimizer.zero_grad(set_to_none=True)
            losses.append(s.train_step())
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    losses = [group.global_mean(loss) for loss in losses[:LOSS_CHECK_STEPS]]
    s.optimizer.zero_grad(set_to_none=True)
    # Captured on the stream DDP was built and warmed up on: DDP keeps the
    # gradient accumulators it made there, and autograd warns (and may add
    # synchronization) when the backward runs on another stream.
    run_one, extra, graph = capture_whole_step(s, start, stream=side, capture_error_mode="thread_local")
    return run_one, extra, losses, (s, graph)


def run_everywhere(build, c, steps, warmup, group, loss_of=None, world_one=False):
    """Builds a system on every rank, checks that every rank could, times it
    with the ranks meeting before each sample, and combines the ranks'
    numbers. Returns (combined, None) or (None, why). A failure while timing
    ends the process at world size > 1 (the ranks could be in different
    collectives); at world size 1 it is a failed row."""
    start = time.perf_counter()
    used_before = fresh_memory()
    built, error = None, None
    try:
        built = build()
    except Exception as e:  # a capture DDP refuses, say: every rank says so before anything is timed
        error = f"{type(e).__name__}: {e}"[:2000]
    errors = group.gather(error)
    if any(errors):
        del built
        return None, "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
    try:
        raw = time_system(built, steps, warmup, used_before, meet=group.meet, loss_of=loss_of)
    except Exception as e:
        if not world_one:
            raise
        return None, f"{type(e).__name__}: {e}"[:2000]
    finally:
        del built
    raw["extra"] = dict(raw["extra"], wall_s=time.perf_counter() - start)
    return combine_ranks(group.gather(raw)), None


def run_dp_config(name, systems, steps, warmup, deadline, group, local_rank):
    """One config's data-parallel rows: each system alone on every rank
    (dp1, the baseline), then under DDP at the world's size."""
    c = CONFIGS[name]
    n = group.world
    out = config_header(name)
    out.update(status="ok", reason=None, world_size=n, global_tokens=n * c["tokens"], dp_mode="ddp")
    out["systems"] = []
    combined = {}
    plan = [(system, False) for system in systems] + [(system, True) for system in systems]
    for system, ddp in plan:
        row_name = dp_name(system, n if ddp else 1, ddp)
        if not group.agree(time.perf_counter() <= deadline):  # rank 0's clock decides for all
            row = {"system": row_name, "status": "not_run", "reason": "the --budget-s time was spent"}
        else:
            if ddp:
                result, why = run_everywhere(
                    lambda: build_ddp_system(system, c, group, local_rank), c, steps, warmup, group,
                    loss_of=group.global_mean, world_one=n == 1)
            else:
                result, why = run_everywhere(
                    lambda: build_system(system, c, data_seed=2 + group.rank), c, steps, warmup, group,
                    world_one=n == 1)
            if result is None:
                row = {"system": row_name, "status": "failed", "reason": why}
            else:
                combined[row_name] = result
                baseline_name = dp_name(system, 1, False)
                baseline = combined.get(baseline_name) if ddp else None
                row = dp_row(row_name, c, n if ddp else 1, "ddp" if ddp else None, result, baseline,
                             baseline_name if baseline is not None else None)
                if ddp and baseline is None:
                    row["reason"] = f"no scaling: {baseline_name} did not run"
        out["systems"].append(row)
        if group.rank == 0:
            print(describe(name, row), flush=True)
    if all(r["status"] != "ok" for r in out["systems"]):
        out["status"], out["reason"] = "failed", "no system ran"
    compared = [dp_name(system, n, True) for system in DDP_SYSTEMS]
    firsts = {k: v["first_losses"] for k, v in combined.items()}
    check = {"steps": min((len(v) for v in firsts.values()), default=0), "compared": compared, **firsts}
    if all(k in firsts for k in compared):
        a, b = firsts[compared[0]], firsts[compared[1]]
        check["identical"] = a == b
        check["max_abs_diff"] = max((abs(x - y) for x, y in zip(a, b)), default=0.0)
    out["loss_check"] = check
    out["dp_loss_check"] = {}
    for system in systems:
        base, dp = combined.get(dp_name(system, 1, False)), combined.get(dp_name(system, n, True))
        if base is not None and dp is not None:
            out["dp_loss_check"]["eager" if system == "eager" else "graph"] = dp_loss_check(base, dp)
    return out


def start_process_group(timeout_s, who="pytorch_peer"):
    """Joins the launch's NCCL process group (torchrun, srun or mpirun variables; none: one process of world size
    1 meeting through a file store of its own) on GPU LOCAL_RANK. Returns (Group, local_rank, local_world,
    launcher, device, store_dir); end_process_group(store_dir) leaves it."""
    rank, world, local_rank, local_world, launcher, init_method = launch_info()
    if local_rank >= torch.cuda.device_count():
        raise SystemExit(f"{who}: local rank {local_rank} but this host has {torch.cuda.device_count()} "
                         "GPU(s): start at most one rank per GPU")
    # PyTorch's notes for collectives under a whole-step CUDA graph; set before the process group starts.
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    store_dir = None
    if init_method is None:  # one process: a file store of its own
        store_dir = tempfile.mkdtemp(prefix=f"{who}_")
        init_method = f"file://{store_dir}/store"
    dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world, device_id=device,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return Group(rank, world), local_rank, local_world, launcher, device, store_dir


def end_process_group(store_dir):
    dist.destroy_process_group()
    if store_dir is not None:
        shutil.rmtree(store_dir, ignore_errors=True)


def run_ddp(args, configs, systems):
    """main() for --ddp: joins the process group, runs every config, rank 0 writes the JSON."""
    group, local_rank, local_world, launcher, device, store_dir = start_process_group(args.timeout_s)
    try:
        rank, world = group.rank, group.world
        leader = rank == 0
        note = ("world size 1: the dp1 rows are the baseline of a run at N > 1; pytorch_ddp_*_dp1 run DDP with no peer "
                "(its hooks and a one-rank NCCL all-reduce): DDP's own overhead and a check that the capture works, "
                "not scaling") if world == 1 else ""
        result = result_header(args, device, FLOPS_TEXT, "system", " (largest over the ranks)")
        result.update({
            "data_parallel": {
                "world_size": world,
                "local_world_size": local_world,
                "launcher": launcher,
                "dp_mode": "ddp",
                "ddp": {
                    "bucket_cap_mb": "default (25)",
                    "gradient_as_bucket_view": True,
                    "zero_grad": "set_to_none=True every step (eager); once before the capture (graph)",
                    "graph_recipe": f"DDP built on a side stream, {DDP_GRAPH_WARMUP} eager steps and the capture "
                    "there, capture_error_mode thread_local, TORCH_NCCL_ASYNC_ERROR_HANDLING=0",
                },
                "nccl_version": comm_nccl_version(),
                "multicast_env": MULTICAST_ENV,
                "weak_scaling": "every rank trains the config's `tokens` per step at every world size: global batch "
                "N x tokens",
                "baseline": "pytorch_<system>_dp1: every rank runs the system without DDP alone on its own GPU, all "
                "ranks at the same time",
                "timing": DP_TIMING,
                "formulas": DP_FORMULAS,
                "note": note,
            },
            "configs": [],
        })
        if leader:
            how = f"rank 0 of {world} ({local_world} per host) via {launcher}" if launcher != "none" else "one process"
            print(f"device: {result['device']}, torch {torch.__version__}, NCCL {comm_nccl_version()}; {how}; DDP",
                  flush=True)
            if note:
                print(f"NOTE: {note}", flush=True)
        deadline = time.perf_counter() + args.budget_s
        for name in configs:
            result["configs"].append(run_dp_config(name, systems, args.steps, args.warmup, deadline, group,
                                                   local_rank))
            if leader:
                save_progress(result, args.out)
        failed = failed_systems(result)
        wrong = [f"{c['name']}/{mode}" for c in result["configs"] for mode, d in c["dp_loss_check"].items()
                 if not d["agrees"]]
        return exit_status("pytorch_peer", failed, wrong, "DDP's first loss differs from the ranks' mean alone", leader)
    finally:
        end_process_group(store_dir)


def comm_nccl_version():
    version = torch.cuda.nccl.version()
    if isinstance(version, int):  # older torch: 22803
        version = (version // 10000, version // 100 % 100, version % 100)
    return ".".join(str(v) for v in version[:3])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="small,medium,large,moe")
    parser.add_argument("--systems", help="eager, cuda_graph, compile, compile_graph (default all; with --ddp: eager, "
                        "cuda_graph)")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per system")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first (after capture or compile)")
    parser.add_argument("--quick", action="store_true", help="--steps 20 --warmup 5")
    parser.add_argument(
        "--budget-s", type=float, default=900, help="start no system after this many seconds (it is then not_run)"
    )
    parser.add_argument(
        "--ddp",
        action="store_true",
        help="data parallel over the launch's ranks (torchrun/srun/mpirun; one process: world size 1): each system "
        "alone on every GPU, then under DistributedDataParallel (systems eager, cuda_graph)",
    )
    parser.add_argument("--timeout-s", type=int, default=300, help="with --ddp: torch.distributed's timeout")
    parser.add_argument("--out", help="write the results as JSON here (with --ddp: rank 0)")
    args = parser.parse_args(argv)
    apply_step_counts(args, "pytorch_peer")
    configs = parse_list(args.configs, list(CONFIGS), "config")
    if args.ddp:
        systems = parse_list(args.systems or ",".join(DDP_SYSTEMS), list(DDP_SYSTEMS), "system (with --ddp)")
        if args.timeout_s <= 0:
            raise SystemExit(f"pytorch_peer: --timeout-s must be positive, got {args.timeout_s}")
        try:
            launch_info()  # bad launcher variables before torch is needed
        except ValueError as error:
            raise SystemExit(f"pytorch_peer: {error}")
    else:
        systems = parse_list(args.systems or ",".join(SYSTEMS), list(SYSTEMS), "system")
    if torch is None:
        raise SystemExit("pytorch_peer: PyTorch is not installed here (run it on the GPU machine)")
    if not torch.cuda.is_available():
        raise SystemExit("pytorch_peer: no CUDA device (torch.cuda.is_available() is False)")
    if args.ddp:
        return run_ddp(args, configs, systems)
    result = result_header(args, 0, FLOPS_TEXT, "system")
    result["configs"] = []
    print(f"device: {result['device']}, torch {torch.__version__}", flush=True)
    deadline = time.perf_counter() + args.budget_s
    for name in configs:
        result["configs"].append(run_config(name, systems, args.steps, args.warmup, deadline))
        save_progress(result, args.out)
    return exit_status("pytorch_peer", failed_systems(result))


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""The PyTorch peers of step_bench: the same configs and the same math.

    python3 benchmarks/pytorch_peer.py --out pytorch_peer.json            # all configs, all systems
    python3 benchmarks/pytorch_peer.py --quick --configs small,large      # fewer steps

The step (as StepGraph's TrainStep): x [tokens, hidden] bf16 -> N residual
blocks h = h + MLP(LayerNorm(h)) with MLP = Linear+bias -> GeLU(tanh) ->
Linear+bias; MoE blocks as MoEMLP: router Linear without bias, top-k
softmax gates renormalized over the k, stable permutation by expert,
torch._grouped_mm over device offsets + expert bias, GeLU, again + bias,
unpermute weighted by the gates) -> final LayerNorm -> head Linear without
bias -> softmax cross-entropy (mean, on fp32 logits) -> backward -> AdamW. Parameters are
fp32 masters that the forward casts to bf16 (so gradients and AdamW are
fp32, as in StepGraph, where the optimizer refreshes a bf16 copy instead).

Three systems, each from fresh parameters on one fixed batch:
  pytorch_eager       fused AdamW, zero_grad(set_to_none=True) every step
  pytorch_cuda_graph  the whole step (forward, backward, fused capturable
                      AdamW) captured once with torch.cuda.graph over static
                      inputs and replayed (PyTorch's documented recipe)
  pytorch_compile     the same step function under
                      torch.compile(mode="reduce-overhead") (Inductor and
                      CUDA graph trees; backward() splits it into the
                      forward/backward graph and the optimizer graph)

Timing as step_bench (Note [How a step is timed], step_runner.h): host wall
clock around one step followed by torch.cuda.synchronize(); median, min and
max over --steps samples after --warmup steps; pipelined_step_us: --steps
steps back to back, one synchronize. Memory: peak_bytes is
torch.cuda.max_memory_allocated during the system's run (reset before it);
device_used_delta_bytes is cudaMemGetInfo used bytes after the timed steps
minus before the system's setup. The JSON schema is step_bench's (see
benchmarks/README.md).

The config table and the FLOP count need no torch (tests import them).
"""

import argparse
import gc
import json
import math
import sys
import time

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # the build machines: config table and FLOPs still work
    torch = None
    F = None

VOCAB = 8192
PEAK_TFLOPS = 989.0
EPS = 1e-5
LR = 1e-4
WEIGHT_DECAY = 0.01
LOSS_CHECK_STEPS = 5
SYSTEMS = ("eager", "cuda_graph", "compile")

# name: hidden, ffn, layers, tokens, experts, topk, moe_every (as benchmarks/step_configs.cc)
CONFIGS = {
    "small": dict(hidden=512, ffn=2048, layers=8, tokens=256, experts=0, topk=2, moe_every=2),
    "medium": dict(hidden=2048, ffn=8192, layers=8, tokens=4096, experts=0, topk=2, moe_every=2),
    "large": dict(hidden=4096, ffn=16384, layers=4, tokens=8192, experts=0, topk=2, moe_every=2),
    "moe": dict(hidden=2048, ffn=8192, layers=4, tokens=8192, experts=8, topk=2, moe_every=1),
}


def is_moe_block(c, block):
    return c["experts"] > 0 and (block + 1) % c["moe_every"] == 0


def matmul_params_per_token(c):
    """As benchmarks/model_flops.cc: matmul parameters one token passes through."""
    mlp = 2 * c["hidden"] * c["ffn"]
    params = c["hidden"] * VOCAB
    for block in range(c["layers"]):
        params += c["hidden"] * c["experts"] + c["topk"] * mlp if is_moe_block(c, block) else mlp
    return params


def step_flops(c):
    return 6.0 * c["tokens"] * matmul_params_per_token(c)


def config_header(name):
    c = CONFIGS[name]
    moe = c["experts"] > 0
    return {
        "name": name,
        "hidden": c["hidden"],
        "ffn": c["ffn"],
        "layers": c["layers"],
        "vocab": VOCAB,
        "tokens": c["tokens"],
        "experts": c["experts"],
        "topk": c["topk"] if moe else None,
        "moe_every": c["moe_every"] if moe else None,
        "dtype": "bf16",
        "matmul_params_per_token": matmul_params_per_token(c),
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
        p = {"ln_w": torch.ones(h, device="cuda"), "ln_b": torch.zeros(h, device="cuda")}
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


def forward_loss(c, blocks, top, x, labels):
    h = x
    for block, p in enumerate(blocks):
        n = F.layer_norm(h, (c["hidden"],), bf(p["ln_w"]), bf(p["ln_b"]), EPS)
        h = h + (moe_mlp(p, n, c["topk"]) if is_moe_block(c, block) else dense_mlp(p, n))
    n = F.layer_norm(h, (c["hidden"],), bf(top["ln_w"]), bf(top["ln_b"]), EPS)
    logits = F.linear(n, bf(top["head"]))
    return F.cross_entropy(logits.float(), labels)


class Setup:
    """Fresh parameters, optimizer and the fixed batch of one system."""

    def __init__(self, c, capturable):
        self.c = c
        self.blocks, self.top, self.params = make_params(c, seed=1)
        g = torch.Generator(device="cuda")
        g.manual_seed(2)
        self.x = uniform((c["tokens"], c["hidden"]), 1.0, g).to(torch.bfloat16)
        self.labels = torch.randint(0, VOCAB, (c["tokens"],), generator=g, device="cuda")
        self.optimizer = torch.optim.AdamW(
            self.params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True, capturable=capturable
        )

    def train_step(self):
        """One step; returns the loss tensor (no host read)."""
        loss = forward_loss(self.c, self.blocks, self.top, self.x, self.labels)
        loss.backward()
        self.optimizer.step()
        return loss


def build_system(system, c):
    """Returns (run_one, extra JSON, the losses of the steps setup ran, what to
    keep alive); run_one() -> the loss tensor."""
    start = time.perf_counter()
    if system == "eager":
        s = Setup(c, capturable=False)

        def run_one():
            s.optimizer.zero_grad(set_to_none=True)
            return s.train_step()

        return run_one, {}, [], s

    if system == "cuda_graph":
        s = Setup(c, capturable=True)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        losses = []
        with torch.cuda.stream(side):  # warm-up on a side stream, as the recipe asks
            for _ in range(3):
                s.optimizer.zero_grad(set_to_none=True)
                losses.append(s.train_step())
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        losses = [loss.item() for loss in losses]  # capture runs nothing: replay 1 is step 4
        s.optimizer.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        capture_start = time.perf_counter()
        with torch.cuda.graph(graph):
            static_loss = s.train_step()
        torch.cuda.synchronize()
        capture_ms = 1000 * (time.perf_counter() - capture_start)

        def run_one():
            graph.replay()
            return static_loss

        extra = {"capture_ms": {"capture_plus_instantiate": capture_ms, "wall": 1000 * (time.perf_counter() - start)}}
        return run_one, extra, losses, (s, graph)

    if system == "compile":
        s = Setup(c, capturable=True)
        # Fixed addresses, so the CUDA graph trees never copy them in per replay.
        for t in s.params + [s.x, s.labels]:
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


def run_system(system, c, steps, warmup):
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    used_before = device_used_bytes()
    run_one, extra, first_losses, keep = build_system(system, c)
    first_losses = first_losses[:LOSS_CHECK_STEPS]
    loss = None
    for _ in range(warmup):
        loss = run_one()
        if len(first_losses) < LOSS_CHECK_STEPS:
            first_losses.append(loss.item())
    torch.cuda.synchronize()
    samples = []
    for _ in range(steps):
        start = time.perf_counter()
        loss = run_one()
        torch.cuda.synchronize()
        samples.append(1e6 * (time.perf_counter() - start))
    start = time.perf_counter()
    for _ in range(steps):
        loss = run_one()
    torch.cuda.synchronize()
    pipelined_us = 1e6 * (time.perf_counter() - start) / steps
    final_loss = loss.item()
    if not math.isfinite(final_loss):
        raise RuntimeError(f"the loss after {warmup + 2 * steps} steps is not finite ({final_loss})")
    step_us = summarize(samples)
    median_s = step_us["median_us"] * 1e-6
    tflops = step_flops(c) / median_s / 1e12
    result = {
        "system": "pytorch_" + system,
        "status": "ok",
        "reason": None,
        "step_us": step_us,
        "pipelined_step_us": pipelined_us,
        "tokens_per_s": c["tokens"] / median_s,
        "tflops": tflops,
        "mfu": tflops / PEAK_TFLOPS,
        "peak_bytes": torch.cuda.max_memory_allocated(),
        "device_used_delta_bytes": device_used_bytes() - used_before,
        "final_loss": final_loss,
        "first_losses": first_losses,
    }
    result.update(extra)
    del keep, run_one, loss
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
            if system == "compile":
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
        f"{name:7s} {r['system']:19s} {s['median_us'] / 1000:.3f} ms [{s['min_us'] / 1000:.3f}-{s['max_us'] / 1000:.3f}]"
        f"  {r['tflops']:.1f} TFLOP/s (MFU {100 * r['mfu']:.1f}%)  peak {r['peak_bytes'] / 2**20:.1f} MiB"
        f"  ({r['wall_s']:.0f} s in all)"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="small,medium,large,moe")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="eager, cuda_graph, compile")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per system")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first (after capture or compile)")
    parser.add_argument("--quick", action="store_true", help="--steps 20 --warmup 5")
    parser.add_argument(
        "--budget-s", type=float, default=300, help="start no system after this many seconds (it is then not_run)"
    )
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = 20, 5
    if args.steps < 1 or args.warmup < 1:
        raise SystemExit("pytorch_peer: --steps and --warmup must be >= 1")
    configs = parse_list(args.configs, list(CONFIGS), "config")
    systems = parse_list(args.systems, list(SYSTEMS), "system")
    if torch is None:
        raise SystemExit("pytorch_peer: PyTorch is not installed here (run it on the GPU machine)")
    if not torch.cuda.is_available():
        raise SystemExit("pytorch_peer: no CUDA device (torch.cuda.is_available() is False)")
    result = {
        "benchmark": "training_step",
        "source": "pytorch",
        "device": torch.cuda.get_device_name(0),
        "torch_version": torch.__version__,
        "peak_tflops": PEAK_TFLOPS,
        "steps": args.steps,
        "warmup": args.warmup,
        "timing": "host wall clock around one step followed by torch.cuda.synchronize() (median, min, max over "
        "`steps` samples after `warmup` steps); pipelined_step_us: `steps` steps back to back, one synchronize",
        "flops": "6 * tokens * matmul parameters a token passes through; nothing else counted",
        "memory": "peak_bytes: torch.cuda.max_memory_allocated over the system's run; device_used_delta_bytes: "
        "cudaMemGetInfo used after the timed steps minus before the system's setup",
        "optimizer": {"name": "AdamW (fused)", "lr": LR, "weight_decay": WEIGHT_DECAY},
        "configs": [],
    }
    print(f"device: {result['device']}, torch {torch.__version__}", flush=True)
    deadline = time.perf_counter() + args.budget_s
    for name in configs:
        result["configs"].append(run_config(name, systems, args.steps, args.warmup, deadline))
        if args.out:  # after every config: a later crash keeps the earlier results
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)
    failed = [f"{c['name']}/{s['system']}" for c in result["configs"] for s in c["systems"] if s["status"] != "ok"]
    if failed:
        print(f"pytorch_peer: failed or not run: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

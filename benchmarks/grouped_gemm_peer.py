#!/usr/bin/env python3
"""PyTorch peer of grouped_gemm_bench: torch._grouped_mm on the same rows.

    python3 benchmarks/grouped_gemm_peer.py --out grouped_gemm_peer.json
    python3 benchmarks/grouped_gemm_peer.py --kinds forward,dgrad,wgrad --tokens 16384 --experts 8

Same rows, routing formula, timing (device events around single calls after a
warm-up, median of --repeats) and JSON row keys as benchmarks/grouped_gemm_bench.cc,
with "impl": "torch._grouped_mm". torch._grouped_mm takes the group ends as a
device int32 tensor (offs = our offsets[1:]), so it too never reads the split
on the host:
  forward  y  = _grouped_mm(x [T, K], w.transpose(-2, -1) [E, K, N], offs)
  dgrad    dx = _grouped_mm(dy [T, N], w [E, N, K], offs)
  wgrad    dw = _grouped_mm(dy.t() [N, T], x [T, K], offs)   (bf16 dw; --wgrad-out fp32
           asks for out_dtype=torch.float32, as ours writes by default: a row
           torch refuses is "status": "unsupported" with its error)
"""
import argparse
import sys

import torch

from peer_common import add_run_args, cuda_ready, int_list, run_rows, str_list, time_call, write_result


def group_sizes(routing, tokens, experts):
    """The integer routing formula of grouped_gemm_bench.cc."""
    if routing == "balanced":
        return [tokens // experts + (1 if e < tokens % experts else 0) for e in range(experts)]
    if routing != "skewed":
        raise SystemExit(f"grouped_gemm_peer: routing must be balanced or skewed, got {routing}")
    weights = [720720 // (e + 1) for e in range(experts)]
    total = sum(weights)
    sizes = [tokens * w // total for w in weights]
    sizes[0] += tokens - sum(sizes)
    return sizes


def run_row(kind, experts, tokens, k, n, routing, args):
    dev = torch.device("cuda")
    sizes = group_sizes(routing, tokens, experts)
    offs = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(device=dev, dtype=torch.int32)

    def rand(*shape):
        return torch.empty(shape, device=dev, dtype=torch.bfloat16).uniform_(-1.0, 1.0)

    if kind == "forward":
        x, w = rand(tokens, k), rand(experts, n, k)
        fn = lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)  # noqa: E731
    elif kind == "dgrad":
        dy, w = rand(tokens, n), rand(experts, n, k)
        fn = lambda: torch._grouped_mm(dy, w, offs=offs)  # noqa: E731
    elif kind == "wgrad":
        dy, x = rand(tokens, n), rand(tokens, k)
        if args.wgrad_out == "fp32":
            fn = lambda: torch._grouped_mm(dy.t(), x, offs=offs, out_dtype=torch.float32)  # noqa: E731
        else:
            fn = lambda: torch._grouped_mm(dy.t(), x, offs=offs)  # noqa: E731
    else:
        raise SystemExit(f"grouped_gemm_peer: kinds are forward, dgrad, wgrad; got {kind}")
    out_dtype = args.wgrad_out if kind == "wgrad" else "bf16"
    try:
        row = time_call(fn, args.warmup, args.repeats)
    except RuntimeError as error:  # an out_dtype this torch does not offer
        row = {"status": "unsupported", "reason": str(error).splitlines()[0], "median_us": float("nan")}
    row.update(
        name=f"{kind} E={experts} T={tokens} {k}->{n} {routing}",
        impl="torch._grouped_mm",
        kind=kind,
        experts=experts,
        tokens=tokens,
        in_features=k,
        out_features=n,
        routing=routing,
        out_dtype=out_dtype,
        largest_group=max(sizes),
        tflops=2.0 * tokens * n * k / (row["median_us"] * 1e-6) / 1e12,
    )
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int_list, default=[8, 128])
    parser.add_argument("--tokens", type=int_list, default=[16384, 65536])
    parser.add_argument("--shapes", type=str_list, default=["2048x1536", "4096x14336"], help="KxN (in x out features)")
    parser.add_argument("--routings", type=str_list, default=["balanced", "skewed"])
    parser.add_argument("--kinds", type=str_list, default=["forward"])
    parser.add_argument("--wgrad-out", choices=["bf16", "fp32"], default="bf16", help="wgrad's dw dtype")
    add_run_args(parser)
    args = parser.parse_args()
    if not cuda_ready("grouped_gemm_peer", "CUDA and torch._grouped_mm", hasattr(torch, "_grouped_mm")):
        return 1

    def run_case(kind, shape, experts, tokens, routing):
        k, n = (int(v) for v in shape.split("x"))
        return run_row(kind, experts, tokens, k, n, routing, args)

    print(f"{'row':<52}{'median us':>12}{'TFLOP/s':>10}")
    rows = run_rows([args.kinds, args.shapes, args.experts, args.tokens, args.routings], run_case,
                    lambda row: f"{row['name']:<52}{row['median_us']:>12.1f}{row['tflops']:>10.1f}")
    write_result("grouped_gemm", "torch._grouped_mm", args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

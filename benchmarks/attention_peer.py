#!/usr/bin/env python3
"""PyTorch peer of attention_bench: scaled_dot_product_attention on the same rows.

    python3 benchmarks/attention_peer.py --out attention_peer.json
    python3 benchmarks/attention_peer.py --seqs 4096 --heads 32 --dims 128 --backends flash

Same rows (seq x heads x head_dim, batch = tokens / seq, bf16, causal), FLOP
counts, timing (device events around single calls after a warm-up, median of
--repeats) and JSON row keys as benchmarks/attention_bench.cc, with "impl":
"sdpa-flash" or "sdpa-cudnn" (torch.nn.attention.sdpa_kernel picks the
backend). SDPA takes [batch, heads, seq, dim]; equal sequences need no varlen.
The backward row times torch.autograd.grad of the output with a fixed
grad_output (the forward is run once outside the timing and retained).
"""
import argparse
import sys

import torch
import torch.nn.functional as F

from peer_common import add_run_args, cuda_ready, int_list, run_rows, str_list, time_call, write_result


def flops(kind, seq, batch, heads, dim, causal):
    forward = 4.0 * seq * seq * heads * dim * batch * (0.5 if causal else 1.0)
    return forward if kind == "forward" else 2.5 * forward


def run_row(kind, backend_name, seq, heads, dim, args):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend_name]
    batch = max(1, args.tokens // seq)
    shape = (batch, heads, seq, dim)
    dev = torch.device("cuda")
    q, k, v = (torch.empty(shape, device=dev, dtype=torch.bfloat16).uniform_(-1, 1).requires_grad_() for _ in range(3))
    dout = torch.empty(shape, device=dev, dtype=torch.bfloat16).uniform_(-1, 1)
    with sdpa_kernel([backend]):
        if kind == "forward":
            with torch.no_grad():
                fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=args.causal)  # noqa: E731
                row = time_call(fn, args.warmup, args.repeats)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=args.causal)
            fn = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)  # noqa: E731
            row = time_call(fn, args.warmup, args.repeats)
    f = flops(kind, seq, batch, heads, dim, args.causal)
    row.update(
        name=f"{kind} seq={seq} batch={batch} H={heads} D={dim} {'causal' if args.causal else 'full'}",
        impl=f"sdpa-{backend_name}",
        kind=kind,
        seq=seq,
        batch=batch,
        heads=heads,
        kv_heads=heads,
        head_dim=dim,
        causal=args.causal,
        tflops=f / (row["median_us"] * 1e-6) / 1e12,
        tflops_best=f / (row["min_us"] * 1e-6) / 1e12,
    )
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int_list, default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--heads", type=int_list, default=[16, 32])
    parser.add_argument("--dims", type=int_list, default=[128, 64])
    parser.add_argument("--kinds", type=str_list, default=["forward", "backward"])
    parser.add_argument("--backends", type=str_list, default=["flash", "cudnn"])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--causal", type=lambda s: s.lower() in ("1", "true", "yes"), default=True)
    add_run_args(parser)
    args = parser.parse_args()
    if not cuda_ready("attention_peer"):
        return 1

    def run_case(kind, dim, heads, seq, backend):
        try:
            return run_row(kind, backend, seq, heads, dim, args)
        except RuntimeError as error:  # a backend that does not take this shape
            print(f"attention_peer: {backend} {kind} seq={seq} H={heads} D={dim}: {error}", file=sys.stderr)
            return None

    print(f"{'row':<48}{'impl':>12}{'median us':>12}{'TFLOP/s':>10}")
    rows = run_rows([args.kinds, args.dims, args.heads, args.seqs, args.backends], run_case,
                    lambda row: f"{row['name']:<48}{row['impl']:>12}{row['median_us']:>12.1f}{row['tflops']:>10.1f}")
    write_result("attention", "torch.sdpa", args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

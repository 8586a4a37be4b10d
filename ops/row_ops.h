// Row windows of row-major tensors, for layers that assemble a tensor one
// token chunk at a time (layers/comm_gemm_overlap.h):
//
//   Tensor gathered = ops::empty(ctx, {Shape{n * t, h}, dtype});  // no work: written below
//   ops::copy_rows_(ctx, gathered, chunk, j * t);                  // rows [j t, (j + 1) t) = chunk
//
// Byte copies: any dtype. A window is contiguous memory, so a copy is one
// copy-engine transfer on cuda (no SMs taken from the GEMMs it overlaps).
#pragma once

#include <cstdint>

#include "engine/context.h"
#include "engine/op.h"

namespace stepgraph::ops {

// A new tensor whose contents are undefined until an op writes them (no
// kernel runs). Every row must be written before it is read.
Tensor empty(Context& ctx, const TensorMeta& meta);
// dst rows [first_row, first_row + src rows) = src; dst and src share the
// dtype and the row width (every dimension but the first).
void copy_rows_(Context& ctx, const Tensor& dst, const Tensor& src, std::int64_t first_row);

const OpDef& empty_op();
const OpDef& copy_rows_inplace_op();

}  // namespace stepgraph::ops

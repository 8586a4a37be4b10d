// Token embedding ops (kernels/embedding.h): the gather of table rows for a
// window of tokens per example, and its deterministic backward into an fp32
// gradient (see Note [Deterministic embedding backward]).
//
//   Tensor x = ops::embedding(ctx, table, tokens, error_flag);  // [rows, width * dim]
//   ops::embedding_backward_(ctx, table_grad, dx, tokens);       // table_grad = d loss / d table
#pragma once

#include <string>

#include "engine/context.h"
#include "engine/op.h"

namespace stepgraph::ops {

// table [vocab, dim] (bf16, fp16, fp32), tokens [rows, width] int32, error_flag
// int32 [1] (set, never cleared, when a token is outside [0, vocab); the
// caller checks it after the step). Returns [rows, width * dim] in the
// table's dtype: the width embeddings of each example side by side.
Tensor embedding(Context& ctx, const Tensor& table, const Tensor& tokens, const Tensor& error_flag);

// Overwrites grad (fp32 [vocab, dim]) with the table's gradient given dout
// [rows, width * dim] (the table's dtype) and the forward's tokens.
void embedding_backward_(Context& ctx, const Tensor& grad, const Tensor& dout, const Tensor& tokens);

const OpDef& embedding_op();
const OpDef& embedding_backward_op();

}  // namespace stepgraph::ops

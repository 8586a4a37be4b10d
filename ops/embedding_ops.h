// Token embedding ops (kernels/embedding.h): the gather of table rows for a
// window of tokens per example, and its deterministic backward into an fp32
// gradient (see Note [Deterministic embedding backward]).
//
//   Tensor x = ops::embedding(ctx, table, tokens, error_flag);  // [rows, width * dim]
//   ops::embedding_backward_(ctx, table_grad, dx, tokens);       // table_grad = d loss / d table
#pragma once

#include <cstdint>
#include <string>

#include "engine/context.h"
#include "engine/op.h"

namespace stepgraph::ops {

// Which ids the table holds: the whole vocabulary (the defaults), or a
// vocabulary-parallel rank's slice, rows [vocab_offset, vocab_offset +
// table rows) of a vocabulary of `vocab` ids (Note [Vocabulary slice of an
// embedding] in kernels/embedding.h).
struct EmbeddingParams {
  std::int64_t vocab_offset = 0;
  std::int64_t vocab = 0;  // every id's count; 0: the table's rows

  bool operator==(const EmbeddingParams&) const = default;
  std::string to_string() const;  // "" for the whole table
};

// table [vocab, dim] (bf16, fp16, fp32), tokens [rows, width] int32, error_flag
// int32 [1] (set, never cleared, when a token is outside [0, vocab); the
// caller checks it after the step). Returns [rows, width * dim] in the
// table's dtype: the width embeddings of each example side by side. With a
// slice's params, the tokens of other slices get -0.0 rows.
Tensor embedding(Context& ctx, const Tensor& table, const Tensor& tokens, const Tensor& error_flag,
                 const EmbeddingParams& params = {});

// Overwrites grad (fp32 [vocab, dim]) with the table's gradient given dout
// [rows, width * dim] (the table's dtype) and the forward's tokens (with a
// slice's params, the gradient of the slice's rows).
void embedding_backward_(Context& ctx, const Tensor& grad, const Tensor& dout, const Tensor& tokens,
                         const EmbeddingParams& params = {});

const OpDef& embedding_op();
const OpDef& embedding_backward_op();

}  // namespace stepgraph::ops

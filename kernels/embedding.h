// Token embedding: a gather of table rows and its deterministic backward.
//
//   forward   out[r, w*dim + d] = table[tokens[r, w], d]
//             tokens [rows, width] int32, table [vocab, dim], out [rows, width*dim]:
//             the `width` embeddings of an example concatenated into one row.
//   backward  dtable[v, d] = sum over (r, w) with tokens[r, w] == v of dout[r, w*dim + d]
//             dtable fp32 [vocab, dim], overwritten (rows no token names are 0).
//
// table/out/dout share one dtype (bf16, fp16 or fp32). A token outside
// [0, vocab) cannot be looked up: forward writes zeros for it and sets the
// sticky `error_flag` (int32, never cleared by the op: the caller zeroes it
// and reads it after the step), so nothing is read back inside a step;
// backward skips it.
//
// Note [Vocabulary slice of an embedding]
// A vocabulary-parallel rank's table is a slice: rows [vocab_offset,
// vocab_offset + vocab) of a table of full_vocab ids (EmbeddingDesc). Its
// forward looks up the tokens of its slice and writes -0.0 for every other
// token of the vocabulary: -0.0 is the additive identity (x + -0.0 == x for
// every x, +0.0 and -0.0 included, where +0.0 is not), so the sum of the
// ranks' outputs (a reduce-scatter, in any order) is the owning rank's row,
// bit for bit. A token outside [0, full_vocab) belongs to no slice: every
// slice sets the flag, and the slice at offset 0 writes +0.0 (the others
// -0.0), so the sum is the +0.0 that one whole table writes. The backward
// sums, for each of its rows, the positions naming that row's global id,
// in position order: one whole table's sums for those rows, bit for bit.
// The defaults (offset 0, full_vocab 0 = vocab) are the whole table.
//
// Note [Deterministic embedding backward]
// Atomic fp32 adds are not bit-reproducible (their order varies run to run),
// and eager and graphed steps must give identical losses. So no atomics: each
// (row v, column d) of dtable belongs to one thread, which walks all token
// positions in increasing order and adds the matching dout values in fp32,
// starting from 0. The host reference adds in the same order in fp32, so
// device and host agree bit for bit. The cost is O(vocab * positions)
// comparisons (shared-memory broadcasts): fine for the vocabularies of
// hundreds to a few thousand tokens the trainer uses; a segmented sort by
// token is the scalable form if large vocabularies need it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "engine/dtype.h"

namespace stepgraph::kernels {

struct EmbeddingDesc {
  DType dtype = DType::kBFloat16;  // table, out, dout
  std::int64_t vocab = 0;
  std::int64_t dim = 0;    // embedding width
  std::int64_t rows = 0;   // examples
  std::int64_t width = 0;  // tokens per example (the context window)

  // A vocabulary slice (Note [Vocabulary slice of an embedding]): the
  // table's rows are the ids [vocab_offset, vocab_offset + vocab) of a
  // vocabulary of full_vocab ids (0: vocab, the whole table).
  std::int64_t vocab_offset = 0;
  std::int64_t full_vocab = 0;

  std::int64_t positions() const { return rows * width; }
  std::int64_t valid_ids() const { return full_vocab > 0 ? full_vocab : vocab; }
};

// dtype bf16/fp16/fp32; vocab, dim, rows, width > 0 with every product below
// 2^31; a slice inside [0, full_vocab) with full_vocab below 2^31. Throws
// Error(kInvalidArgument) otherwise.
void check_embedding(const EmbeddingDesc& desc);

void launch_embedding_forward(const EmbeddingDesc& desc, const void* table, const std::int32_t* tokens, void* out,
                              std::int32_t* error_flag, cudaStream_t stream);
void launch_embedding_backward(const EmbeddingDesc& desc, const void* dout, const std::int32_t* tokens, float* dtable,
                               cudaStream_t stream);

namespace host {
void embedding_forward(const EmbeddingDesc& desc, const void* table, const std::int32_t* tokens, void* out,
                       std::int32_t* error_flag);
void embedding_backward(const EmbeddingDesc& desc, const void* dout, const std::int32_t* tokens, float* dtable);
}  // namespace host

}  // namespace stepgraph::kernels

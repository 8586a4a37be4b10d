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
// and eager and graphed steps must give identical losses. So no atomics and
// one fixed order: dtable[v, d] is 0 plus dout[p, d] for each position p
// naming v's global id, in increasing p, each add one fp32 rounding. The
// host reference adds position by position into a zeroed table: per element
// the same terms in the same order, so device and host agree bit for bit.
//
// The device's scheme: one block per (row v, chunk of 2048 columns). The
// block walks the tokens in tiles of 1024; each warp ballots its tokens
// against v's id, the (slot, warp) match counts are scanned, and the tile's
// matching positions land in shared memory in increasing order; each thread
// then adds those positions' dout for its 8 columns into fp32 registers
// (16-byte loads where dim is a multiple of 8; a batch of rows' loads issued
// before their adds: 4 rows where the grid fills the GPU with blocks, 16
// where it has at most one block an SM, as a small vocabulary's does), and
// the block writes its chunk once (zeros where nothing matched). Tiles in
// order and matches in order within a tile keep every column's adds in
// position order, whatever the tile, chunk or batch size: the device's sums
// are the host's.
// Cost: vocab x positions token comparisons per column chunk (ballots over
// tokens the L1/L2 keeps; a tile without a match is its loads and one
// barrier), each element of a named dout row read once, and dtable written
// once -- at vocab 8192, dim 2048, 2048 positions, the 64 MiB of dtable
// writes dominate. A column's sum is a chain of dependent adds, so a row
// named by n positions takes about n / batch dout load latencies. The alternative, a stable sort of positions by token then
// one segment sum per row, reads the tokens once instead of once per row,
// but needs a workspace the op does not have; with dtable's writes the floor
// and the tokens cached, the per-row scan costs little more.
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

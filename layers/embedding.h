// Embedding: a token table [vocab, dim] (a Parameter: fp32 master, model-dtype
// copy, fp32 grad) looked up for a window of tokens per example, the window's
// embeddings concatenated into one row (ops/embedding_ops.h).
//
//   Embedding::Forward f = embedding.forward(ctx, {tokens, error_flag});  // f.y [rows, width * dim]
//   embedding.backward(ctx, f.saved, {dy});                               // writes the table's grad
//
// Note [Vocabulary-parallel embedding]
// With a communicator of N ranks (the model's tensor-parallel group) the
// table is split along the vocabulary and the tokens along the rows
// (Megatron's vocabulary-parallel input layer with sequence parallelism):
// rank r holds rows [r V/N, (r+1) V/N) of the table one rank draws from the
// same seed, and its tokens are rows [r R/N, (r+1) R/N) of the R rows the
// group embeds (Note [Column- and row-parallel Linear]).
//
//   forward   tokens [R/N, width] -> all-gather -> [R, width] -> look up this
//             rank's slice, -0.0 for every token of another slice ->
//             reduce-scatter (sum) -> y [R/N, width * dim].
//   backward  dy [R/N, width * dim] -> all-gather -> [R, width * dim] -> the
//             slice's gradient from the gathered tokens.
//
// Exactly one rank holds a token's row and the others add -0.0, the additive
// identity (Note [Vocabulary slice of an embedding] in kernels/embedding.h),
// so y is one rank's lookup bit for bit, whatever order the reduce-scatter
// adds in. The slice's gradient sums the positions naming each of its rows
// in position order, as one rank's does for those rows (Note [Deterministic
// embedding backward]): bit for bit again, no sum crosses ranks. Every rank
// sees every token, so a token outside [0, vocab) sets the error flag on
// every rank, as it does on one. All ops, no host reads: capturable, its
// transients in the pool. Without a communicator the layer is the plain
// table, op for op.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/communicator.h"
#include "engine/context.h"
#include "layers/parameter.h"

namespace stepgraph {

struct EmbeddingConfig {
  std::int64_t vocab = 0;  // the whole vocabulary; a multiple of the ranks when vocabulary-parallel
  std::int64_t dim = 0;
  DType dtype = DType::kBFloat16;
};

class Embedding {
 public:
  struct FwdArgs {
    Tensor tokens;      // int32 [rows, width] (vocabulary-parallel: this rank's [rows / N, width])
    Tensor error_flag;  // int32 [1]: set when a token is outside [0, vocab)
  };
  struct Saved {
    // The caller's tokens (a reference); vocabulary-parallel, every rank's
    // gathered [rows, width].
    Tensor tokens;
  };
  struct Forward {
    Tensor y;  // [rows, width * dim] (vocabulary-parallel: [rows / N, width * dim]), the config's dtype
    Saved saved;
  };
  struct BwdArgs {
    Tensor dy;  // like the forward's y
  };

  // `vocab_parallel`: the group the table is split across (Note
  // [Vocabulary-parallel embedding]); null is the whole table on one rank.
  Embedding(Context& ctx, const std::string& name, const EmbeddingConfig& config, std::uint32_t seed,
            Communicator* vocab_parallel = nullptr);

  Forward forward(Context& ctx, const FwdArgs& args) const;
  // Overwrites the table's gradient. Tokens get no gradient.
  void backward(Context& ctx, const Saved& saved, const BwdArgs& args) const;

  const EmbeddingConfig& config() const { return config_; }
  Communicator* vocab_parallel() const { return vp_; }
  std::int64_t local_vocab() const;   // the rows this rank holds: vocab / N
  std::int64_t vocab_offset() const;  // the global id of this rank's first row: rank * vocab / N
  std::vector<Parameter*> parameters() { return {&table_}; }
  std::vector<Tensor> gradients() const { return {table_.grad}; }  // the table's
  const Parameter& table() const { return table_; }                 // [vocab / N, dim]

 private:
  int ranks() const { return vp_ != nullptr ? vp_->world_size() : 1; }

  std::string label_;  // "Embedding 'name'", for argument errors
  EmbeddingConfig config_;
  Communicator* vp_ = nullptr;
  Parameter table_;  // [vocab / N, dim]
};

}  // namespace stepgraph

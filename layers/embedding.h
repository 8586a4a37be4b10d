// Embedding: a token table [vocab, dim] (a Parameter: fp32 master, model-dtype
// copy, fp32 grad) looked up for a window of tokens per example, the window's
// embeddings concatenated into one row (ops/embedding_ops.h).
//
//   Embedding::Forward f = embedding.forward(ctx, {tokens, error_flag});  // f.y [rows, width * dim]
//   embedding.backward(ctx, f.saved, {dy});                               // writes the table's grad
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/context.h"
#include "layers/parameter.h"

namespace stepgraph {

struct EmbeddingConfig {
  std::int64_t vocab = 0;
  std::int64_t dim = 0;
  DType dtype = DType::kBFloat16;
};

class Embedding {
 public:
  struct FwdArgs {
    Tensor tokens;      // int32 [rows, width]
    Tensor error_flag;  // int32 [1]: set when a token is outside [0, vocab)
  };
  struct Saved {
    Tensor tokens;  // the caller's tokens (a reference)
  };
  struct Forward {
    Tensor y;  // [rows, width * dim], the config's dtype
    Saved saved;
  };
  struct BwdArgs {
    Tensor dy;  // [rows, width * dim]
  };

  Embedding(Context& ctx, const std::string& name, const EmbeddingConfig& config, std::uint32_t seed);

  Forward forward(Context& ctx, const FwdArgs& args) const;
  // Overwrites the table's gradient. Tokens get no gradient.
  void backward(Context& ctx, const Saved& saved, const BwdArgs& args) const;

  const EmbeddingConfig& config() const { return config_; }
  std::vector<Parameter*> parameters() { return {&table_}; }
  std::vector<Tensor> gradients() const { return {table_.grad}; }  // the table's
  const Parameter& table() const { return table_; }

 private:
  std::string label_;  // "Embedding 'name'", for argument errors
  EmbeddingConfig config_;
  Parameter table_;  // [vocab, dim]
};

}  // namespace stepgraph

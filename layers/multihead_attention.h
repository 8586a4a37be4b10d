// MultiheadAttention: TransformerEngine's attention block without the
// residual add (the caller adds it, as for LayerNormMLP):
//
//   x [T, hidden] -> LayerNorm -> QKV Linear (+bias) [T, (H + 2 Hkv) D]
//     -> split, rotary embedding of q and k (one fused op)
//     -> causal attention over the packed sequences -> [T, H D]
//     -> output projection Linear (+bias) -> y [T, hidden]
//
// The tokens are sequences packed end to end; cu_seqlens int32 [S + 1]
// (kernels/attention.h) says where each starts. It is read on the device
// only, so a captured step replays with any packing of the same T and S that
// the host writes into the (persistent, bound) cu_seqlens between replays.
// kv_heads < heads is grouped-query attention (1: multi-query).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "engine/context.h"
#include "engine/fp8_recipe.h"
#include "layers/layernorm_linear.h"
#include "layers/linear.h"
#include "ops/attention_ops.h"

namespace stepgraph {

struct MultiheadAttentionConfig {
  std::int64_t hidden = 0;
  std::int64_t heads = 0;
  std::int64_t kv_heads = 0;  // 0: heads
  std::int64_t head_dim = 0;  // 0: hidden / heads
  kernels::NormKind norm = kernels::NormKind::kLayerNorm;
  float eps = 1e-5f;
  DType dtype = DType::kBFloat16;
  bool causal = true;
  float rope_base = 10000.0f;  // the rotary embedding's base (all of head_dim rotates)
  // FP8 QKV and output projections (Note [FP8 Linear]); attention itself stays 16-bit.
  std::optional<Fp8Recipe> fp8;

  std::int64_t resolved_kv_heads() const { return kv_heads != 0 ? kv_heads : heads; }
  std::int64_t resolved_head_dim() const { return head_dim != 0 ? head_dim : (heads > 0 ? hidden / heads : 0); }
};

class MultiheadAttention {
 public:
  struct FwdArgs {
    Tensor x;           // [T, hidden]
    Tensor cu_seqlens;  // int32 [S + 1]
  };
  struct Saved {
    LayerNormLinear::Saved qkv;
    Tensor q, k, v;  // rotated q and k, v: [T, (H | Hkv) D]
    Tensor out;      // attention's output [T, H D] (also the projection's saved input)
    Tensor lse;      // fp32 [H, T]
    Tensor cu_seqlens;
    Linear::Saved proj;
  };
  struct Forward {
    Tensor y;  // [T, hidden]
    Saved saved;
  };
  struct BwdArgs {
    Tensor dy;  // [T, hidden]
    // Optional, [T, hidden]: returned added to dx, fused into the norm's
    // backward (the residual stream's gradient: Norm::BwdArgs).
    Tensor dx_residual;
  };

  MultiheadAttention(Context& ctx, const std::string& name, const MultiheadAttentionConfig& config,
                     std::uint32_t seed);

  Forward forward(Context& ctx, const FwdArgs& args) const;
  // dx; writes every parameter gradient.
  Tensor backward(Context& ctx, const Saved& saved, const BwdArgs& args) const;

  const MultiheadAttentionConfig& config() const { return config_; }
  // The norm's, the QKV projection's, then the output projection's.
  std::vector<Parameter*> parameters();
  // FP8: the QKV and output projections (as LayerNormMLP::fp8_linears).
  std::vector<Linear*> fp8_linears();

 private:
  ops::AttentionParams attention_params() const;
  ops::RopeParams rope_params() const;

  std::string label_;
  MultiheadAttentionConfig config_;
  LayerNormLinear qkv_;
  Linear proj_;
};

}  // namespace stepgraph

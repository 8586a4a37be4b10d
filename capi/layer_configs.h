// The C API's versioned layer configs read into the engine's configs
// (capi/layer_configs.cc). Internal to capi.
#pragma once

#include <cstdint>

#include "capi/handles.h"
#include "capi/stepgraph.h"
#include "capi/versioned_config.h"
#include "layers/layernorm_linear.h"
#include "layers/layernorm_mlp.h"
#include "layers/linear.h"
#include "layers/norm.h"
#include "layers/residual_stack.h"

namespace stepgraph::capi {

// Each config read as its header's version says, every field checked; an
// Error naming `function` and the field otherwise.
LinearConfig read_linear_config(const sg_linear_config& config, const char* function);
NormConfig read_norm_config(const sg_norm_config& config, const char* function);
LayerNormLinearConfig read_layernorm_linear_config(const sg_layernorm_linear_config& config, const char* function);
LayerNormMLPConfig read_layernorm_mlp_config(const sg_layernorm_mlp_config& config, const char* function);
// The stack's config with this library's fields (its world and overlap are the caller's to resolve).
sg_residual_stack_config read_residual_stack_config(const sg_residual_stack_config& config, const char* function);
ResidualStackConfig to_residual_stack_config(const sg_residual_stack_config& config, const char* function);

// A C config of type C with its header filled (every other field zero).
template <typename C>
C with_header(std::uint32_t magic, std::uint32_t version) {
  C c{};
  c.size = sizeof(C);
  c.magic = magic;
  c.version = version;
  return c;
}

sg_norm_kind from_norm_kind(kernels::NormKind kind);

// The fields a residual stack's and a language model's C configs share, from the engine's.
template <typename C>  // sg_residual_stack_config or sg_language_model_config
void set_stack_fields(C& c, const ResidualStackConfig& d) {
  c.hidden = d.hidden;
  c.ffn = d.ffn;
  c.layers = d.layers;
  c.vocab = d.vocab;
  c.norm = from_norm_kind(d.norm);
  c.eps = d.eps;
  c.dtype = from_dtype(d.dtype);
  c.seed = d.seed;
  c.experts = d.experts;
  c.topk = d.topk;
  c.moe_every = d.moe_every;
}

// The fields a residual stack's and a language model's C configs share, as the engine's.
template <typename C>  // sg_residual_stack_config or sg_language_model_config
ResidualStackConfig stack_fields(const C& c, const char* function) {
  return {.hidden = c.hidden,
          .ffn = c.ffn,
          .layers = c.layers,
          .vocab = c.vocab,
          .norm = to_norm_kind(c.norm),
          .eps = checked_eps(c.eps, function, "config eps"),
          .dtype = to_dtype(c.dtype),
          .seed = c.seed,
          .experts = c.experts,
          .topk = c.topk,
          .moe_every = c.moe_every};
}

}  // namespace stepgraph::capi

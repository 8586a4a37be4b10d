// AnyLayer: one layer behind one interface, x -> y with what its backward
// needs (type-erased), dy -> dx, and its parameters. The dense layers
// (Linear, Norm, LayerNormLinear, LayerNormMLP) and the ResidualStack each
// keep their own typed FwdArgs/Saved; code that takes any list of layers
// (the C API's handles, LayerPipeline for pipeline schedules) takes them
// through AnyLayerOf<L>:
//
//   AnyLayerOf<LayerNormMLP> mlp(ctx, "mlp", config, seed);
//   auto [y, saved] = mlp.forward(ctx, x);
//   Tensor dx = mlp.backward(ctx, saved, dy);
#pragma once

#include <any>
#include <memory>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "engine/context.h"
#include "engine/error.h"
#include "layers/layernorm_linear.h"
#include "layers/layernorm_mlp.h"
#include "layers/linear.h"
#include "layers/norm.h"
#include "layers/parameter.h"
#include "layers/residual_stack.h"

namespace stepgraph {

class AnyLayer {
 public:
  virtual ~AnyLayer() = default;
  // "linear", "norm", "layernorm_linear", "layernorm_mlp", "residual_stack".
  virtual std::string_view kind() const = 0;
  // y and what backward needs (the layer's own Saved, in a std::any).
  virtual std::pair<Tensor, std::any> forward(Context& ctx, const Tensor& x) = 0;
  // dx (undefined for a layer without dgrad); writes every parameter
  // gradient (overwritten). `saved` must come from this layer's forward.
  virtual Tensor backward(Context& ctx, const std::any& saved, const Tensor& dy) = 0;
  virtual std::vector<Parameter*> parameters() = 0;

  // What the layer uses and must outlive it (a tensor-parallel stack's
  // communicator, say). Destroyed after the derived layer.
  std::shared_ptr<const void> keeps;
};

template <typename L>
constexpr std::string_view any_layer_kind() {
  if constexpr (std::is_same_v<L, Linear>) return "linear";
  if constexpr (std::is_same_v<L, Norm>) return "norm";
  if constexpr (std::is_same_v<L, LayerNormLinear>) return "layernorm_linear";
  if constexpr (std::is_same_v<L, LayerNormMLP>) return "layernorm_mlp";
  if constexpr (std::is_same_v<L, ResidualStack>) return "residual_stack";
}

// Owns an L, built from L's constructor arguments.
template <typename L>
class AnyLayerOf final : public AnyLayer {
 public:
  template <typename... Args>
  explicit AnyLayerOf(Args&&... args) : layer_(std::forward<Args>(args)...) {}

  std::string_view kind() const override { return any_layer_kind<L>(); }

  std::pair<Tensor, std::any> forward(Context& ctx, const Tensor& x) override {
    if constexpr (std::is_same_v<L, ResidualStack>) {
      typename L::Forward out = layer_.forward(ctx, x);
      return {out.logits, std::any(std::move(out.saved))};
    } else {
      typename L::Forward out = layer_.forward(ctx, {x});
      return {out.y, std::any(std::move(out.saved))};
    }
  }

  Tensor backward(Context& ctx, const std::any& saved, const Tensor& dy) override {
    const auto* state = std::any_cast<typename L::Saved>(&saved);
    SG_CHECK(state != nullptr, "backward of a ", kind(), " layer: the saved state comes from another kind of layer");
    if constexpr (std::is_same_v<L, ResidualStack>) {
      return layer_.backward(ctx, *state, dy);
    } else {
      return layer_.backward(ctx, *state, {dy});
    }
  }

  std::vector<Parameter*> parameters() override { return layer_.parameters(); }
  L& layer() { return layer_; }
  const L& layer() const { return layer_; }

 private:
  L layer_;
};

}  // namespace stepgraph

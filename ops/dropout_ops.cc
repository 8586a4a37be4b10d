#include "ops/dropout_ops.h"

#include <cstdio>

#include "engine/error.h"
#include "kernels/dropout.h"
#include "ops/op_registration.h"

namespace stepgraph::ops {
namespace {

const TensorMeta kState{Shape{2}, DType::kInt64};

struct AdvanceParams {
  std::int64_t draws = 0;
  bool operator==(const AdvanceParams&) const = default;
  std::string to_string() const { return std::to_string(draws) + " draws"; }
};

kernels::DropoutDesc desc_of(const DropoutParams& p, const TensorMeta& x) {
  return {.count = x.numel(), .p = p.p, .dtype = x.dtype, .offset = p.offset};
}

}  // namespace

std::string DropoutParams::to_string() const {
  char text[64];
  std::snprintf(text, sizeof(text), "p=%g, offset=%lld", static_cast<double>(p), static_cast<long long>(offset));
  return text;
}

const OpDef& dropout_op() {
  static const OpDef op{
      .name = "dropout",
      .check = [](const OpParams& params, std::span<const TensorMeta> inputs) {
        SG_CHECK(inputs.size() == 2, "op dropout takes x and the generator state, got ", inputs.size(), " inputs");
        SG_CHECK(inputs[1] == kState, "op dropout: the state must be int64 [2] {seed, counter}, got ",
                 inputs[1].shape, " ", dtype_name(inputs[1].dtype));
        kernels::check_dropout(desc_of(params.as<DropoutParams>(), inputs[0]));
        return std::vector<TensorMeta>{inputs[0]};
      },
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            kernels::launch_dropout(desc_of(params.as<DropoutParams>(), a.input_metas[0]), a.inputs[0], a.outputs[0],
                                    static_cast<const std::int64_t*>(a.inputs[1]), stream);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            kernels::host::dropout(desc_of(params.as<DropoutParams>(), a.input_metas[0]), a.inputs[0], a.outputs[0],
                                   static_cast<const std::int64_t*>(a.inputs[1]));
          },
  };
  return op;
}
SG_REGISTER_OP(dropout_op);

const OpDef& rng_advance_op() {
  static const OpDef op{
      .name = "rng_advance_",
      .check = [](const OpParams& params, std::span<const TensorMeta> inputs) {
        SG_CHECK(inputs.size() == 1 && inputs[0] == kState, "op rng_advance_ takes the state, int64 [2]");
        SG_CHECK(params.as<AdvanceParams>().draws >= 0, "op rng_advance_: draws must be >= 0");
        return std::vector<TensorMeta>{};
      },
      .mutated_inputs = {0},
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            kernels::launch_rng_advance(static_cast<std::int64_t*>(a.inputs[0]), params.as<AdvanceParams>().draws,
                                        stream);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            kernels::host::rng_advance(static_cast<std::int64_t*>(a.inputs[0]), params.as<AdvanceParams>().draws);
          },
  };
  return op;
}
SG_REGISTER_OP(rng_advance_op);

Tensor dropout(Context& ctx, const Tensor& x, const Tensor& state, const DropoutParams& params) {
  return ctx.call(dropout_op(), params, {x, state}).at(0);
}

void rng_advance_(Context& ctx, const Tensor& state, std::int64_t draws) {
  ctx.call(rng_advance_op(), AdvanceParams{draws}, {state});
}

}  // namespace stepgraph::ops

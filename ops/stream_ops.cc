#include "ops/stream_ops.h"

#include <vector>

#include "engine/error.h"
#include "ops/op_registration.h"
#include "ops/operands.h"

namespace stepgraph::ops {
namespace {

constexpr std::string_view kOrderAfter = "order_after";

}  // namespace

const OpDef& order_after_op() {
  static const OpDef op{
      .name = kOrderAfter,
      .check =
          [](const OpParams&, std::span<const TensorMeta> inputs) {
            SG_CHECK(!bind_metas<ReadList>(kOrderAfter, NoParams{}, inputs).tensors.empty(),
                     "op order_after: give the tensors whose writes the stream waits for");
            return std::vector<TensorMeta>{};
          },
      // No kernel: the wait before it is the whole op.
      .launch_cuda = [](const OpParams&, const KernelArgs&, CUstream_st*) {},
      .run_host = [](const OpParams&, const KernelArgs&) {},
  };
  return op;
}
SG_REGISTER_OP(order_after_op);

void order_after(Context& ctx, std::span<const Tensor> tensors) {
  ctx.call(order_after_op(), NoParams{},
           flatten(kOrderAfter, NoParams{},
                   ReadList<Tensor>{std::vector<Tensor>(tensors.begin(), tensors.end())}));
}

}  // namespace stepgraph::ops

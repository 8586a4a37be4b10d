#include "ops/stream_ops.h"

#include <vector>

#include "engine/error.h"
#include "ops/op_registration.h"

namespace stepgraph::ops {

const OpDef& order_after_op() {
  static const OpDef op{
      .name = "order_after",
      .check = [](const OpParams&, std::span<const TensorMeta> inputs) {
        SG_CHECK(!inputs.empty(), "op order_after: give the tensors whose writes the stream waits for");
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
  ctx.call(order_after_op(), NoParams{}, std::vector<Tensor>(tensors.begin(), tensors.end()));
}

}  // namespace stepgraph::ops

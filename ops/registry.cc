#include "ops/registry.h"

#include <string>
#include <vector>

#include "engine/error.h"
#include "ops/activation_ops.h"
#include "ops/attention_ops.h"
#include "ops/bucket_ops.h"
#include "ops/collective_ops.h"
#include "ops/elementwise_ops.h"
#include "ops/embedding_ops.h"
#include "ops/fp8_fused_ops.h"
#include "ops/fp8_ops.h"
#include "ops/gemm_ops.h"
#include "ops/grouped_fp8_ops.h"
#include "ops/grouped_gemm_ops.h"
#include "ops/loss_ops.h"
#include "ops/moe_ops.h"
#include "ops/norm_ops.h"
#include "ops/optimizer_ops.h"
#include "ops/parallel_loss_ops.h"
#include "ops/row_ops.h"
#include "ops/stream_ops.h"

namespace stepgraph::ops {

std::span<const OpDef* const> all_ops() {
  // Every op, by family: elementwise, gemm (and FP8 quantize), grouped gemm, norm, activation, embedding, loss,
  // optimizer, MoE routing, collectives.
  static const std::vector<const OpDef*> ops = {
      &fill_op(),
      &copy_op(),
      &copy_inplace_op(),
      &axpy_op(),
      &axpy_inplace_op(),
      &add_op(),
      &mul_op(),
      &sum_op(),
      &column_sum_op(),
      &cast_op(),
      &gemm_op(),
      &gemm_into_op(),
      &quantize_op(),
      &quantize_into_op(),
      &quantize_blocks_op(),
      &count_flags_op(),
      &amax_op(),
      &scale_from_amax_op(),
      &delayed_scaling_update_op(),
      &norm_fp8_op(),
      &gelu_fp8_op(),
      &dgelu_fp8_op(),
      &grouped_linear_forward_op(),
      &grouped_linear_dgrad_op(),
      &grouped_linear_wgrad_op(),
      &grouped_bias_grad_op(),
      &grouped_fp8_forward_op(),
      &grouped_fp8_dgrad_op(),
      &grouped_fp8_wgrad_op(),
      &norm_forward_op(),
      &norm_backward_op(),
      &norm_backward_into_op(),
      &gelu_op(),
      &gelu_backward_op(),
      &residual_add_op(),
      &embedding_op(),
      &embedding_backward_op(),
      &cross_entropy_op(),
      &vocab_parallel_cross_entropy_stats_op(),
      &vocab_parallel_cross_entropy_rescale_op(),
      &vocab_parallel_cross_entropy_finish_op(),
      &qkv_split_rope_op(),
      &qkv_merge_rope_backward_op(),
      &attention_forward_op(),
      &attention_backward_op(),
      &adamw_op(),
      &lr_schedule_op(),
      &router_topk_op(),
      &router_topk_backward_op(),
      &moe_plan_op(),
      &split_offsets_op(),
      &moe_permute_op(),
      &moe_unpermute_op(),
      &moe_unpermute_backward_op(),
      &pack_op(),
      &unpack_inplace_op(),
      &empty_op(),
      &copy_rows_inplace_op(),
      &order_after_op(),
      &all_reduce_op(),
      &all_reduce_inplace_op(),
      &all_reduce_many_op(),
      &reduce_scatter_op(),
      &reduce_scatter_into_op(),
      &all_gather_op(),
      &broadcast_inplace_op(),
      &send_op(),
      &recv_op(),
      &send_recv_op(),
  };

  return ops;
}

const OpDef& find_op(std::string_view name) {
  std::string known;
  for (const OpDef* op : all_ops()) {
    if (op->name == name) return *op;
    known += known.empty() ? "" : ", ";
    known += op->name;
  }
  SG_THROW(ErrorCode::kInvalidArgument, "unknown op '", name, "'; known ops: ", known);
}

}  // namespace stepgraph::ops

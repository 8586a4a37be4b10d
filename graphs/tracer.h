// Tracer: records the op calls made on a Context into a Program.
//
//   Tracer tracer(ctx);                     // ops on ctx now record, run nothing
//   Tensor y = ops::add(ctx, x, w);         // x, w persistent: y is a traced value
//   TraceResult traced = tracer.finish({y});
//
// Inputs of traced ops must be persistent tensors (fixed addresses the graph
// can read at every replay) or values of this trace. finish() marks the
// outputs live_out and lists the pool values the caller still holds (handles
// alive beyond the step function) that are not outputs: the PoolReport's raw
// material.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "engine/context.h"
#include "graphs/program.h"

namespace stepgraph {

struct TraceResult {
  Program program;
  // Tensors for the program's values that outlive the trace: outputs and held
  // values (traced storage until the capture gives them pool memory), and the
  // persistent tensors the program touches (kept alive with the graph).
  std::vector<std::shared_ptr<detail::TensorImpl>> impls;  // per value id; null if none survives
  std::vector<ValueId> outputs;
  std::vector<ValueId> held;  // pool values still held that are not outputs
};

class Tracer final : public OpRecorder {
 public:
  explicit Tracer(Context& ctx);  // Error if ctx is already tracing
  ~Tracer() override;             // stops tracing if finish() was not reached
  Tracer(const Tracer&) = delete;
  Tracer& operator=(const Tracer&) = delete;

  std::vector<Tensor> record(const OpDef& op, const OpParams& params, std::span<const Tensor> inputs,
                             std::vector<TensorMeta> output_metas, int stream) override;
  void begin_segment(std::string name) override;
  std::uint64_t trace_id() const override { return id_; }
  void begin_if_zero(const Tensor& flag) override;
  void end_if_zero() override;

  // Stops tracing. `outputs` must be values of this trace or persistent tensors
  // (returned unchanged, read by no op or not: the output is that tensor).
  TraceResult finish(std::span<const Tensor> outputs);

 private:
  ValueId value_of(const Tensor& tensor, std::string_view op);
  // An Error if `id` was made inside a conditional body that has ended.
  void check_not_from_body(ValueId id, std::string_view op) const;

  Context& ctx_;
  std::uint64_t id_;
  bool active_ = true;
  Program program_;
  std::vector<std::weak_ptr<detail::TensorImpl>> pool_handles_;   // per value id (empty for persistent)
  std::vector<std::shared_ptr<detail::TensorImpl>> persistents_;  // per value id (null for pool values)
  std::unordered_map<const detail::TensorImpl*, ValueId> persistent_values_;
  // Conditional bodies: the first value id made inside the open one (-1 for
  // none open), and [first, end) of the value ids each closed one made.
  ValueId body_first_value_ = -1;
  std::vector<std::pair<ValueId, ValueId>> closed_bodies_;
};

}  // namespace stepgraph

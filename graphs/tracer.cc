#include "graphs/tracer.h"

#include <atomic>

#include "engine/error.h"
#include "engine/logging.h"

namespace stepgraph {
namespace {
std::atomic<std::uint64_t> next_trace_id{1};
}  // namespace

Tracer::Tracer(Context& ctx) : ctx_(ctx), id_(next_trace_id++) { ctx_.set_recorder(this); }

Tracer::~Tracer() {
  if (active_) ctx_.set_recorder(nullptr);
}

ValueId Tracer::value_of(const Tensor& tensor, std::string_view op) {
  const auto& impl = tensor.impl();
  switch (impl->storage()) {
    case StorageKind::kTraced:
      SG_CHECK(impl->trace_id() == id_, "op ", op, ": tensor '", impl->name(),
               "' is a value of another trace; values cannot cross captures (return it as an output there and "
               "copy it into a persistent tensor)");
      return impl->value();
    case StorageKind::kPersistent: {
      auto [it, inserted] = persistent_values_.try_emplace(impl.get(), -1);
      if (inserted) {
        it->second = program_.add_value(impl->name(), impl->meta(), ValueKind::kPersistent);
        pool_handles_.emplace_back();
        persistents_.push_back(impl);
      }
      return it->second;
    }
    case StorageKind::kEager:
      SG_THROW(ErrorCode::kInvalidArgument, "op ", op, ": tensor '", impl->name(),
               "' was computed eagerly outside this trace; a captured step reads only persistent tensors "
               "(Context::persistent) and its own values, so that every replay finds them at a fixed address");
    case StorageKind::kPool:
    case StorageKind::kUnavailable:
      SG_THROW(ErrorCode::kInvalidArgument, "op ", op, ": tensor '", impl->name(),
               "' lives in another graph's pool, which its replays overwrite; copy it into a persistent tensor "
               "first");
  }
  SG_THROW(ErrorCode::kInternal, "unknown storage kind");
}

void Tracer::check_not_from_body(ValueId id, std::string_view op) const {
  if (program_.value(id).kind != ValueKind::kPool) return;  // persistent: written in place, kept either way
  for (const auto& [first, end] : closed_bodies_) {
    SG_CHECK(id < first || id >= end, "op ", op, ": '", program_.value(id).name,
             "' was made inside a run_if_zero body, so where the body is skipped it holds nothing; use it inside "
             "the body, or make it before");
  }
}

std::vector<Tensor> Tracer::record(const OpDef& op, const OpParams& params, std::span<const Tensor> inputs,
                                   std::vector<TensorMeta> output_metas, int stream) {
  SG_CHECK_CODE(active_, ErrorCode::kInvalidState, "op ", op.name, " called on a finished trace");
  const bool in_body = body_first_value_ >= 0;
  SG_CHECK(!in_body || op.collective == nullptr, "op ", op.name,
           " is a collective inside a run_if_zero body; collectives inside CUDA conditional nodes fail to "
           "instantiate (NCCL #1986): run it before the body");
  Instruction instruction;
  instruction.op = &op;
  instruction.params = params;
  instruction.stream = in_body ? 0 : stream;  // a conditional body runs on the main stream
  for (const Tensor& input : inputs) {
    instruction.inputs.push_back(value_of(input, op.name));
    check_not_from_body(instruction.inputs.back(), op.name);
    // Names given after an op call (set_name) reach the program here, while
    // the handle is certainly alive.
    program_.value(instruction.inputs.back()).name = input.name();
  }
  std::vector<Tensor> outputs;
  for (TensorMeta& meta : output_metas) {
    const ValueId id = program_.add_value(std::string(op.name), meta, ValueKind::kPool);
    auto impl = detail::TensorImpl::traced(ctx_.state(), std::move(meta), std::string(op.name), id, id_);
    pool_handles_.push_back(impl);
    persistents_.emplace_back();
    instruction.outputs.push_back(id);
    outputs.emplace_back(std::move(impl));
  }
  program_.add_instruction(std::move(instruction));
  return outputs;
}

void Tracer::begin_segment(std::string name) {
  SG_CHECK(body_first_value_ < 0, "begin_segment('", name, "') inside a run_if_zero body; a body stays in one segment");
  program_.begin_segment(std::move(name));
}

void Tracer::begin_if_zero(const Tensor& flag) {
  SG_CHECK_CODE(active_, ErrorCode::kInvalidState, "run_if_zero on a finished trace");
  SG_CHECK(body_first_value_ < 0, "run_if_zero inside another run_if_zero body; bodies do not nest");
  Instruction instruction;
  instruction.op = &if_zero_begin_op();
  instruction.inputs.push_back(value_of(flag, "run_if_zero"));
  check_not_from_body(instruction.inputs.back(), "run_if_zero");
  program_.add_instruction(std::move(instruction));
  body_first_value_ = static_cast<ValueId>(program_.values().size());
}

void Tracer::end_if_zero() {
  SG_CHECK_CODE(body_first_value_ >= 0, ErrorCode::kInternal, "end_if_zero without begin_if_zero");
  Instruction instruction;
  instruction.op = &if_end_op();
  program_.add_instruction(std::move(instruction));
  closed_bodies_.emplace_back(body_first_value_, static_cast<ValueId>(program_.values().size()));
  body_first_value_ = -1;
}

TraceResult Tracer::finish(std::span<const Tensor> outputs) {
  SG_CHECK_CODE(active_, ErrorCode::kInvalidState, "Tracer::finish() called twice");
  SG_CHECK_CODE(body_first_value_ < 0, ErrorCode::kInternal, "a run_if_zero body was left open");
  active_ = false;
  ctx_.set_recorder(nullptr);

  TraceResult result;
  for (const Tensor& output : outputs) {
    SG_CHECK(output.defined(), "a step output is undefined (default-constructed)");
    SG_CHECK(output.context_id() == ctx_.id(), "step output '", output.name(), "' belongs to another context");
    const ValueId id = value_of(output, "(step outputs)");
    check_not_from_body(id, "(step outputs)");
    result.outputs.push_back(id);
    if (program_.value(id).kind == ValueKind::kPool) program_.value(id).live_out = true;
  }
  // Sized after the outputs: a persistent tensor returned unchanged, which no
  // op of the step read, becomes a value only in the loop above.
  result.impls.resize(program_.values().size());
  for (ValueId id = 0; id < static_cast<ValueId>(program_.values().size()); ++id) {
    ValueInfo& value = program_.value(id);
    if (value.kind == ValueKind::kPersistent) {
      result.impls[id] = persistents_[id];
      continue;
    }
    auto impl = pool_handles_[id].lock();
    if (impl == nullptr) continue;
    value.name = impl->name();  // names set after the op call (set_name) count
    result.impls[id] = impl;
    if (!value.live_out) result.held.push_back(id);
  }
  result.program = std::move(program_);
  return result;
}

}  // namespace stepgraph

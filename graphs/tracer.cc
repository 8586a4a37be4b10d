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

std::vector<Tensor> Tracer::record(const OpDef& op, const OpParams& params, std::span<const Tensor> inputs,
                                   std::vector<TensorMeta> output_metas, int stream) {
  SG_CHECK_CODE(active_, ErrorCode::kInvalidState, "op ", op.name, " called on a finished trace");
  Instruction instruction;
  instruction.op = &op;
  instruction.params = params;
  instruction.stream = stream;
  for (const Tensor& input : inputs) {
    instruction.inputs.push_back(value_of(input, op.name));
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

void Tracer::begin_segment(std::string name) { program_.begin_segment(std::move(name)); }

TraceResult Tracer::finish(std::span<const Tensor> outputs) {
  SG_CHECK_CODE(active_, ErrorCode::kInvalidState, "Tracer::finish() called twice");
  active_ = false;
  ctx_.set_recorder(nullptr);

  TraceResult result;
  result.impls.resize(program_.values().size());
  for (const Tensor& output : outputs) {
    SG_CHECK(output.defined(), "a step output is undefined (default-constructed)");
    SG_CHECK(output.context_id() == ctx_.id(), "step output '", output.name(), "' belongs to another context");
    const ValueId id = value_of(output, "(step outputs)");
    result.outputs.push_back(id);
    if (program_.value(id).kind == ValueKind::kPool) program_.value(id).live_out = true;
  }
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

// The C API's captured steps (a C step function or a train step), their
// replay, outputs and pool report, and the graph cache.
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "capi/handles.h"
#include "graphs/program_dump.h"

using namespace stepgraph;  // NOLINT(google-build-using-namespace): the C entry points below
using capi::require;
using capi::run_guarded;

namespace {

thread_local std::string step_error;  // set by a failing step function (sg_step_error)

// What the cache holds: the step and the context it needs alive (destroyed in
// that order). See Note [Handles hold references] in handles.h.
class CachedStep final : public CachedGraph {
 public:
  CachedStep(std::shared_ptr<Context> ctx, std::shared_ptr<CapturedStep> step)
      : ctx_(std::move(ctx)), step_(std::move(step)) {}
  std::int64_t pool_bytes() const override { return step_->pool_bytes(); }
  const std::shared_ptr<CapturedStep>& step() const { return step_; }

 private:
  std::shared_ptr<Context> ctx_;
  std::shared_ptr<CapturedStep> step_;
};

// The step behind a live graph handle (the shared_ptr keeps it alive for the call).
std::shared_ptr<CapturedStep> step_of(sg_graph graph, const char* function) {
  return capi::handle_object(graph, function, "graph")->step;
}

// The body of a graph call that writes one value: the handle checked, then
// `out` required, then `*out = read(step)`; an error names `function`.
template <typename T, typename Read>
sg_result read_step(const char* function, sg_graph graph, T* out, const Read& read) {
  return run_guarded(function, [&] {
    const std::shared_ptr<CapturedStep> owner = step_of(graph, function);
    require(out, function, "out");
    *out = read(*owner);
  });
}

std::shared_ptr<GraphCache> cache_of(sg_graph_cache cache, const char* function) {
  const std::shared_ptr<sg_graph_cache_s> owner = capi::handle_object(cache, function, "cache");
  return {owner, &owner->cache};  // aliases the handle's object
}

}  // namespace

namespace stepgraph::capi {

std::shared_ptr<CapturedStep> capture_step_function(Context& ctx, sg_step_fn fn, void* user,
                                                    sg_pool_report_policy policy) {
  require(reinterpret_cast<const void*>(fn), "sg_capture", "fn");
  const CaptureOptions options{.pool_report_policy = to_policy(policy)};
  return CapturedStep::capture(
      ctx,
      [&]() -> std::vector<Tensor> {
        constexpr std::size_t kCapacity = 64;
        std::vector<sg_tensor> handles(kCapacity, nullptr);
        std::size_t count = 0;
        step_error.clear();
        const int status = fn(user, handles.data(), kCapacity, &count);
        // The handles written are ours now, whatever happens next: each valid
        // one leaves the table; the first bad one fails the capture.
        std::vector<std::shared_ptr<sg_tensor_s>> owned;
        std::exception_ptr bad_output;
        for (std::size_t i = 0; i < std::min(count, kCapacity); ++i) {
          try {
            owned.push_back(take_handle(handles[i], "sg_capture", "the step function's output " + std::to_string(i)));
          } catch (const Error&) {
            if (!bad_output) bad_output = std::current_exception();
            owned.push_back(nullptr);
          }
        }
        SG_CHECK(status == 0, "the step function failed (it returned ", status, ")",
                 step_error.empty() ? std::string() : ": " + step_error);
        SG_CHECK(count <= kCapacity, "the step function returned ", count, " outputs; at most ", kCapacity);
        if (bad_output) std::rethrow_exception(bad_output);
        std::vector<Tensor> outputs;
        for (std::size_t i = 0; i < count; ++i) {
          SG_CHECK(owned[i] != nullptr, "the step function's output ", i, " is NULL");
          outputs.push_back(owned[i]->tensor);
        }
        return outputs;
      },
      options);
}

}  // namespace stepgraph::capi

extern "C" void sg_step_error(const char* message) {
  try {
    step_error = message != nullptr ? message : "";
  } catch (...) {
  }
}

extern "C" sg_result sg_capture(sg_context ctx, sg_step_fn fn, void* user, sg_pool_report_policy policy,
                                sg_graph* out) {
  return run_guarded(__func__, [&, function = __func__] {
    const std::shared_ptr<Context> context = capi::context_of(ctx, function);
    require(out, function, "out");
    *out = nullptr;
    auto step = capi::capture_step_function(*context, fn, user, policy);
    *out = capi::issue_handle(std::make_shared<sg_graph_s>(sg_graph_s{context, std::move(step), nullptr}));
  });
}

extern "C" sg_result sg_train_step_capture(sg_train_step step, sg_pool_report_policy policy, sg_graph* out) {
  return run_guarded(__func__, [&, function = __func__] {
    const std::shared_ptr<capi::TrainStepState> state = capi::handle_object(step, function, "step")->state;
    require(out, function, "out");
    *out = nullptr;
    // A data-parallel step's ranks compare the collectives they would record (CaptureOptions::communicators).
    auto captured = CapturedStep::capture(
        *state->ctx, [&] { return (*state->step)(*state->ctx); },
        {.pool_report_policy = capi::to_policy(policy), .communicators = state->step->communicators()});
    *out = capi::issue_handle(std::make_shared<sg_graph_s>(sg_graph_s{state->ctx, std::move(captured), state}));
  });
}

extern "C" sg_result sg_graph_destroy(sg_graph graph) { return capi::destroy_handle(graph, __func__, "graph"); }

namespace {

// sg_graph_replay and sg_graph_replay_ordered: bindings from the C arrays.
void replay_from_c(const char* function, sg_graph graph, const sg_tensor* static_inputs, const sg_tensor* sources,
                   size_t count, void* const* source_streams, size_t stream_count) {
  const std::shared_ptr<CapturedStep> step = step_of(graph, function);
  std::vector<InputBinding> bindings;
  if (count > 0) {
    require(static_inputs, function, "static_inputs");
    require(sources, function, "sources");
  }
  for (size_t i = 0; i < count; ++i) {
    const std::string index = "[" + std::to_string(i) + "]";
    bindings.push_back({capi::handle_object(static_inputs[i], function, "static_inputs" + index)->tensor,
                        capi::handle_object(sources[i], function, "sources" + index)->tensor});
  }
  if (stream_count > 0) require(source_streams, function, "source_streams");
  std::vector<CUstream_st*> streams;
  for (size_t i = 0; i < stream_count; ++i) streams.push_back(static_cast<CUstream_st*>(source_streams[i]));
  step->replay(bindings, streams);
}

}  // namespace

extern "C" sg_result sg_graph_replay(sg_graph graph, const sg_tensor* static_inputs, const sg_tensor* sources,
                                     size_t count) {
  return run_guarded(__func__, [&, function = __func__] {
    replay_from_c(function, graph, static_inputs, sources, count, nullptr, 0);
  });
}

extern "C" sg_result sg_graph_replay_ordered(sg_graph graph, const sg_tensor* static_inputs, const sg_tensor* sources,
                                             size_t count, void* const* source_streams, size_t stream_count) {
  return run_guarded(__func__, [&, function = __func__] {
    replay_from_c(function, graph, static_inputs, sources, count, source_streams, stream_count);
  });
}

extern "C" sg_result sg_graph_output_count(sg_graph graph, size_t* out) {
  return read_step(__func__, graph, out, [](const CapturedStep& step) { return step.outputs().size(); });
}

extern "C" sg_result sg_graph_output(sg_graph graph, size_t index, sg_tensor* out) {
  return run_guarded(__func__, [&, function = __func__] {
    const std::shared_ptr<sg_graph_s> g = capi::handle_object(graph, function, "graph");
    const CapturedStep& step = *g->step;
    require(out, function, "out");
    *out = nullptr;
    SG_CHECK(index < step.outputs().size(), function, ": output ", index, " does not exist; the step has ",
             step.outputs().size());
    *out = capi::new_tensor_handle(g->ctx, step.outputs()[index]);
  });
}

extern "C" sg_result sg_graph_replay_count(sg_graph graph, int64_t* out) {
  return read_step(__func__, graph, out, [](const CapturedStep& step) { return step.replay_count(); });
}

extern "C" sg_result sg_graph_segment_count(sg_graph graph, size_t* out) {
  return read_step(__func__, graph, out, [](const CapturedStep& step) { return step.segment_count(); });
}

extern "C" sg_result sg_graph_pool_bytes(sg_graph graph, int64_t* out) {
  return read_step(__func__, graph, out, [](const CapturedStep& step) { return step.pool_bytes(); });
}

extern "C" sg_result sg_graph_pool_report_count(sg_graph graph, size_t* count, int64_t* bytes) {
  return run_guarded(__func__, [&, function = __func__] {
    const std::shared_ptr<CapturedStep> step = step_of(graph, function);
    const PoolReport& report = step->report();
    if (count != nullptr) *count = report.entries.size();
    if (bytes != nullptr) *bytes = report.total_bytes();
  });
}

extern "C" sg_result sg_graph_pool_report(sg_graph graph, char* buffer, size_t capacity, size_t* length) {
  return run_guarded(__func__, [&, function = __func__] {
    const std::shared_ptr<CapturedStep> step = step_of(graph, function);
    capi::copy_string(step->report().to_string(), buffer, capacity, length);
  });
}

extern "C" sg_result sg_graph_dump(sg_graph graph, char* buffer, size_t capacity, size_t* length) {
  return run_guarded(__func__, [&, function = __func__] {
    const std::shared_ptr<CapturedStep> owner = step_of(graph, function);
    const CapturedStep& step = *owner;
    capi::copy_string(dump_program(step.program(), &step.plan()), buffer, capacity, length);
  });
}

extern "C" sg_result sg_graph_profile(sg_graph graph) {
  return run_guarded(__func__, [&, function = __func__] {
    const std::shared_ptr<sg_graph_s> g = capi::handle_object(graph, function, "graph");
    const std::shared_ptr<CapturedStep> owner = step_of(graph, function);
    g->last_profile = owner->profile().to_string();
  });
}

extern "C" sg_result sg_graph_last_profile(sg_graph graph, char* buffer, size_t capacity, size_t* length) {
  return run_guarded(__func__, [&, function = __func__] {
    const std::shared_ptr<sg_graph_s> g = capi::handle_object(graph, function, "graph");
    SG_CHECK_CODE(!g->last_profile.empty(), ErrorCode::kInvalidState, function,
                  ": this graph has no profile yet; call sg_graph_profile first");
    capi::copy_string(g->last_profile, buffer, capacity, length);
  });
}

extern "C" sg_result sg_graph_release_pool(sg_graph graph) {
  return run_guarded(__func__, [&, function = __func__] { step_of(graph, function)->release_pool(); });
}

namespace {

// One context's graphs never meet another's: the key names the context too.
GraphKey cache_key(const char* key, const char* function, const Context* ctx) {
  require(key, function, "key");
  SG_CHECK(key[0] != '\0', function, ": key is empty; a key names everything the graph depends on");
  GraphKey out;
  out.add("key", std::string_view(key));
  out.add("context", ctx->id());
  return out;
}

}  // namespace

extern "C" sg_result sg_graph_cache_create(int64_t max_pool_bytes, sg_graph_cache* out) {
  return run_guarded(__func__, [&, function = __func__] {
    require(out, function, "out");
    *out = nullptr;
    *out = capi::issue_handle(std::make_shared<sg_graph_cache_s>(max_pool_bytes));
  });
}

extern "C" sg_result sg_graph_cache_destroy(sg_graph_cache cache) {
  return capi::destroy_handle(cache, __func__, "cache");
}

extern "C" sg_result sg_graph_cache_get_or_capture(sg_graph_cache cache, const char* key, sg_context ctx, sg_step_fn fn,
                                                   void* user, sg_pool_report_policy policy, sg_graph* out) {
  return run_guarded(__func__, [&, function = __func__] {
    const std::shared_ptr<GraphCache> graphs = cache_of(cache, function);
    const std::shared_ptr<Context> context = capi::context_of(ctx, function);
    require(out, function, "out");
    *out = nullptr;
    const std::function<std::shared_ptr<CachedStep>()> capture = [&] {
      return std::make_shared<CachedStep>(context, capi::capture_step_function(*context, fn, user, policy));
    };
    const auto entry = graphs->get_or_capture<CachedStep>(cache_key(key, function, context.get()), capture);
    *out = capi::issue_handle(std::make_shared<sg_graph_s>(sg_graph_s{context, entry->step(), nullptr}));
  });
}

extern "C" sg_result sg_graph_cache_contains(sg_graph_cache cache, const char* key, sg_context ctx, int* out) {
  return run_guarded(__func__, [&, function = __func__] {
    const std::shared_ptr<GraphCache> graphs = cache_of(cache, function);
    const std::shared_ptr<Context> context = capi::context_of(ctx, function);
    require(out, function, "out");
    *out = graphs->contains(cache_key(key, function, context.get())) ? 1 : 0;
  });
}

extern "C" sg_result sg_graph_cache_erase(sg_graph_cache cache, const char* key, sg_context ctx) {
  return run_guarded(__func__, [&, function = __func__] {
    const std::shared_ptr<GraphCache> graphs = cache_of(cache, function);
    const std::shared_ptr<Context> context = capi::context_of(ctx, function);
    graphs->erase(cache_key(key, function, context.get()));
  });
}

extern "C" sg_result sg_graph_cache_clear(sg_graph_cache cache) {
  return run_guarded(__func__, [&, function = __func__] {
    const std::shared_ptr<GraphCache> graphs = cache_of(cache, function);
    graphs->clear();
  });
}

extern "C" sg_result sg_graph_cache_get_stats(sg_graph_cache cache, sg_graph_cache_stats* out) {
  return run_guarded(__func__, [&, function = __func__] {
    const std::shared_ptr<GraphCache> graphs = cache_of(cache, function);
    require(out, function, "out");
    const GraphCache::Stats s = graphs->stats();
    *out = {s.hits, s.misses, s.captures, s.evictions, s.entries, s.pool_bytes};
  });
}

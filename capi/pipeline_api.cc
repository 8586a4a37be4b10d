// The C API's per-layer graphs for pipeline schedules (train/graphed_layers.h).
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "capi/handles.h"
#include "train/pipeline_schedule.h"

using namespace stepgraph;  // NOLINT(google-build-using-namespace): the C entry points below
using capi::require;
using capi::run_guarded;

namespace {

std::shared_ptr<sg_graphed_layers_s> graphed_of(sg_graphed_layers graphed, const char* function) {
  return capi::handle_object(graphed, function, "graphed");
}

std::vector<CUstream_st*> streams_from_c(void* const* source_streams, size_t stream_count, const char* function) {
  if (stream_count > 0) require(source_streams, function, "source_streams");
  std::vector<CUstream_st*> streams;
  for (size_t i = 0; i < stream_count; ++i) streams.push_back(static_cast<CUstream_st*>(source_streams[i]));
  return streams;
}

Tensor optional_source(sg_tensor source, const char* function, const char* what) {
  return source == nullptr ? Tensor{} : capi::handle_object(source, function, what)->tensor;
}

// GraphedLayers::forward or ::backward.
using Pass = const Tensor& (GraphedLayers::*)(std::int64_t, const Tensor&, std::span<CUstream_st* const>);

// sg_graphed_layers_forward and _backward: replay the pass of `microbatch`,
// hand back its result.
sg_result replay_pass(Pass pass, const char* function, sg_graphed_layers graphed, int64_t microbatch,
                      sg_tensor source, const char* what, void* const* source_streams, size_t stream_count,
                      sg_tensor* out) {
  return run_guarded(function, [&] {
    if (out != nullptr) *out = nullptr;
    const std::shared_ptr<sg_graphed_layers_s> g = graphed_of(graphed, function);
    const Tensor result = ((*g->graphed).*pass)(microbatch, optional_source(source, function, what),
                                                streams_from_c(source_streams, stream_count, function));
    if (out != nullptr) *out = capi::new_tensor_handle(g->ctx, result);
  });
}

// sg_graphed_layers_input and _grad_output: a new handle to a microbatch's static tensor.
template <typename Get>
void static_tensor(sg_graphed_layers graphed, sg_tensor* out, const char* function, Get&& get) {
  require(out, function, "out");
  *out = nullptr;
  const std::shared_ptr<sg_graphed_layers_s> g = graphed_of(graphed, function);
  *out = capi::new_tensor_handle(g->ctx, get(*g->graphed));
}

}  // namespace

extern "C" sg_result sg_graphed_layers_capture(sg_context ctx, const sg_layer* layers, size_t layer_count,
                                               const sg_tensor* sample_inputs, const int64_t* order,
                                               size_t order_length, sg_pool_report_policy policy,
                                               sg_graphed_layers* out) {
  return run_guarded(__func__, [&, function = __func__] {
    require(out, function, "out");
    *out = nullptr;
    auto state = std::make_shared<sg_graphed_layers_s>();
    state->ctx = capi::context_of(ctx, function);
    if (layer_count > 0) require(layers, function, "layers");
    std::vector<AnyLayer*> list;
    for (size_t i = 0; i < layer_count; ++i) {
      const std::string what = "layers[" + std::to_string(i) + "]";
      const std::shared_ptr<sg_layer_s> layer = capi::handle_object(layers[i], function, what);
      SG_CHECK(layer->ctx == state->ctx, function, ": ", what, " belongs to another context");
      state->layers.push_back(layer->layer);
      list.push_back(layer->layer.get());
    }
    if (order_length > 0) require(order, function, "order");
    const PipelineSchedule schedule =
        PipelineSchedule::from_signed(std::vector<std::int64_t>(order, order + order_length));
    const auto microbatches = static_cast<size_t>(schedule.microbatches());
    require(sample_inputs, function, "sample_inputs");
    std::vector<TensorMeta> metas;
    for (size_t m = 0; m < microbatches; ++m) {
      metas.push_back(
          capi::handle_object(sample_inputs[m], function, "sample_inputs[" + std::to_string(m) + "]")->tensor.meta());
    }
    state->graphed = GraphedLayers::capture(*state->ctx, list, metas, schedule,
                                            {.pool_report_policy = capi::to_policy(policy)});
    *out = capi::issue_handle(std::move(state));
  });
}

extern "C" sg_result sg_graphed_layers_destroy(sg_graphed_layers graphed) {
  return capi::destroy_handle(graphed, __func__, "graphed");
}

extern "C" sg_result sg_graphed_layers_forward(sg_graphed_layers graphed, int64_t microbatch, sg_tensor x,
                                               void* const* source_streams, size_t stream_count, sg_tensor* y) {
  return replay_pass(&GraphedLayers::forward, __func__, graphed, microbatch, x, "x", source_streams, stream_count, y);
}

extern "C" sg_result sg_graphed_layers_backward(sg_graphed_layers graphed, int64_t microbatch, sg_tensor dy,
                                                void* const* source_streams, size_t stream_count, sg_tensor* dx) {
  return replay_pass(&GraphedLayers::backward, __func__, graphed, microbatch, dy, "dy", source_streams, stream_count,
                     dx);
}

extern "C" sg_result sg_graphed_layers_input(sg_graphed_layers graphed, int64_t microbatch, sg_tensor* out) {
  return run_guarded(__func__, [&, function = __func__] {
    static_tensor(graphed, out, function, [&](const GraphedLayers& g) { return g.input(microbatch); });
  });
}

extern "C" sg_result sg_graphed_layers_grad_output(sg_graphed_layers graphed, int64_t microbatch, sg_tensor* out) {
  return run_guarded(__func__, [&, function = __func__] {
    static_tensor(graphed, out, function, [&](const GraphedLayers& g) { return g.grad_output(microbatch); });
  });
}

extern "C" sg_result sg_graphed_layers_gradient_count(sg_graphed_layers graphed, size_t* out) {
  return run_guarded(__func__, [&, function = __func__] {
    require(out, function, "out");
    *out = graphed_of(graphed, function)->graphed->gradient_sums().size();
  });
}

extern "C" sg_result sg_graphed_layers_gradient(sg_graphed_layers graphed, size_t index, sg_tensor* out) {
  return run_guarded(__func__, [&, function = __func__] {
    require(out, function, "out");
    *out = nullptr;
    const std::shared_ptr<sg_graphed_layers_s> g = graphed_of(graphed, function);
    const std::vector<Tensor>& sums = g->graphed->gradient_sums();
    SG_CHECK(index < sums.size(), function, ": gradient ", index, " does not exist; the layers have ", sums.size(),
             " parameters");
    *out = capi::new_tensor_handle(g->ctx, sums[index]);
  });
}

extern "C" sg_result sg_graphed_layers_graph_count(sg_graphed_layers graphed, size_t* out) {
  return run_guarded(__func__, [&, function = __func__] {
    require(out, function, "out");
    *out = graphed_of(graphed, function)->graphed->graph_count();
  });
}

extern "C" sg_result sg_graphed_layers_pool_bytes(sg_graphed_layers graphed, int64_t* pool_bytes,
                                                  int64_t* lower_bound_bytes) {
  return run_guarded(__func__, [&, function = __func__] {
    const StepPlan& plan = graphed_of(graphed, function)->graphed->step().plan();
    if (pool_bytes != nullptr) *pool_bytes = plan.pool_bytes;
    if (lower_bound_bytes != nullptr) *lower_bound_bytes = plan.lower_bound_bytes;
  });
}

extern "C" sg_result sg_graphed_layers_next_graph(sg_graphed_layers graphed, char* buffer, size_t capacity,
                                                  size_t* length) {
  return run_guarded(__func__, [&, function = __func__] {
    capi::copy_string(graphed_of(graphed, function)->graphed->next_graph(), buffer, capacity, length);
  });
}

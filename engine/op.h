// Ops: what every op call carries, independent of how it runs.
//
// An op has a stable name, a parameter struct, a check that validates its
// inputs and gives its outputs' shapes and dtypes, a CUDA launcher and a host
// reference. The same OpDef serves eager CUDA, eager host, tracing (only the
// check runs) and the replay of a planned Program. This header knows no CUDA:
// streams are passed as the opaque CUstream_st* that cudaStream_t names.
#pragma once

#include <any>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/dtype.h"
#include "engine/shape.h"

struct CUstream_st;

namespace stepgraph {

// Shape and dtype of a tensor, without storage.
struct TensorMeta {
  Shape shape;
  DType dtype = DType::kFloat32;

  std::int64_t numel() const { return shape.numel(); }
  std::int64_t bytes() const { return shape.bytes(dtype_size(dtype)); }
  bool operator==(const TensorMeta&) const = default;
};

// A type-erased, printable, comparable parameter struct. Any P with
//   bool operator==(const P&) const;  std::string to_string() const;
// can be held:  OpParams params = AxpyParams{0.5f};  params.as<AxpyParams>().alpha
class OpParams {
 public:
  OpParams() = default;
  template <typename P>
  OpParams(P params)  // NOLINT(google-explicit-constructor): params convert implicitly at op call sites
      : value_(std::move(params)),
        to_string_([](const std::any& v) { return std::any_cast<const P&>(v).to_string(); }),
        equal_([](const std::any& a, const std::any& b) {
          return a.type() == b.type() && std::any_cast<const P&>(a) == std::any_cast<const P&>(b);
        }) {}

  template <typename P>
  const P& as() const {
    return std::any_cast<const P&>(value_);
  }
  bool empty() const { return !value_.has_value(); }
  std::string to_string() const { return to_string_ ? to_string_(value_) : ""; }
  bool operator==(const OpParams& other) const {
    if (empty() || other.empty()) return empty() == other.empty();
    return equal_(value_, other.value_);
  }

 private:
  std::any value_;
  std::string (*to_string_)(const std::any&) = nullptr;
  bool (*equal_)(const std::any&, const std::any&) = nullptr;
};

// The parameters of an op that has none.
struct NoParams {
  bool operator==(const NoParams&) const = default;
  std::string to_string() const { return ""; }
};

// Addresses and metadata handed to a launcher or host reference. Inputs come
// first in the order of the call; `outputs` are the op's fresh outputs. An op
// that writes an input in place (see OpDef::mutated_inputs) writes through
// `inputs[i]`'s address.
struct KernelArgs {
  std::span<void* const> inputs;
  std::span<const TensorMeta> input_metas;
  std::span<void* const> outputs;
  std::span<const TensorMeta> output_metas;
};

// A collective call as the ranks see it (OpDef::collective).
struct CollectiveCall {
  std::uint64_t communicator = 0;  // Communicator::id()
  // Point to point (send, recv, send_recv): the ranks this call sends to and
  // receives from; both -1 for the collectives of the whole group.
  int send_to = -1;
  int recv_from = -1;
  bool point_to_point() const { return send_to >= 0 || recv_from >= 0; }
  // What every rank's matching call must equal, without this rank's own
  // numbers: "group=dp size=2 op=sum" (the op name, shapes and dtypes are
  // compared besides).
  std::string signature;
  // A send_recv traced for a peer window: its signal slot, whose receive
  // buffer (the op's output) the captured step announces to its peers
  // (Note [The pool as symmetric memory]); -1 otherwise.
  std::int64_t window_slot = -1;
};

struct OpDef {
  // Stable name, used in Program dumps, graph keys and errors: "axpy".
  std::string_view name;
  // Checks the inputs and params (a clear Error naming the op otherwise) and
  // returns the metas of the fresh outputs.
  std::vector<TensorMeta> (*check)(const OpParams& params, std::span<const TensorMeta> inputs) = nullptr;
  // Indices of inputs the op writes in place (e.g. copy_ writes input 0).
  std::vector<int> mutated_inputs;
  // For ops whose in-place inputs depend on the call (AdamW over N tensors):
  // when set, it decides instead of `mutated_inputs`. See written_inputs().
  std::vector<int> (*mutated_inputs_for)(const OpParams& params, std::size_t input_count) = nullptr;
  // Launches on `stream` (captured or not). Null where there is no CUDA kernel.
  void (*launch_cuda)(const OpParams& params, const KernelArgs& args, CUstream_st* stream) = nullptr;
  // Runs now on the host.
  void (*run_host)(const OpParams& params, const KernelArgs& args) = nullptr;
  // True for ops whose result must be read on the host (such ops cannot be
  // traced: a device-to-host read would end the capture).
  bool reads_to_host = false;
  // Work that must happen before a graph capture on CUDA (library handles,
  // algorithm choice: calls not allowed under stream capture). Optional.
  void (*prepare_cuda)(const OpParams& params, std::span<const TensorMeta> inputs) = nullptr;
  // Collectives only: which Communicator the call runs on and what every
  // rank must agree on (see Note [Collectives are ops] in
  // engine/communicator.h). Such an op goes to the context's communication
  // stream, and a captured step compares its collectives across ranks before
  // recording.
  CollectiveCall (*collective)(const OpParams& params) = nullptr;

  // The inputs this call writes in place.
  std::vector<int> written_inputs(const OpParams& params, std::size_t input_count) const {
    return mutated_inputs_for != nullptr ? mutated_inputs_for(params, input_count) : mutated_inputs;
  }
};

}  // namespace stepgraph

#include "layers/comm_gemm_overlap.h"

#include <array>
#include <utility>
#include <vector>

#include "engine/error.h"
#include "layers/weight_grad_scope.h"
#include "ops/activation_ops.h"
#include "ops/collective_ops.h"
#include "ops/row_ops.h"

namespace stepgraph {

namespace {

constexpr std::array<std::pair<CommOverlap, std::string_view>, 4> kNames{{
    {CommOverlap::kNone, "none"},
    {CommOverlap::kBulk, "bulk"},
    {CommOverlap::kRingExchange, "ring_exchange"},
    {CommOverlap::kPipelined, "pipelined"},
}};

std::vector<std::string_view> split_commas(std::string_view text) {
  std::vector<std::string_view> parts;
  while (true) {
    const std::size_t comma = text.find(',');
    parts.push_back(text.substr(0, comma));
    if (comma == std::string_view::npos) return parts;
    text.remove_prefix(comma + 1);
  }
}

}  // namespace

std::string_view comm_overlap_name(CommOverlap mode) {
  for (const auto& [m, name] : kNames) {
    if (m == mode) return name;
  }
  return "unknown";
}

CommOverlap parse_comm_overlap(std::string_view name) {
  for (const auto& [mode, n] : kNames) {
    if (n == name) return mode;
  }
  SG_CHECK(false, "unknown overlap mode '", name, "'; use none, bulk, ring_exchange or pipelined");
  return CommOverlap::kNone;
}

MLPOverlap MLPOverlap::uniform(CommOverlap mode) { return {mode, mode, mode, mode}; }

MLPOverlap MLPOverlap::overlapped() {
  return {CommOverlap::kRingExchange, CommOverlap::kPipelined, CommOverlap::kRingExchange, CommOverlap::kPipelined};
}

MLPOverlap MLPOverlap::parse(std::string_view text) {
  if (text == "overlap") return overlapped();
  const std::vector<std::string_view> parts = split_commas(text);
  MLPOverlap out;
  if (parts.size() == 1) {
    out = uniform(parse_comm_overlap(parts[0]));
  } else {
    SG_CHECK(parts.size() == 4, "overlap '", text,
             "': give none, bulk, overlap, or four modes joined by commas (fc1_fprop,fc2_fprop,fc2_dgrad,fc1_dgrad)");
    out = {parse_comm_overlap(parts[0]), parse_comm_overlap(parts[1]), parse_comm_overlap(parts[2]),
           parse_comm_overlap(parts[3])};
  }
  out.check("overlap '" + std::string(text) + "'");
  return out;
}

void MLPOverlap::check(std::string_view who) const {
  auto expect = [&](std::string_view field, CommOverlap mode, CommOverlap chunked, std::string_view pair) {
    SG_CHECK(mode == CommOverlap::kNone || mode == CommOverlap::kBulk || mode == chunked, who, ": ", field, " (",
             pair, ") takes none, bulk or ", comm_overlap_name(chunked), ", got ", comm_overlap_name(mode));
  };
  expect("fc1_fprop", fc1_fprop, CommOverlap::kRingExchange, "all-gather then GEMM");
  expect("fc2_fprop", fc2_fprop, CommOverlap::kPipelined, "GEMM then reduce-scatter");
  expect("fc2_dgrad", fc2_dgrad, CommOverlap::kRingExchange, "all-gather then GEMM");
  expect("fc1_dgrad", fc1_dgrad, CommOverlap::kPipelined, "GEMM then reduce-scatter");
}

GraphKey MLPOverlap::key() const {
  GraphKey key;
  key.add("fc1_fprop", comm_overlap_name(fc1_fprop))
      .add("fc2_fprop", comm_overlap_name(fc2_fprop))
      .add("fc2_dgrad", comm_overlap_name(fc2_dgrad))
      .add("fc1_dgrad", comm_overlap_name(fc1_dgrad));
  return key;
}

std::string MLPOverlap::to_string() const {
  std::string out;
  const GraphKey fields = key();
  for (const GraphKey::Field& field : fields.fields()) {
    if (!out.empty()) out += ' ';
    out += field.name + "=" + std::get<std::string>(field.value);
  }
  return out;
}

InlineCollectives::InlineCollectives(Context& ctx) : ctx_(ctx), previous_(ctx.communication_stream()) {
  ctx_.set_communication_stream(-1);
}

InlineCollectives::~InlineCollectives() { ctx_.set_communication_stream(previous_); }

Tensor all_gather_gemm(Context& ctx, Communicator& comm, const Tensor& x, CommOverlap mode, const RowsGemm& gemm) {
  const int n = comm.world_size();
  if (mode != CommOverlap::kRingExchange || n == 1) {
    Tensor gathered;
    {
      std::optional<InlineCollectives> serial;
      if (mode == CommOverlap::kNone) serial.emplace(ctx);
      gathered = ops::all_gather(ctx, comm, x);
    }
    gemm(gathered, 0);
    return gathered;
  }
  // See Note [Communication-GEMM overlap] (ring_exchange).
  const int r = comm.rank();
  const std::int64_t t = x.shape().dim(0);
  std::vector<std::int64_t> dims = x.shape().dims();
  dims[0] = n * t;
  const Tensor gathered = ops::empty(ctx, {Shape(dims), x.dtype()});
  Tensor shard = x;
  for (int step = 0; step < n; ++step) {
    const std::int64_t first_row = ((r - step + n) % n) * t;  // rank r - step's shard
    Tensor next;
    if (step + 1 < n) next = ops::ring_shift(ctx, comm, shard);
    gemm(shard, first_row);
    {
      WeightGradScope side(ctx);  // off the GEMMs' stream; a byte copy
      ops::copy_rows_(ctx, gathered, shard, first_row);
    }
    shard = next;
  }
  return gathered;
}

Tensor gemm_reduce_scatter(Context& ctx, Communicator& comm, std::int64_t all_rows, CommOverlap mode,
                           const PartialRows& partial) {
  const int n = comm.world_size();
  SG_CHECK(all_rows % n == 0, "gemm_reduce_scatter: ", all_rows, " rows do not divide among ", n, " ranks");
  if (mode != CommOverlap::kPipelined || n == 1) {
    const Tensor whole = partial(0, all_rows);
    std::optional<InlineCollectives> serial;
    if (mode == CommOverlap::kNone) serial.emplace(ctx);
    return ops::reduce_scatter(ctx, comm, whole, ReduceOp::kSum);
  }
  // See Note [Communication-GEMM overlap] (pipelined).
  const int r = comm.rank();
  const std::int64_t t = all_rows / n;
  Tensor arrived;  // the sum of the ranks before this one for the current block
  Tensor sum;
  for (int step = 0; step < n; ++step) {
    const int block = ((r - step - 1) % n + n) % n;
    sum = partial(block * t, t);
    if (step > 0) sum = ops::residual_add(ctx, sum, arrived);
    if (step + 1 < n) arrived = ops::ring_shift(ctx, comm, sum);
  }
  return sum;  // block r, every rank's part
}

}  // namespace stepgraph

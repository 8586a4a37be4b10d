#include "layers/parameter.h"

#include <optional>
#include <random>
#include <utility>

#include "engine/error.h"
#include "ops/elementwise_ops.h"
#include "ops/row_ops.h"

namespace stepgraph {

namespace {

// The parameter's tensors, allocated (zero-filled), before any value is written.
Parameter allocate_parameter(Context& ctx, const std::string& name, const Shape& shape, DType dtype) {
  SG_CHECK_CODE(dtype == DType::kFloat32 || dtype == DType::kBFloat16 || dtype == DType::kFloat16,
                ErrorCode::kUnsupported, "parameter '", name, "': dtype ", dtype_name(dtype),
                " is not supported (fp32, bf16, fp16)");
  Parameter p;
  p.name = name;
  p.master = ctx.persistent(name + ".master", {shape, DType::kFloat32});
  p.grad = ctx.persistent(name + ".grad", {shape, DType::kFloat32});
  p.value = dtype == DType::kFloat32 ? p.master : ctx.persistent(name, {shape, dtype});
  return p;
}

void write_initial_values(Context& ctx, const Parameter& p, std::span<const float> init) {
  ctx.copy_from_host(p.master, init.data(), init.size() * sizeof(float));
  sync_copy_from_master(ctx, p);
}

}  // namespace

const Tensor& Parameter::gradient_for_write(Context& ctx) const {
  if (!grad.defined()) {
    SG_CHECK_CODE(step_scoped_gradient, ErrorCode::kInvalidState, "parameter '", name,
                  "' has no gradient tensor: a backward needs a persistent gradient or step-scoped gradients "
                  "(Note [Step-scoped gradients] in layers/parameter.h)");
    // Traced: made on the writer's stream, where its lifetime starts. Eager:
    // on the main stream, where its last handle frees it, so the caching
    // allocator hands the same memory back next step (a cudaMemPool reuses
    // memory freed on another stream only through dependencies it sees:
    // allocated on the weight-gradient stream, the eager large step on an H100
    // grew the device's use to 78.6 GiB).
    std::optional<StreamScope> main_stream;
    if (!ctx.tracing()) main_stream.emplace(ctx, 0);
    grad = ops::empty(ctx, master.meta());  // every element is written by the caller's op
    grad.set_name(name + ".grad");
  }
  return grad;
}

Parameter make_parameter(Context& ctx, const std::string& name, const Shape& shape, DType dtype,
                         std::span<const float> init) {
  SG_CHECK(static_cast<std::int64_t>(init.size()) == shape.numel(), "parameter '", name, "' ", shape, " needs ",
           shape.numel(), " initial values, got ", init.size());
  Parameter p = allocate_parameter(ctx, name, shape, dtype);
  write_initial_values(ctx, p, init);
  return p;
}

Parameter make_parameter(Context& ctx, const std::string& name, const Shape& shape, DType dtype,
                         const ParameterInit& init) {
  Parameter p = allocate_parameter(ctx, name, shape, dtype);
  std::vector<float> values;
  try {
    values = init.values(shape.numel());
  } catch (const std::bad_alloc&) {
    SG_THROW(ErrorCode::kOutOfMemory, "parameter '", name, "' ", shape, ": its ", shape.numel(),
             " initial values do not fit in host memory");
  }
  write_initial_values(ctx, p, values);
  return p;
}

ParameterInit ParameterInit::rows_from(std::int64_t rows, std::int64_t cols, std::int64_t first_row) const {
  ParameterInit out = *this;
  out.slice = Slice::kRows;
  out.full_rows = rows;
  out.full_cols = cols;
  out.first = first_row;
  return out;
}

ParameterInit ParameterInit::columns_from(std::int64_t rows, std::int64_t cols, std::int64_t first_column) const {
  ParameterInit out = rows_from(rows, cols, first_column);
  out.slice = Slice::kColumns;
  return out;
}

ParameterInit ParameterInit::row_blocks_from(std::vector<RowBlock> blocks, std::int64_t cols) const {
  std::int64_t rows = 0;
  for (const RowBlock& b : blocks) {
    SG_CHECK(b.parts > 0 && b.part >= 0 && b.part < b.parts, "ParameterInit: part ", b.part, " of ", b.parts,
             " parts is not a part; give 0 <= part < parts");
    SG_CHECK(b.rows > 0 && b.rows % b.parts == 0, "ParameterInit: a row block of ", b.rows,
             " rows does not split into ", b.parts, " equal parts; make every block a positive multiple of its parts");
    rows += b.rows;
  }
  ParameterInit out = rows_from(rows, cols, 0);
  out.slice = Slice::kRowBlocks;
  out.row_blocks = std::move(blocks);
  return out;
}

std::vector<float> ParameterInit::values(std::int64_t numel) const {
  if (slice == Slice::kWhole) {
    return is_constant ? constant_init(numel, scale_or_value) : uniform_init(numel, scale_or_value, seed);
  }
  // The whole matrix's values, then this parameter's part of them.
  ParameterInit whole = *this;
  whole.slice = Slice::kWhole;
  const std::vector<float> full = whole.values(full_rows * full_cols);
  if (slice == Slice::kRowBlocks) {
    std::vector<float> out;
    out.reserve(static_cast<std::size_t>(numel));
    std::int64_t block_start = 0;
    for (const RowBlock& b : row_blocks) {
      const std::int64_t count = b.rows / b.parts;
      const std::int64_t first_row = block_start + b.part * count;
      out.insert(out.end(), full.begin() + first_row * full_cols, full.begin() + (first_row + count) * full_cols);
      block_start += b.rows;
    }
    SG_CHECK(static_cast<std::int64_t>(out.size()) == numel, "ParameterInit: ", numel,
             " values are not the parts of the row blocks of [", full_rows, ", ", full_cols, "] (", out.size(), ")");
    return out;
  }
  if (slice == Slice::kRows) {
    SG_CHECK(numel % full_cols == 0 && first + numel / full_cols <= full_rows, "ParameterInit: ", numel,
             " values are not whole rows of [", full_rows, ", ", full_cols, "] from row ", first);
    return {full.begin() + first * full_cols, full.begin() + first * full_cols + numel};
  }
  const std::int64_t count = numel / full_rows;
  SG_CHECK(numel % full_rows == 0 && first + count <= full_cols, "ParameterInit: ", numel,
           " values are not whole columns of [", full_rows, ", ", full_cols, "] from column ", first);
  std::vector<float> out;
  out.reserve(static_cast<std::size_t>(numel));
  for (std::int64_t r = 0; r < full_rows; ++r) {
    out.insert(out.end(), full.begin() + r * full_cols + first, full.begin() + r * full_cols + first + count);
  }
  return out;
}

void run_after_update(Context& ctx, const Parameter& parameter) {
  for (const auto& hook : parameter.after_update) hook(ctx);
}

void sync_copy_from_master(Context& ctx, const Parameter& parameter) {
  if (!parameter.has_copy()) {
    run_after_update(ctx, parameter);
    return;
  }
  const Tensor converted = ops::cast(ctx, parameter.master, parameter.value.dtype());
  // copy_ is fp32-only; a cast into the persistent copy goes through a
  // bytewise copy of the converted tensor instead.
  std::vector<std::uint8_t> bytes(static_cast<std::size_t>(converted.bytes()));
  ctx.copy_to_host(converted, bytes.data(), bytes.size());
  ctx.copy_from_host(parameter.value, bytes.data(), bytes.size());
  run_after_update(ctx, parameter);
}

std::vector<float> uniform_init(std::int64_t numel, float scale, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-scale, scale);
  std::vector<float> values(static_cast<std::size_t>(numel));
  for (float& v : values) v = uniform(rng);
  return values;
}

std::vector<float> constant_init(std::int64_t numel, float value) {
  return std::vector<float>(static_cast<std::size_t>(numel), value);
}

std::vector<Tensor> gradients_of(const std::vector<Parameter*>& params) {
  std::vector<Tensor> out;
  for (const Parameter* p : params) out.push_back(p->grad);
  return out;
}

std::vector<Tensor> join_tensors_of(const std::vector<Parameter*>& params) {
  std::vector<Tensor> out;
  for (const Parameter* p : params) {
    if (p->grad.defined()) out.push_back(p->grad);
    if (p->step_scoped_gradient) out.push_back(p->master);
  }
  return out;
}

}  // namespace stepgraph

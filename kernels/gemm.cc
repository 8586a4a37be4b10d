// GEMM on cuBLASLt (see gemm.h). cuBLASLt is column-major, and a row-major
// [r, c] matrix is the column-major [c, r] one with ld = c, so the row-major
//   D[m, n] = opA(A) opB(B)   is the column-major   D^T[n, m] = opB(B)^T opA(A)^T:
// our B is cuBLASLt's A, our A is its B, m and n swap, and each operand keeps
// its own transpose flag (trans_b becomes cuBLASLt's transa).
#include "kernels/gemm.h"

#include <cublasLt.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <sstream>
#include <unordered_map>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "engine/printable_text.h"
#include "kernels/gemm_algorithm_record.h"

namespace stepgraph::kernels {
namespace {

constexpr std::size_t kWorkspaceBytes = kGemmMaxWorkspaceBytes;
constexpr std::uintptr_t kAlignment = 16;
// cuBLAS asks for workspaces aligned like its own allocations.
constexpr std::uintptr_t kWorkspaceAlignment = 256;
constexpr int kHeuristicCandidates = 8;

bool is_gemm_dtype(DType dtype) {
  return dtype == DType::kBFloat16 || dtype == DType::kFloat16 || dtype == DType::kFloat32;
}

bool is_known(GemmEpilogue epilogue) {
  switch (epilogue) {
    case GemmEpilogue::kNone:
    case GemmEpilogue::kBias:
    case GemmEpilogue::kGeluAuxBias:
    case GemmEpilogue::kDGeluBGrad:
    case GemmEpilogue::kBiasGradOfA: return true;
  }
  return false;
}

bool can_accumulate(GemmEpilogue e) { return e == GemmEpilogue::kNone || e == GemmEpilogue::kBiasGradOfA; }

cudaDataType_t cuda_type(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return CUDA_R_32F;
    case DType::kBFloat16: return CUDA_R_16BF;
    case DType::kFloat16: return CUDA_R_16F;
    case DType::kFloat8E4M3: return CUDA_R_8F_E4M3;
    case DType::kFloat8E5M2: return CUDA_R_8F_E5M2;
    default: SG_THROW(ErrorCode::kInternal, "gemm: dtype ", dtype_name(dtype), " got past check_gemm");
  }
}

// In the column-major view our columns are cuBLASLt's rows: the bias (and
// DGELU's bias gradient) has n elements, and BGRADB reduces cuBLASLt's B,
// which is our A, over k, giving m elements.
cublasLtEpilogue_t lt_epilogue(GemmEpilogue epilogue) {
  switch (epilogue) {
    case GemmEpilogue::kNone: return CUBLASLT_EPILOGUE_DEFAULT;
    case GemmEpilogue::kBias: return CUBLASLT_EPILOGUE_BIAS;
    case GemmEpilogue::kGeluAuxBias: return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    case GemmEpilogue::kDGeluBGrad: return CUBLASLT_EPILOGUE_DGELU_BGRAD;
    case GemmEpilogue::kBiasGradOfA: return CUBLASLT_EPILOGUE_BGRADB;
  }
  SG_THROW(ErrorCode::kInternal, "gemm: epilogue ", static_cast<int>(epilogue), " got past check_gemm");
}

// cuBLASLt's scale mode of a block-scaled operand (Note [FP8 GEMMs] in gemm.h).
std::int32_t lt_scale_mode(BlockShape shape) {
  return static_cast<std::int32_t>(shape == BlockShape::k1x128 ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F
                                                                : CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F);
}

// Created on first use (thread-safe static init; a failed creation is
// retried by the next call) and never destroyed: a static destructor could
// run after the CUDA driver has shut down at exit.
cublasLtHandle_t lt_handle() {
  static const cublasLtHandle_t handle = [] {
    cublasLtHandle_t created = nullptr;
    SG_CUBLAS_CHECK(cublasLtCreate(&created));
    return created;
  }();
  return handle;
}

template <typename T>
void set_attribute(cublasLtMatmulDesc_t op, cublasLtMatmulDescAttributes_t attribute, const T& value) {
  SG_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, attribute, &value, sizeof(value)));
}

template <typename T>
void set_preference(cublasLtMatmulPreference_t preference, cublasLtMatmulPreferenceAttributes_t attribute,
                    const T& value) {
  SG_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference, attribute, &value, sizeof(value)));
}

// A row-major [rows, cols] matrix: column-major [cols, rows] with ld = cols.
void init_row_major(cublasLtMatrixLayoutOpaque_t& layout, DType dtype, std::int64_t rows, std::int64_t cols) {
  SG_CUBLAS_CHECK(cublasLtMatrixLayoutInit(&layout, cuda_type(dtype), static_cast<std::uint64_t>(cols),
                                           static_cast<std::uint64_t>(rows), cols));
}

// cuBLASLt's descriptors of one matmul, initialised in place: the Init
// functions allocate nothing, so a launch under stream capture is safe.
struct LtMatmul {
  cublasLtMatmulDescOpaque_t op{};
  cublasLtMatrixLayoutOpaque_t a{};  // our B
  cublasLtMatrixLayoutOpaque_t b{};  // our A
  cublasLtMatrixLayoutOpaque_t d{};  // D, also C: beta reads D in place

  // `vector` is the bias or the bias gradient, `aux` the GELU input; each
  // only where the epilogue uses it.
  LtMatmul(const GemmDesc& desc, const void* vector, const void* aux, const float* a_scale_inv = nullptr,
           const float* b_scale_inv = nullptr) {
    SG_CUBLAS_CHECK(cublasLtMatmulDescInit(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    if (is_fp8(desc.a_type)) {
      set_attribute(&op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, static_cast<std::int8_t>(desc.fast_accumulation ? 1 : 0));
      // cuBLASLt's A is our B and its B our A (see the top of this file).
      if (b_scale_inv != nullptr) set_attribute(&op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, b_scale_inv);
      if (a_scale_inv != nullptr) set_attribute(&op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, a_scale_inv);
      if (desc.a_blocks) {  // block scaling: both operands (check_fp8_gemm)
        set_attribute(&op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, lt_scale_mode(*desc.b_blocks));
        set_attribute(&op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, lt_scale_mode(*desc.a_blocks));
      }
    }
    set_attribute(&op, CUBLASLT_MATMUL_DESC_TRANSA,
                  static_cast<std::int32_t>(desc.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N));
    set_attribute(&op, CUBLASLT_MATMUL_DESC_TRANSB,
                  static_cast<std::int32_t>(desc.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N));
    set_attribute(&op, CUBLASLT_MATMUL_DESC_EPILOGUE, static_cast<std::uint32_t>(lt_epilogue(desc.epilogue)));
    const auto d_type = static_cast<std::int32_t>(cuda_type(desc.d_type));
    if (vector != nullptr) {
      set_attribute(&op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, vector);
      set_attribute(&op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, d_type);
    }
    if (aux != nullptr) {
      set_attribute(&op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, aux);
      set_attribute(&op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, static_cast<std::int64_t>(desc.n));
      set_attribute(&op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, d_type);
    }
    init_row_major(a, desc.b_type, desc.trans_b ? desc.n : desc.k, desc.trans_b ? desc.k : desc.n);
    init_row_major(b, desc.a_type, desc.trans_a ? desc.k : desc.m, desc.trans_a ? desc.m : desc.k);
    init_row_major(d, desc.d_type, desc.m, desc.n);
  }
  LtMatmul(const LtMatmul&) = delete;
  LtMatmul& operator=(const LtMatmul&) = delete;
};

// cuBLASLt's heuristic reads the alignment of every pointer it is given
// (never the memory), and better-aligned operands get faster algorithms (on
// an H100, 8192^3 bf16 ran 20% slower with an algorithm chosen for 16-byte
// alignment). So the algorithm is chosen per desc and alignment: the
// smallest power-of-two alignment (16 to 256 bytes) of the operands. The
// pool and the allocators hand out 256-byte-aligned memory (Note [256-byte
// alignment] in engine/memory.h).
// Device memory for timing candidate algorithms, freed without throwing.
class Scratch {
 public:
  explicit Scratch(std::size_t bytes) {
    if (cudaMalloc(&data_, bytes) != cudaSuccess) {
      (void)cudaGetLastError();
      data_ = nullptr;
      return;
    }
    // Non-zero data: zeros can run faster than real values.
    if (cudaMemset(data_, 0x3C, bytes) != cudaSuccess) (void)cudaGetLastError();
  }
  ~Scratch() {
    if (data_ != nullptr) cudaFree(data_);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  void* get() const { return data_; }

 private:
  void* data_ = nullptr;
};

constexpr std::size_t kAutotuneScratchLimit = std::size_t{1} << 30;

// Note [Timing cuBLASLt's candidates]
// The heuristic ranks its candidates by a model; on an H100 its first choice
// for 8192^3 bf16 ran about 9% slower than its second. So the candidates are
// timed once on scratch operands and the fastest is kept (cached with the
// desc, like the heuristic's answer). This allocates and launches, so it runs
// only outside stream capture (gemm_prepare runs before every capture) and
// only where the scratch fits in kAutotuneScratchLimit; otherwise the
// heuristic's first choice stands.
int fastest_candidate(const GemmDesc& desc, const cublasLtMatmulHeuristicResult_t* results, int count) {
  const std::size_t a_bytes = static_cast<std::size_t>(desc.m * desc.k) * dtype_size(desc.a_type);
  const std::size_t b_bytes = static_cast<std::size_t>(desc.k * desc.n) * dtype_size(desc.b_type);
  const std::size_t d_bytes = static_cast<std::size_t>(desc.m * desc.n) * dtype_size(desc.d_type);
  const std::size_t vector_bytes = static_cast<std::size_t>(std::max(desc.m, desc.n)) * dtype_size(desc.d_type);
  if (count < 2 || a_bytes + b_bytes + 2 * d_bytes + vector_bytes + kWorkspaceBytes > kAutotuneScratchLimit) return 0;
  Scratch a(a_bytes), b(b_bytes), d(d_bytes), aux(d_bytes), vector(vector_bytes), workspace(kWorkspaceBytes);
  if (!a.get() || !b.get() || !d.get() || !aux.get() || !vector.get() || !workspace.get()) return 0;
  // Block scales (a scalar scale may stay null: it reads as 1).
  const auto scales_bytes = [&](const std::optional<BlockShape>& blocks, std::int64_t outer) {
    return blocks ? static_cast<std::size_t>(BlockScaleLayout{*blocks, outer, desc.k}.count()) * sizeof(float) : 16;
  };
  Scratch a_scales(scales_bytes(desc.a_blocks, desc.m)), b_scales(scales_bytes(desc.b_blocks, desc.n));
  if (!a_scales.get() || !b_scales.get()) return 0;
  if (cudaDeviceSynchronize() != cudaSuccess) {  // the memsets, so they do not overlap the timing
    (void)cudaGetLastError();
    return 0;
  }
  const bool has_vector = epilogue_reads_bias(desc.epilogue) || epilogue_writes_bias_grad(desc.epilogue);
  LtMatmul problem(desc, has_vector ? vector.get() : nullptr, epilogue_uses_aux(desc.epilogue) ? aux.get() : nullptr,
                   desc.a_blocks ? static_cast<const float*>(a_scales.get()) : nullptr,
                   desc.b_blocks ? static_cast<const float*>(b_scales.get()) : nullptr);
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess ||
      cudaEventCreate(&start) != cudaSuccess || cudaEventCreate(&stop) != cudaSuccess) {
    (void)cudaGetLastError();
    if (stream) cudaStreamDestroy(stream);
    if (start) cudaEventDestroy(start);
    return 0;
  }
  const float alpha = desc.alpha;
  const float beta = desc.beta;
  int best = 0;
  float best_ms = 0.0f;
  for (int i = 0; i < count; ++i) {
    if (results[i].state != CUBLAS_STATUS_SUCCESS || results[i].workspaceSize > kWorkspaceBytes) continue;
    const auto launch = [&] {
      return cublasLtMatmul(lt_handle(), &problem.op, &alpha, b.get(), &problem.a, a.get(), &problem.b, &beta, d.get(),
                            &problem.d, d.get(), &problem.d, &results[i].algo, workspace.get(), kWorkspaceBytes,
                            stream);
    };
    if (launch() != CUBLAS_STATUS_SUCCESS) continue;  // warm-up; a candidate that fails is skipped
    cudaEventRecord(start, stream);
    constexpr int kTimedLaunches = 5;
    for (int r = 0; r < kTimedLaunches; ++r) launch();
    cudaEventRecord(stop, stream);
    float ms = 0.0f;
    if (cudaEventSynchronize(stop) != cudaSuccess || cudaEventElapsedTime(&ms, start, stop) != cudaSuccess) {
      (void)cudaGetLastError();
      continue;
    }
    if (best_ms == 0.0f || ms < best_ms) {
      best = i;
      best_ms = ms;
    }
  }
  cudaStreamSynchronize(stream);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaStreamDestroy(stream);
  return best;
}

// An algorithm and the workspace it needs.
struct Selected {
  cublasLtMatmulAlgo_t algo;
  std::size_t workspace = 0;
};

// `limit`: the most workspace the algorithm may need.
Selected select_algo(const GemmDesc& desc, std::uintptr_t alignment, bool may_time, std::size_t limit) {
  const void* probe = reinterpret_cast<const void*>(alignment);
  const bool has_vector = epilogue_reads_bias(desc.epilogue) || epilogue_writes_bias_grad(desc.epilogue);
  // Block-scaled operands need their scale pointers set for the heuristic to accept the modes.
  const auto* scale_probe = static_cast<const float*>(probe);
  LtMatmul problem(desc, has_vector ? probe : nullptr, epilogue_uses_aux(desc.epilogue) ? probe : nullptr,
                   desc.a_blocks ? scale_probe : nullptr, desc.b_blocks ? scale_probe : nullptr);
  cublasLtMatmulPreferenceOpaque_t preference{};
  SG_CUBLAS_CHECK(cublasLtMatmulPreferenceInit(&preference));
  set_preference(&preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, std::uint64_t{limit});
  for (const auto attribute :
       {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
    set_preference(&preference, attribute, static_cast<std::uint32_t>(alignment));
  }
  cublasLtMatmulHeuristicResult_t results[kHeuristicCandidates] = {};
  int returned = 0;
  const cublasStatus_t status =
      cublasLtMatmulAlgoGetHeuristic(lt_handle(), &problem.op, &problem.a, &problem.b, &problem.d, &problem.d,
                                     &preference, kHeuristicCandidates, results, &returned);
  // NOT_SUPPORTED is the heuristic's "no algorithm": reported below.
  if (status != CUBLAS_STATUS_NOT_SUPPORTED) SG_CUBLAS_CHECK(status);
  // See Note [Deterministic algorithm choice]: only a timed desc is timed.
  const bool timed = may_time && desc.algorithm == AlgorithmChoice::kTimed;
  const int first = timed ? fastest_candidate(desc, results, returned) : 0;
  for (int i = first; i < returned; ++i) {
    if (results[i].state == CUBLAS_STATUS_SUCCESS && results[i].workspaceSize <= limit) {
      return {results[i].algo, results[i].workspaceSize};
    }
  }
  SG_THROW(ErrorCode::kUnsupported, "gemm: cuBLASLt has no algorithm for ", desc.to_string(), " on this device within ",
           limit, " bytes of workspace; change the dtypes, the epilogue or the layout");
}

struct GemmDescHash {
  std::size_t operator()(const GemmDesc& desc) const noexcept {
    std::size_t seed = 0;
    const auto mix = [&seed](std::size_t value) { seed ^= value + 0x9e3779b97f4a7c15ull + (seed << 6) + (seed >> 2); };
    mix(std::hash<std::int64_t>{}(desc.m));
    mix(std::hash<std::int64_t>{}(desc.n));
    mix(std::hash<std::int64_t>{}(desc.k));
    mix(static_cast<std::size_t>(desc.trans_a) | static_cast<std::size_t>(desc.trans_b) << 1);
    mix(static_cast<std::size_t>(desc.a_type) | static_cast<std::size_t>(desc.b_type) << 8 |
        static_cast<std::size_t>(desc.d_type) << 16 | static_cast<std::size_t>(desc.epilogue) << 24);
    // std::hash<float> hashes 0.0f and -0.0f alike, as operator== wants.
    mix(std::hash<float>{}(desc.alpha));
    mix(std::hash<float>{}(desc.beta));
    mix(static_cast<std::size_t>(desc.fast_accumulation));
    for (const auto& blocks : {desc.a_blocks, desc.b_blocks}) mix(blocks ? 1 + static_cast<std::size_t>(*blocks) : 0);
    mix(static_cast<std::size_t>(desc.algorithm));
    return seed;
  }
};

// The algorithm of every desc seen, for the device the handle was created
// on, by operand alignment and workspace limit. A launch whose workspace
// holds what the algorithm chosen with the whole kWorkspaceBytes needs takes
// that one (the planned GEMMs: their workspace is sized by it), so a smaller
// workspace never costs the timed choice.
class AlgoCache {
 public:
  Selected get(const GemmDesc& desc, std::uintptr_t alignment, bool may_time, std::size_t limit) {
    const std::lock_guard<std::mutex> lock(mutex_);
    auto& by_key = algos_[desc];
    const Selected& whole = find_or_select(by_key, desc, alignment, may_time, kWorkspaceBytes);
    if (whole.workspace <= limit) return whole;
    return find_or_select(by_key, desc, alignment, may_time, limit);
  }

  // Every algorithm chosen for a timed desc, in a stable order.
  std::vector<GemmAlgorithmPick> timed_picks() {
    const std::lock_guard<std::mutex> lock(mutex_);
    std::vector<GemmAlgorithmPick> picks;
    for (const auto& [desc, by_key] : algos_) {
      if (desc.algorithm != AlgorithmChoice::kTimed) continue;
      for (const auto& [key, selected] : by_key) {
        GemmAlgorithmPick pick{desc, key.first, key.second, selected.workspace, {}};
        static_assert(sizeof(pick.algo) == sizeof(selected.algo.data));
        std::memcpy(pick.algo.data(), selected.algo.data, sizeof(pick.algo));
        picks.push_back(pick);
      }
    }
    std::sort(picks.begin(), picks.end(), [](const GemmAlgorithmPick& a, const GemmAlgorithmPick& b) {
      return a.desc.to_string() + std::to_string(a.alignment) + "/" + std::to_string(a.workspace_limit) <
             b.desc.to_string() + std::to_string(b.alignment) + "/" + std::to_string(b.workspace_limit);
    });
    return picks;
  }

  // Takes recorded picks as this process's choices. A desc already chosen
  // differently here is an Error: the picks must come before the first GEMM.
  void adopt(const std::vector<GemmAlgorithmPick>& picks) {
    const std::lock_guard<std::mutex> lock(mutex_);
    for (const GemmAlgorithmPick& pick : picks) {
      Selected selected{};
      std::memcpy(selected.algo.data, pick.algo.data(), sizeof(pick.algo));
      selected.workspace = pick.workspace;
      auto& by_key = algos_[pick.desc];
      const auto [it, inserted] = by_key.emplace(Key{pick.alignment, pick.workspace_limit}, selected);
      SG_CHECK_CODE(inserted || std::memcmp(it->second.algo.data, selected.algo.data, sizeof(pick.algo)) == 0,
                    ErrorCode::kInvalidState, "adopt_timed_gemm_algorithms: ", pick.desc.to_string(),
                    " already has another algorithm in this process; adopt the record before the first GEMM");
    }
  }

 private:
  using Key = std::pair<std::uintptr_t, std::size_t>;  // alignment, limit
  struct KeyHash {
    std::size_t operator()(const Key& key) const noexcept { return key.first * 1000003u ^ key.second; }
  };
  const Selected& find_or_select(std::unordered_map<Key, Selected, KeyHash>& by_key, const GemmDesc& desc,
                                 std::uintptr_t alignment, bool may_time, std::size_t limit) {
    auto found = by_key.find({alignment, limit});
    if (found == by_key.end()) {
      found = by_key.emplace(Key{alignment, limit}, select_algo(desc, alignment, may_time, limit)).first;
    }
    return found->second;
  }

  std::mutex mutex_;
  std::unordered_map<GemmDesc, std::unordered_map<Key, Selected, KeyHash>, GemmDescHash> algos_;
};

AlgoCache& algo_cache() {
  static AlgoCache cache;
  return cache;
}

// `may_time`: no stream capture is under way, so candidates may be timed
// (see Note [Timing cuBLASLt's candidates]).
Selected cached_algo(const GemmDesc& desc, std::uintptr_t alignment, bool may_time,
                     std::size_t limit = kWorkspaceBytes) {
  return algo_cache().get(desc, alignment, may_time, limit);
}

constexpr std::uintptr_t kBestAlignment = 256;

// The largest power of two in [kAlignment, kBestAlignment] dividing every operand address.
std::uintptr_t alignment_of(const GemmOperands& operands) {
  std::uintptr_t alignment = kBestAlignment;
  for (const void* pointer : {operands.a, operands.b, static_cast<const void*>(operands.d), operands.bias,
                              static_cast<const void*>(operands.aux), static_cast<const void*>(operands.bias_grad)}) {
    if (pointer == nullptr) continue;
    const auto address = reinterpret_cast<std::uintptr_t>(pointer);
    while (alignment > kAlignment && address % alignment != 0) alignment /= 2;
  }
  return alignment;
}

void check_pointer(const void* pointer, const char* role, const GemmDesc& desc, std::uintptr_t alignment = kAlignment) {
  SG_CHECK(pointer != nullptr, "gemm: operand '", role, "' is null, but ", desc.to_string(), " needs it");
  SG_CHECK(reinterpret_cast<std::uintptr_t>(pointer) % alignment == 0, "gemm: operand '", role, "' at ", pointer,
           " is not ", alignment, "-byte aligned (", desc.to_string(),
           "); pass an allocation, or an offset into one "
           "that is a multiple of ",
           alignment, " bytes");
}

void check_operands(const GemmDesc& desc, const GemmOperands& operands) {
  check_pointer(operands.a, "a", desc);
  check_pointer(operands.b, "b", desc);
  check_pointer(operands.d, "d", desc);
  SG_CHECK(operands.workspace_bytes <= kWorkspaceBytes, "gemm: workspace_bytes ", operands.workspace_bytes,
           " is more than the ", kWorkspaceBytes, " a launch may use");
  if (operands.workspace_bytes > 0) check_pointer(operands.workspace, "workspace", desc, kWorkspaceAlignment);
  if (epilogue_reads_bias(desc.epilogue)) check_pointer(operands.bias, "bias", desc);
  if (epilogue_uses_aux(desc.epilogue)) check_pointer(operands.aux, "aux", desc);
  if (epilogue_writes_bias_grad(desc.epilogue)) check_pointer(operands.bias_grad, "bias_grad", desc);
  // cuBLASLt refuses scale pointers that are not 16-byte aligned (NOT_SUPPORTED, no word why).
  if (operands.a_scale_inv != nullptr || desc.a_blocks) check_pointer(operands.a_scale_inv, "a_scale_inv", desc);
  if (operands.b_scale_inv != nullptr || desc.b_blocks) check_pointer(operands.b_scale_inv, "b_scale_inv", desc);
}

}  // namespace

std::string gemm_epilogue_name(GemmEpilogue epilogue) {
  switch (epilogue) {
    case GemmEpilogue::kNone: return "none";
    case GemmEpilogue::kBias: return "bias";
    case GemmEpilogue::kGeluAuxBias: return "gelu_aux_bias";
    case GemmEpilogue::kDGeluBGrad: return "dgelu_bgrad";
    case GemmEpilogue::kBiasGradOfA: return "bias_grad_of_a";
  }
  return "epilogue(" + std::to_string(static_cast<int>(epilogue)) + ")";
}

std::string GemmDesc::to_string() const {
  std::ostringstream out;
  out << "gemm " << m << "x" << n << "x" << k << " A=" << dtype_name(a_type) << (trans_a ? "^T" : "")
      << " B=" << dtype_name(b_type) << (trans_b ? "^T" : "") << " D=" << dtype_name(d_type)
      << " epilogue=" << gemm_epilogue_name(epilogue) << " alpha=" << alpha << " beta=" << beta
      << (fast_accumulation ? " fast_accumulation" : "")
      << (algorithm == AlgorithmChoice::kTimed ? " algorithm=timed" : "");
  auto blocks_name = [](BlockShape shape) { return shape == BlockShape::k1x128 ? "1x128" : "128x128"; };
  if (a_blocks) out << " a_blocks=" << blocks_name(*a_blocks);
  if (b_blocks) out << " b_blocks=" << blocks_name(*b_blocks);
  return out.str();
}

namespace {

// See Note [FP8 GEMMs] in gemm.h. m, n, k, alpha and the epilogue's validity
// are checked by check_gemm before.
void check_fp8_gemm(const GemmDesc& desc) {
  SG_CHECK_CODE(is_fp8(desc.a_type) && is_fp8(desc.b_type), ErrorCode::kUnsupported,
                "gemm: FP8 needs both A and B in FP8, got A=", dtype_name(desc.a_type), " B=",
                dtype_name(desc.b_type), "; quantize the other operand too");
  SG_CHECK_CODE(!(desc.a_type == DType::kFloat8E5M2 && desc.b_type == DType::kFloat8E5M2), ErrorCode::kUnsupported,
                "gemm: cuBLASLt has no E5M2 x E5M2 GEMM; keep one operand E4M3 (the hybrid format's gradients "
                "meet E4M3 weights or activations)");
  SG_CHECK_CODE(!desc.trans_a && desc.trans_b, ErrorCode::kUnsupported,
                "gemm: FP8 GEMMs on Hopper are TN: A [m, k] and B [n, k] (trans_a false, trans_b true), got ",
                desc.to_string(), "; use the quantize kernel's column-wise copy for the transposed operand");
  SG_CHECK_CODE(desc.m % 16 == 0 && desc.n % 16 == 0 && desc.k % 16 == 0, ErrorCode::kUnsupported,
                "gemm: FP8 needs m, n and k divisible by 16, got ", desc.m, "x", desc.n, "x", desc.k);
  SG_CHECK_CODE(is_gemm_dtype(desc.d_type), ErrorCode::kUnsupported,
                "gemm: an FP8 GEMM writes bf16, fp16 or fp32, got D=", dtype_name(desc.d_type));
  SG_CHECK_CODE(desc.epilogue == GemmEpilogue::kNone || desc.epilogue == GemmEpilogue::kBias, ErrorCode::kUnsupported,
                "gemm: FP8 GEMMs take epilogue none or bias, got ", gemm_epilogue_name(desc.epilogue));
  SG_CHECK_CODE(desc.beta == 0.0f, ErrorCode::kUnsupported, "gemm: FP8 GEMMs take beta 0, got ", desc.beta);
  if (!desc.a_blocks && !desc.b_blocks) return;
  SG_CHECK_CODE(desc.a_blocks && desc.b_blocks, ErrorCode::kUnsupported,
                "gemm: block scaling needs both operands block-scaled, got ", desc.to_string(),
                "; quantize the other operand with blocks too");
  SG_CHECK_CODE(*desc.a_blocks == BlockShape::k1x128 || *desc.b_blocks == BlockShape::k1x128,
                ErrorCode::kUnsupported,
                "gemm: cuBLASLt has no GEMM of two 128 x 128 block-scaled operands; quantize one of them "
                "(the activation or gradient) 1 x 128");
  SG_CHECK_CODE(desc.k % kScaleBlock == 0, ErrorCode::kUnsupported,
                "gemm: block scaling needs k divisible by 128, got ", desc.to_string());
  SG_CHECK_CODE(!desc.fast_accumulation, ErrorCode::kUnsupported,
                "gemm: block-scaled FP8 GEMMs have no fast accumulation, got ", desc.to_string());
}

}  // namespace

void check_gemm(const GemmDesc& desc) {
  SG_CHECK(desc.m > 0 && desc.n > 0 && desc.k > 0, "gemm: m, n and k must be > 0, got ", desc.m, "x", desc.n, "x",
           desc.k);
  SG_CHECK(std::isfinite(desc.alpha) && std::isfinite(desc.beta),
           "gemm: alpha and beta must be finite, got alpha=", desc.alpha, " beta=", desc.beta);
  SG_CHECK(is_known(desc.epilogue), "gemm: unknown epilogue ", static_cast<int>(desc.epilogue),
           "; use a GemmEpilogue enumerator");
  if (is_fp8(desc.a_type) || is_fp8(desc.b_type)) {
    check_fp8_gemm(desc);
    return;
  }
  SG_CHECK_CODE(desc.a_type == desc.b_type, ErrorCode::kUnsupported,
                "gemm: A and B must share a dtype, got A=", dtype_name(desc.a_type), " B=", dtype_name(desc.b_type),
                "; convert one of them");
  SG_CHECK_CODE(is_gemm_dtype(desc.a_type), ErrorCode::kUnsupported,
                "gemm: A and B must be bf16, fp16 or fp32 (or both FP8), got ", dtype_name(desc.a_type));
  SG_CHECK(!desc.fast_accumulation, "gemm: fast_accumulation is for FP8 inputs, got ", desc.to_string());
  SG_CHECK_CODE(is_gemm_dtype(desc.d_type), ErrorCode::kUnsupported, "gemm: D must be bf16, fp16 or fp32, got ",
                dtype_name(desc.d_type));
  SG_CHECK_CODE(desc.a_type != DType::kFloat32 || desc.d_type == DType::kFloat32, ErrorCode::kUnsupported,
                "gemm: fp32 inputs need an fp32 D (cuBLASLt has no fp32 GEMM with a 16-bit output), got D=",
                dtype_name(desc.d_type), "; ask for fp32 and convert");
  SG_CHECK_CODE(desc.beta == 0.0f || can_accumulate(desc.epilogue), ErrorCode::kUnsupported, "gemm: beta=", desc.beta,
                " needs epilogue none or bias_grad_of_a, got ", gemm_epilogue_name(desc.epilogue),
                "; use beta=0 and add separately");
  SG_CHECK_CODE(!epilogue_uses_aux(desc.epilogue) || desc.n % 8 == 0, ErrorCode::kUnsupported, "gemm: epilogue ",
                gemm_epilogue_name(desc.epilogue),
                " needs n divisible by 8 (cuBLASLt's aux leading dimension), got n=", desc.n,
                "; pad the feature dimension or use epilogue none with a separate GeLU");
  SG_CHECK_CODE(desc.epilogue != GemmEpilogue::kBiasGradOfA || desc.trans_a, ErrorCode::kUnsupported,
                "gemm: epilogue bias_grad_of_a needs trans_a (cuBLASLt's BGRADB reduces a transposed operand "
                "only), got ",
                desc.to_string(), "; store A as [k, m]");
}

std::size_t gemm_workspace_bytes() { return kWorkspaceBytes; }

std::size_t gemm_workspace_bytes(const GemmDesc& desc) {
  check_gemm(desc);
  const std::size_t bytes = cached_algo(desc, kBestAlignment, /*may_time=*/true).workspace;
  return (bytes + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment;
}

void gemm_prepare(const GemmDesc& desc) {
  check_gemm(desc);
  cached_algo(desc, kBestAlignment, /*may_time=*/true);  // what pools and allocators hand out
}

void launch_gemm(const GemmDesc& desc, const GemmOperands& operands, cudaStream_t stream) {
  // Everything checkable on the host first: a bad call fails before touching the device.
  check_gemm(desc);
  check_operands(desc, operands);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  SG_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  const Selected selected =
      cached_algo(desc, alignment_of(operands), capture == cudaStreamCaptureStatusNone, operands.workspace_bytes);
  const cublasLtMatmulAlgo_t algo = selected.algo;
  const void* vector = epilogue_reads_bias(desc.epilogue)         ? operands.bias
                       : epilogue_writes_bias_grad(desc.epilogue) ? operands.bias_grad
                                                                  : nullptr;
  LtMatmul problem(desc, vector, epilogue_uses_aux(desc.epilogue) ? operands.aux : nullptr, operands.a_scale_inv,
                   operands.b_scale_inv);
  const float alpha = desc.alpha;
  const float beta = desc.beta;
  SG_CUBLAS_CHECK(cublasLtMatmul(lt_handle(), &problem.op, &alpha, operands.b, &problem.a, operands.a, &problem.b,
                                 &beta, operands.d, &problem.d, operands.d, &problem.d, &algo, operands.workspace,
                                 operands.workspace_bytes, stream));
}

namespace {

// The workspace a recorded algorithm needs for its problem on this device
// (cublasLtMatmulAlgoCheck), within the pick's limit; an Error naming the
// problem where it does not run.
std::size_t checked_workspace(const GemmAlgorithmPick& pick) {
  const void* probe = reinterpret_cast<const void*>(static_cast<std::uintptr_t>(pick.alignment));
  const GemmDesc& desc = pick.desc;
  const bool has_vector = epilogue_reads_bias(desc.epilogue) || epilogue_writes_bias_grad(desc.epilogue);
  const auto* scale_probe = static_cast<const float*>(probe);
  LtMatmul problem(desc, has_vector ? probe : nullptr, epilogue_uses_aux(desc.epilogue) ? probe : nullptr,
                   desc.a_blocks ? scale_probe : nullptr, desc.b_blocks ? scale_probe : nullptr);
  cublasLtMatmulAlgo_t algo{};
  std::memcpy(algo.data, pick.algo.data(), sizeof(pick.algo));
  cublasLtMatmulHeuristicResult_t result{};
  const cublasStatus_t status = cublasLtMatmulAlgoCheck(lt_handle(), &problem.op, &problem.a, &problem.b,
                                                        &problem.d, &problem.d, &algo, &result);
  SG_CHECK_CODE(status == CUBLAS_STATUS_SUCCESS && result.workspaceSize <= pick.workspace_limit,
                ErrorCode::kInvalidArgument, "the recorded GEMM algorithm for ", desc.to_string(),
                " does not run on this device within its workspace (cublasLtMatmulAlgoCheck: status ",
                static_cast<int>(status), ", workspace ", result.workspaceSize, " of at most ", pick.workspace_limit,
                "): the record was altered or written elsewhere; start a new run");
  return result.workspaceSize;
}

}  // namespace

std::string gemm_library_identity() {
  int device = 0;
  SG_CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp properties{};
  SG_CUDA_CHECK(cudaGetDeviceProperties(&properties, device));
  std::ostringstream out;
  out << "cuBLASLt " << cublasLtGetVersion() << ", " << properties.name << " (" << properties.multiProcessorCount
      << " SMs)";
  return out.str();
}

std::string export_timed_gemm_algorithms() {
  return format_gemm_algorithm_record({gemm_library_identity(), algo_cache().timed_picks()});
}

void adopt_timed_gemm_algorithms(const std::string& text) {
  const GemmAlgorithmRecord record = parse_gemm_algorithm_record(text);
  const std::string here = gemm_library_identity();
  SG_CHECK_CODE(record.identity == here, ErrorCode::kInvalidArgument,
                "the GEMM algorithms were timed with ", quoted(record.identity), "; this process has ",
                here, ": timed picks are valid only for the library and GPU model that made them. Resume there, "
                "or start a new run");
  // The record comes from a file: cuBLASLt checks each algorithm against its
  // problem, and says what workspace it needs, before any launch.
  std::vector<GemmAlgorithmPick> picks = record.picks;
  for (GemmAlgorithmPick& pick : picks) pick.workspace = checked_workspace(pick);
  algo_cache().adopt(picks);
}

}  // namespace stepgraph::kernels

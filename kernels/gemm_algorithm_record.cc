#include "kernels/gemm_algorithm_record.h"

#include <bit>
#include <charconv>
#include <sstream>

#include "engine/error.h"

namespace stepgraph::kernels {
namespace {

constexpr std::string_view kHeader = "stepgraph gemm algorithms v1";
constexpr std::string_view kIdentity = "identity ";
constexpr std::string_view kPick = "pick ";
constexpr GemmEpilogue kEpilogues[] = {GemmEpilogue::kNone, GemmEpilogue::kBias, GemmEpilogue::kGeluAuxBias,
                                       GemmEpilogue::kDGeluBGrad, GemmEpilogue::kBiasGradOfA};

std::string hex(std::uint64_t value) {
  std::ostringstream out;
  out << std::hex << value;
  return out.str();
}

std::string blocks_name(const std::optional<BlockShape>& blocks) {
  if (!blocks) return "-";
  return *blocks == BlockShape::k1x128 ? "1x128" : "128x128";
}

// Reads the fields of one pick line, each a clear Error naming the line.
class Fields {
 public:
  Fields(std::string_view line, int number) : rest_(line), number_(number) {}

  std::string_view word(std::string_view what) {
    while (!rest_.empty() && rest_.front() == ' ') rest_.remove_prefix(1);
    const std::size_t end = std::min(rest_.find(' '), rest_.size());
    const std::string_view out = rest_.substr(0, end);
    rest_.remove_prefix(end);
    if (out.empty()) fail("has no ", what);
    return out;
  }
  std::uint64_t number(std::string_view what, int base = 10) {
    const std::string_view text = word(what);
    std::uint64_t value = 0;
    const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value, base);
    if (error != std::errc{} || end != text.data() + text.size()) fail("has ", what, " '", text, "', not a number");
    return value;
  }
  std::int64_t dimension(std::string_view what) {
    const std::uint64_t value = number(what);
    if (value == 0 || value > (std::uint64_t{1} << 40)) fail("has ", what, " ", value, ", outside [1, 2^40]");
    return static_cast<std::int64_t>(value);
  }
  bool flag(std::string_view what) {
    const std::uint64_t value = number(what);
    if (value > 1) fail("has ", what, " ", value, ", not 0 or 1");
    return value == 1;
  }
  DType dtype(std::string_view what) {
    const std::string_view name = word(what);
    for (const DType d : kAllDTypes) {
      if (dtype_name(d) == name) return d;
    }
    fail("has ", what, " '", name, "', not a dtype");
  }
  GemmEpilogue epilogue() {
    const std::string_view name = word("epilogue");
    for (const GemmEpilogue e : kEpilogues) {
      if (gemm_epilogue_name(e) == name) return e;
    }
    fail("has epilogue '", name, "', not a GEMM epilogue");
  }
  float bits_float(std::string_view what) {
    const std::uint64_t bits = number(what, 16);
    if (bits > 0xffffffffu) fail("has ", what, " bits ", hex(bits), ", wider than a float");
    return std::bit_cast<float>(static_cast<std::uint32_t>(bits));
  }
  std::optional<BlockShape> blocks(std::string_view what) {
    const std::string_view name = word(what);
    if (name == "-") return std::nullopt;
    if (name == "1x128") return BlockShape::k1x128;
    if (name == "128x128") return BlockShape::k128x128;
    fail("has ", what, " '", name, "', not -, 1x128 or 128x128");
  }
  void end() {
    while (!rest_.empty() && rest_.front() == ' ') rest_.remove_prefix(1);
    if (!rest_.empty()) fail("has more fields than a pick");
  }

  template <typename... Parts>
  [[noreturn]] void fail(const Parts&... parts) const {
    SG_THROW(ErrorCode::kIo, "GEMM algorithm record: line ", number_, " ", parts...,
             "; the record is written by export_timed_gemm_algorithms");
  }

 private:
  std::string_view rest_;
  int number_;
};

GemmAlgorithmPick parse_pick(std::string_view line, int number) {
  Fields f(line, number);
  GemmAlgorithmPick pick;
  GemmDesc& d = pick.desc;
  d.algorithm = AlgorithmChoice::kTimed;
  d.m = f.dimension("m");
  d.n = f.dimension("n");
  d.k = f.dimension("k");
  d.trans_a = f.flag("trans_a");
  d.trans_b = f.flag("trans_b");
  d.a_type = f.dtype("a_type");
  d.b_type = f.dtype("b_type");
  d.d_type = f.dtype("d_type");
  d.epilogue = f.epilogue();
  d.alpha = f.bits_float("alpha");
  d.beta = f.bits_float("beta");
  d.fast_accumulation = f.flag("fast_accumulation");
  d.a_blocks = f.blocks("a_blocks");
  d.b_blocks = f.blocks("b_blocks");
  pick.alignment = f.number("alignment");
  if (pick.alignment < 16 || pick.alignment > 256 || !std::has_single_bit(pick.alignment)) {
    f.fail("has alignment ", pick.alignment, ", not a power of two in [16, 256]");
  }
  pick.workspace_limit = f.number("workspace limit");
  pick.workspace = f.number("workspace");
  if (pick.workspace_limit > kGemmMaxWorkspaceBytes || pick.workspace > pick.workspace_limit) {
    f.fail("has workspace ", pick.workspace, " of limit ", pick.workspace_limit, ", outside [0, ",
           kGemmMaxWorkspaceBytes, "]");
  }
  for (std::uint64_t& word : pick.algo) word = f.number("algorithm word", 16);
  f.end();
  try {
    check_gemm(d);
  } catch (const Error& e) {
    f.fail("is no valid GEMM: ", e.message());
  }
  return pick;
}

}  // namespace

std::string format_gemm_algorithm_record(const GemmAlgorithmRecord& record) {
  SG_CHECK(record.identity.find('\n') == std::string::npos, "GEMM algorithm record: the identity '",
           record.identity, "' holds a line break");
  std::ostringstream out;
  out << kHeader << '\n' << kIdentity << record.identity << '\n';
  for (const GemmAlgorithmPick& p : record.picks) {
    const GemmDesc& d = p.desc;
    out << kPick << d.m << ' ' << d.n << ' ' << d.k << ' ' << d.trans_a << ' ' << d.trans_b << ' '
        << dtype_name(d.a_type) << ' ' << dtype_name(d.b_type) << ' ' << dtype_name(d.d_type) << ' '
        << gemm_epilogue_name(d.epilogue) << ' ' << hex(std::bit_cast<std::uint32_t>(d.alpha)) << ' '
        << hex(std::bit_cast<std::uint32_t>(d.beta)) << ' ' << d.fast_accumulation << ' ' << blocks_name(d.a_blocks)
        << ' ' << blocks_name(d.b_blocks) << ' ' << p.alignment << ' ' << p.workspace_limit << ' ' << p.workspace;
    for (const std::uint64_t word : p.algo) out << ' ' << hex(word);
    out << '\n';
  }
  return out.str();
}

GemmAlgorithmRecord parse_gemm_algorithm_record(std::string_view text) {
  GemmAlgorithmRecord record;
  int number = 0;
  while (!text.empty()) {
    const std::size_t end = text.find('\n');
    SG_CHECK_CODE(end != std::string_view::npos, ErrorCode::kIo, "GEMM algorithm record: line ", number + 1,
                  " does not end with a line break; the record is truncated");
    const std::string_view line = text.substr(0, end);
    text.remove_prefix(end + 1);
    ++number;
    if (number == 1) {
      SG_CHECK_CODE(line == kHeader, ErrorCode::kIo, "GEMM algorithm record: the first line is not '", kHeader,
                    "'; this is not a record of export_timed_gemm_algorithms");
    } else if (number == 2) {
      SG_CHECK_CODE(line.starts_with(kIdentity) && line.size() > kIdentity.size(), ErrorCode::kIo,
                    "GEMM algorithm record: line 2 is not 'identity <library and GPU>'");
      record.identity = std::string(line.substr(kIdentity.size()));
    } else {
      SG_CHECK_CODE(line.starts_with(kPick), ErrorCode::kIo, "GEMM algorithm record: line ", number,
                    " does not start with 'pick '");
      record.picks.push_back(parse_pick(line.substr(kPick.size()), number));
    }
  }
  SG_CHECK_CODE(number >= 2, ErrorCode::kIo, "GEMM algorithm record: ", number,
                " line(s), fewer than its header and identity");
  return record;
}

}  // namespace stepgraph::kernels

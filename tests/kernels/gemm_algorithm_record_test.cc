// The text a checkpoint keeps for timed GEMM picks (kernels/gemm_algorithm_record.h):
// every field round-trips, and every malformed record is a clear Error
// naming its line, never a crash or a pick that was not written.
#include "kernels/gemm_algorithm_record.h"

#include <gtest/gtest.h>

#include <limits>
#include <string>

#include "engine/error.h"
#include "tests/support/expect_error.h"

namespace stepgraph::kernels {
namespace {

using stepgraph::testing::expect_error_code;

GemmAlgorithmRecord sample() {
  GemmAlgorithmPick plain;
  plain.desc = {.m = 2048, .n = 512, .k = 4096, .trans_a = true, .d_type = DType::kFloat32,
                .epilogue = GemmEpilogue::kBiasGradOfA, .beta = 1.0f, .algorithm = AlgorithmChoice::kTimed};
  plain.alignment = 256;
  plain.workspace_limit = kGemmMaxWorkspaceBytes;
  plain.workspace = 4096;
  plain.algo = {0x42, 0, 1, std::numeric_limits<std::uint64_t>::max(), 7, 0xabcdef, 3, 9};
  GemmAlgorithmPick fp8;
  fp8.desc = {.m = 256, .n = 384, .k = 512, .trans_b = true, .a_type = DType::kFloat8E4M3,
              .b_type = DType::kFloat8E4M3, .alpha = 0.125f, .a_blocks = BlockShape::k1x128,
              .b_blocks = BlockShape::k128x128, .algorithm = AlgorithmChoice::kTimed};
  fp8.alignment = 16;
  fp8.workspace_limit = 0;
  return {"cuBLASLt 130100, NVIDIA H100 80GB HBM3 (132 SMs)", {plain, fp8}};
}

TEST(GemmAlgorithmRecordTest, EveryFieldRoundTrips) {
  const GemmAlgorithmRecord record = sample();
  const std::string text = format_gemm_algorithm_record(record);
  EXPECT_EQ(parse_gemm_algorithm_record(text), record) << text;
  EXPECT_EQ(parse_gemm_algorithm_record(format_gemm_algorithm_record({"x", {}})).picks.size(), 0u);
}

TEST(GemmAlgorithmRecordTest, EachMalformedRecordNamesWhatIsWrong) {
  const std::string good = format_gemm_algorithm_record(sample());
  const std::string header = "stepgraph gemm algorithms v1\nidentity x\n";
  const std::string pick = "pick 8 16 32 0 1 bf16 bf16 bf16 none 3f800000 0 0 - - 256 1024 0 1 2 3 4 5 6 7 8\n";
  ASSERT_NO_THROW(parse_gemm_algorithm_record(header + pick));
  const struct {
    std::string text;
    std::string mentions;
  } cases[] = {
      {"", "fewer than its header"},
      {"stepgraph gemm algorithms v2\nidentity x\n", "first line"},
      {"stepgraph gemm algorithms v1\nidentity \n", "line 2"},
      {header + "pick 8 16 32 0 1 bf16 bf16 bf16 none 3f800000 0 0 - - 256 1024 0 1 2 3 4 5 6 7\n", "no algorithm word"},
      {header + "pick 8 16 32 0 1 bf16 bf16 bf16 none 3f800000 0 0 - - 256 1024 0 1 2 3 4 5 6 7 8 9\n",
       "more fields"},
      {header + "pick 0 16 32 0 1 bf16 bf16 bf16 none 3f800000 0 0 - - 256 1024 0 1 2 3 4 5 6 7 8\n", "m 0"},
      {header + "pick -8 16 32 0 1 bf16 bf16 bf16 none 3f800000 0 0 - - 256 1024 0 1 2 3 4 5 6 7 8\n",
       "not a number"},
      {header + "pick 8 16 32 2 1 bf16 bf16 bf16 none 3f800000 0 0 - - 256 1024 0 1 2 3 4 5 6 7 8\n", "trans_a 2"},
      {header + "pick 8 16 32 0 1 bf17 bf16 bf16 none 3f800000 0 0 - - 256 1024 0 1 2 3 4 5 6 7 8\n", "not a dtype"},
      {header + "pick 8 16 32 0 1 bf16 bf16 bf16 relu 3f800000 0 0 - - 256 1024 0 1 2 3 4 5 6 7 8\n",
       "not a GEMM epilogue"},
      {header + "pick 8 16 32 0 1 bf16 bf16 bf16 none 13f800000 0 0 - - 256 1024 0 1 2 3 4 5 6 7 8\n",
       "wider than a float"},
      {header + "pick 8 16 32 0 1 bf16 bf16 bf16 none 3f800000 0 0 2x2 - 256 1024 0 1 2 3 4 5 6 7 8\n",
       "not -, 1x128"},
      {header + "pick 8 16 32 0 1 bf16 bf16 bf16 none 3f800000 0 0 - - 48 1024 0 1 2 3 4 5 6 7 8\n",
       "alignment 48"},
      {header + "pick 8 16 32 0 1 bf16 bf16 bf16 none 3f800000 0 0 - - 256 1024 2048 1 2 3 4 5 6 7 8\n",
       "workspace 2048 of limit 1024"},
      {header + "pick 8 16 32 0 1 bf16 bf16 bf16 none 7fc00000 0 0 - - 256 1024 0 1 2 3 4 5 6 7 8\n",
       "no valid GEMM"},
      {header + "pick 8 16 32 0 1 bf16 bf16 bf16 none 3f800000 0 0 - - 256 1024 0 1 2 3 4 5 6 7 8", "truncated"},
      {header + "pack 8\n", "does not start with 'pick '"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.text);
    expect_error_code([&] { parse_gemm_algorithm_record(c.text); }, ErrorCode::kIo, c.mentions);
  }
  // Every prefix of a good record is a whole record or a clear error.
  for (std::size_t size = 0; size < good.size(); ++size) {
    try {
      parse_gemm_algorithm_record(std::string_view(good).substr(0, size));
    } catch (const Error& error) {
      EXPECT_EQ(error.code(), ErrorCode::kIo) << size << ": " << error.what();
    }
  }
}

TEST(GemmAlgorithmRecordTest, AnIdentityWithALineBreakIsRefused) {
  expect_error_code([] { format_gemm_algorithm_record({"a\nb", {}}); }, ErrorCode::kInvalidArgument,
                        "line break");
}

}  // namespace
}  // namespace stepgraph::kernels

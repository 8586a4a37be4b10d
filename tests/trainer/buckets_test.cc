// Note [Shape buckets]: the bucket list, the bucket of a batch, the
// sequence lengths drawn per step, and a batch packed into its bucket.
#include "trainer/buckets.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "tests/support/expect_error.h"

namespace stepgraph::trainer {
namespace {

// The flag's value: parsed once, written back in its plain spelling (what
// checkpoints record), the sizes of a run decided later from the ranks' batch.
TEST(BucketsTest, TheSpecIsTheFlagsValueAndSpellsItselfPlainly) {
  EXPECT_EQ(BucketSpec::parse("pow2"), (BucketSpec{.pow2 = true}));
  EXPECT_EQ(BucketSpec::parse("512,128,256"), (BucketSpec{.sizes = {512, 128, 256}}));
  EXPECT_EQ(BucketSpec::parse("512,128,256").to_string(), "512,128,256");
  EXPECT_EQ(BucketSpec::parse("16, 32").to_string(), "16,32");
  EXPECT_EQ(BucketSpec::parse("pow2").to_string(), "pow2");
  EXPECT_TRUE(BucketSpec{}.empty());
  EXPECT_FALSE(BucketSpec::parse("pow2").empty());
  EXPECT_ERROR_CONTAINS(BucketSpec::parse("16,x"), "--buckets: 'x' in '16,x'", "positive token count");
  EXPECT_EQ(parse_buckets(BucketSpec::parse("64,16,32"), 16, 64), (std::vector<std::int64_t>{16, 32, 64}));
}

TEST(BucketsTest, ListsArePowersOfTwoOrSortedTokenCountsThatHoldTheLargestBatch) {
  EXPECT_EQ(parse_buckets("pow2", 16, 64), (std::vector<std::int64_t>{16, 32, 64}));
  EXPECT_EQ(parse_buckets("pow2", 20, 100), (std::vector<std::int64_t>{32, 64, 128}));
  EXPECT_EQ(parse_buckets("pow2", 64, 64), (std::vector<std::int64_t>{64}));
  EXPECT_EQ(parse_buckets("512,128,256,256", 100, 300), (std::vector<std::int64_t>{128, 256, 512}));
  EXPECT_ERROR_CONTAINS(parse_buckets("128,256", 100, 300), "largest bucket (256 tokens)", "300 tokens");
  EXPECT_ERROR_CONTAINS(parse_buckets("128,abc", 1, 64), "'abc'", "positive token count");
  EXPECT_ERROR_CONTAINS(parse_buckets("0", 1, 1), "'0'");
  EXPECT_ERROR_CONTAINS(parse_buckets("", 1, 1), "no token counts");
  const std::vector<std::int64_t> buckets = {16, 32, 64};
  EXPECT_EQ(bucket_for(buckets, 1), 0u);
  EXPECT_EQ(bucket_for(buckets, 16), 0u);
  EXPECT_EQ(bucket_for(buckets, 17), 1u);
  EXPECT_EQ(bucket_for(buckets, 64), 2u);
}

TEST(BucketsTest, LengthsComeFromTheSeedAndTheStepAlone) {
  const std::vector<std::int64_t> a = sequence_lengths(11, 5, 64, 3, 8);
  EXPECT_EQ(a, sequence_lengths(11, 5, 64, 3, 8));
  EXPECT_NE(a, sequence_lengths(11, 6, 64, 3, 8));
  EXPECT_NE(a, sequence_lengths(12, 5, 64, 3, 8));
  bool shortest = false, longest = false;
  for (std::int64_t length : a) {
    EXPECT_GE(length, 3);
    EXPECT_LE(length, 8);
    shortest = shortest || length == 3;
    longest = longest || length == 8;
  }
  EXPECT_TRUE(shortest && longest) << "64 draws from 6 lengths should reach both ends";
}

TEST(BucketsTest, ABatchPacksItsCutSequencesThenMaskedPadding) {
  // Two windows of 4 tokens and the token after each.
  const Batch batch{.windows = {10, 11, 12, 13, 20, 21, 22, 23}, .labels = {14, 24}};
  PackedBatch packed;
  EXPECT_EQ(padded_sequences(2, 16, 4), 6);
  pack_into_bucket(batch, 0, 4, {2, 4}, 16, padded_sequences(2, 16, 4), packed);
  EXPECT_EQ(packed.real_tokens, 6);
  EXPECT_EQ(packed.tokens, (std::vector<std::int32_t>{10, 11, 20, 21, 22, 23, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}));
  // A cut window's last token is labelled by the window's next token; a full one's by the batch label.
  const std::vector<std::int32_t> labels = {11, 12, 21, 22, 23, 24};
  EXPECT_EQ(std::vector<std::int32_t>(packed.labels.begin(), packed.labels.begin() + 6), labels);
  EXPECT_EQ(std::count(packed.labels.begin(), packed.labels.end(), -100), 10);
  // The 10 padding tokens in sequences of at most 4 (the window), then an empty one.
  EXPECT_EQ(packed.cu_seqlens, (std::vector<std::int32_t>{0, 2, 6, 10, 14, 16, 16}));
  pack_into_bucket(batch, 1, 4, {4}, 4, padded_sequences(1, 4, 4), packed);  // the second window, full: no padding
  EXPECT_EQ(packed.tokens, (std::vector<std::int32_t>{20, 21, 22, 23}));
  EXPECT_EQ(packed.cu_seqlens, (std::vector<std::int32_t>{0, 4, 4}));
  EXPECT_ERROR_CONTAINS(pack_into_bucket(batch, 0, 4, {2, 4}, 16, 3, packed), "no room for the padding");
}

}  // namespace
}  // namespace stepgraph::trainer

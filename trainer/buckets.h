// Note [Shape buckets]
// A step whose token count varies (sequences of different lengths) would
// need a capture for every count. With --buckets the trainer captures one
// step per bucket (a token count) and trains each batch in the smallest
// bucket that holds it: the batch's sequences are packed one after another,
// the rest of the bucket is one more sequence of padding tokens whose labels
// are ignore_index, so the padding changes neither the loss (a mean over
// the labelled tokens) nor any gradient (its loss gradient is zero, and so
// is everything the backward derives from it; tests/layers/
// bucketed_step_test.cc). Every bucket's step plans into one shared pool
// (Note [Steps sharing one pool] in graphs/captured_step.h), sized by the
// largest bucket. Each step's sequence lengths are drawn from the seed and
// the step number alone, so a resumed run draws the same ones.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "trainer/data_source.h"

namespace stepgraph::trainer {

// --buckets as a value: token counts in the order given, or powers of two.
// Empty: no buckets.
struct BucketSpec {
  bool pow2 = false;
  std::vector<std::int64_t> sizes;

  // "256,512,1024" (positive token counts) or "pow2"; an Error naming
  // --buckets and the item otherwise.
  static BucketSpec parse(const std::string& text);
  // The flag's text, as checkpoints record it: "pow2" or the counts joined by
  // commas, so parse(text).to_string() is the text's plain spelling.
  std::string to_string() const;
  bool empty() const { return !pow2 && sizes.empty(); }
  bool operator==(const BucketSpec&) const = default;
};

// The buckets of a run: the spec's counts ascending, or powers of two from
// the first >= `smallest_batch` (every sequence at its shortest) to the first
// >= `largest_batch` (every sequence at full length). The largest bucket must
// hold `largest_batch` tokens; an Error otherwise.
std::vector<std::int64_t> parse_buckets(const BucketSpec& spec, std::int64_t smallest_batch,
                                        std::int64_t largest_batch);
// The same from the flag's text (BucketSpec::parse first).
std::vector<std::int64_t> parse_buckets(const std::string& text, std::int64_t smallest_batch,
                                        std::int64_t largest_batch);

// The index of the smallest bucket holding `tokens`.
std::size_t bucket_for(const std::vector<std::int64_t>& buckets, std::int64_t tokens);

// Step `step`'s sequence lengths, each uniform in [min_length, max_length],
// from (seed, step) alone.
std::vector<std::int64_t> sequence_lengths(std::uint64_t seed, std::int64_t step, std::int64_t sequences,
                                           std::int64_t min_length, std::int64_t max_length);

// Rows [first, first + lengths.size()) of `batch` (windows of `width` tokens),
// row r cut to lengths[r] tokens, packed into `bucket` tokens: tokens, their
// next-token labels (ignore_index for the padding), and cu_seqlens
// [sequences + 1]: the real sequences, then the padding in sequences of at
// most `width` tokens, then empty ones. Causal attention costs a sequence's
// length squared: one padding sequence of 1,024 tokens cost more than the
// 32 real ones of 64-128 beside it (on an H100), chunks of `width` cost no more
// a token than the real ones. `sequences` must leave room for the chunks
// (padded_sequences gives enough).
std::int64_t padded_sequences(std::int64_t batch_sequences, std::int64_t bucket, std::int64_t width);
struct PackedBatch {
  std::vector<std::int32_t> tokens;
  std::vector<std::int32_t> labels;
  std::vector<std::int32_t> cu_seqlens;
  std::int64_t real_tokens = 0;
};
void pack_into_bucket(const Batch& batch, std::size_t first, std::size_t width,
                      const std::vector<std::int64_t>& lengths, std::int64_t bucket, std::int64_t sequences,
                      PackedBatch& out);

}  // namespace stepgraph::trainer

#include "trainer/buckets.h"

#include <algorithm>
#include <random>
#include <sstream>

#include "engine/error.h"

namespace stepgraph::trainer {
namespace {

constexpr std::int32_t kIgnoreIndex = -100;  // ops::CrossEntropyParams' default, the step's

}  // namespace

BucketSpec BucketSpec::parse(const std::string& text) {
  BucketSpec spec;
  if (text == "pow2") {
    spec.pow2 = true;
    return spec;
  }
  std::stringstream items(text);
  std::string item;
  while (std::getline(items, item, ',')) {
    std::size_t used = 0;
    std::int64_t value = 0;
    try {
      value = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    SG_CHECK(used == item.size() && !item.empty() && value > 0, "--buckets: '", item, "' in '", text,
             "' is not a positive token count; give token counts like 256,512,1024, or pow2");
    spec.sizes.push_back(value);
  }
  SG_CHECK(!spec.sizes.empty(), "--buckets: no token counts in '", text, "'");
  return spec;
}

std::string BucketSpec::to_string() const {
  if (pow2) return "pow2";
  std::string out;
  for (std::int64_t size : sizes) out += (out.empty() ? "" : ",") + std::to_string(size);
  return out;
}

std::vector<std::int64_t> parse_buckets(const BucketSpec& spec, std::int64_t smallest_batch,
                                        std::int64_t largest_batch) {
  std::vector<std::int64_t> out;
  if (spec.pow2) {
    std::int64_t size = 1;
    while (size < smallest_batch) size *= 2;
    out.push_back(size);
    while (out.back() < largest_batch) out.push_back(out.back() * 2);
    return out;
  }
  SG_CHECK(!spec.sizes.empty(), "--buckets: no token counts");
  out = spec.sizes;
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  SG_CHECK(out.back() >= largest_batch, "--buckets ", spec.to_string(), ": the largest bucket (", out.back(),
           " tokens) must hold a batch whose sequences are all full length (", largest_batch, " tokens)");
  return out;
}

std::vector<std::int64_t> parse_buckets(const std::string& text, std::int64_t smallest_batch,
                                        std::int64_t largest_batch) {
  return parse_buckets(BucketSpec::parse(text), smallest_batch, largest_batch);
}

std::size_t bucket_for(const std::vector<std::int64_t>& buckets, std::int64_t tokens) {
  const auto it = std::lower_bound(buckets.begin(), buckets.end(), tokens);
  SG_CHECK_CODE(it != buckets.end(), ErrorCode::kInternal, "no bucket holds ", tokens, " tokens");
  return static_cast<std::size_t>(it - buckets.begin());
}

std::vector<std::int64_t> sequence_lengths(std::uint64_t seed, std::int64_t step, std::int64_t sequences,
                                           std::int64_t min_length, std::int64_t max_length) {
  std::seed_seq seeds{static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32),
                      static_cast<std::uint32_t>(step), static_cast<std::uint32_t>(step >> 32), 0x6275u};
  std::mt19937_64 rng(seeds);
  std::vector<std::int64_t> out(static_cast<std::size_t>(sequences));
  const auto span = static_cast<std::uint64_t>(max_length - min_length + 1);
  for (std::int64_t& length : out) length = min_length + static_cast<std::int64_t>(rng() % span);
  return out;
}

std::int64_t padded_sequences(std::int64_t batch_sequences, std::int64_t bucket, std::int64_t width) {
  return batch_sequences + (bucket + width - 1) / width;
}

void pack_into_bucket(const Batch& batch, std::size_t first, std::size_t width,
                      const std::vector<std::int64_t>& lengths, std::int64_t bucket, std::int64_t sequences,
                      PackedBatch& out) {
  const auto size = static_cast<std::size_t>(bucket);
  out.tokens.assign(size, 0);  // padding tokens: any valid id; their labels are ignored
  out.labels.assign(size, kIgnoreIndex);
  out.cu_seqlens.assign(static_cast<std::size_t>(sequences) + 1, 0);
  std::size_t at = 0;
  for (std::size_t r = 0; r < lengths.size(); ++r) {
    const auto length = static_cast<std::size_t>(lengths[r]);
    SG_CHECK_CODE(length >= 1 && length <= width && at + length <= size, ErrorCode::kInternal, "pack_into_bucket: ",
                  "sequence ", r, " of ", length, " tokens does not fit");
    const std::int32_t* window = batch.windows.data() + (first + r) * width;
    std::copy(window, window + length, out.tokens.begin() + static_cast<std::ptrdiff_t>(at));
    // Token i is labelled by the next one: the window's, or after a full window the batch's label.
    std::copy(window + 1, window + length, out.labels.begin() + static_cast<std::ptrdiff_t>(at));
    out.labels[at + length - 1] = length < width ? window[length] : batch.labels[first + r];
    at += length;
    out.cu_seqlens[r + 1] = static_cast<std::int32_t>(at);
  }
  out.real_tokens = static_cast<std::int64_t>(at);
  std::size_t next = lengths.size() + 1;
  while (at < size) {  // the padding in sequences of at most `width` tokens
    SG_CHECK_CODE(next < out.cu_seqlens.size(), ErrorCode::kInternal, "pack_into_bucket: ", sequences,
                  " sequences leave no room for the padding's (padded_sequences gives enough)");
    at = std::min(size, at + width);
    out.cu_seqlens[next++] = static_cast<std::int32_t>(at);
  }
  for (; next < out.cu_seqlens.size(); ++next) out.cu_seqlens[next] = static_cast<std::int32_t>(size);  // empty
}

}  // namespace stepgraph::trainer

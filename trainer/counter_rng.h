// A counter-based random stream: every value is a hash of (key, index), so a
// stream keyed by (seed, position, row) is reproducible without replaying
// anything before it. SplitMix64's output function over a keyed counter.
#pragma once

#include <cstdint>

namespace stepgraph::trainer {

constexpr std::uint64_t mix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

class CounterRng {
 public:
  // `stream` separates the uses of one seed (table, samples, ...).
  CounterRng(std::uint64_t seed, std::uint64_t stream, std::uint64_t position, std::uint64_t row)
      : key_(mix64(mix64(mix64(mix64(seed) ^ stream) ^ position) ^ row)) {}

  std::uint64_t next_u64() { return mix64(key_ + 0x9e3779b97f4a7c15ULL * ++counter_); }

  // Uniform in [0, 1) with 53 random bits.
  double next_double() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }

  // Uniform in [0, n), n > 0, without modulo bias (Lemire's method).
  std::uint64_t next_below(std::uint64_t n) {
    const std::uint64_t threshold = (0 - n) % n;
    for (;;) {
      const unsigned __int128 product = static_cast<unsigned __int128>(next_u64()) * n;
      if (static_cast<std::uint64_t>(product) >= threshold) return static_cast<std::uint64_t>(product >> 64);
    }
  }

 private:
  std::uint64_t key_;
  std::uint64_t counter_ = 0;
};

}  // namespace stepgraph::trainer

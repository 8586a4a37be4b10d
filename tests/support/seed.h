// Random seeds that a failing test prints, and that a rerun can replay.
//
//   TEST(NormTest, Forward) {
//     SeededRng rng;                 // or: const TestSeed seed; use seed.value()
//     const HostArray x = random_array(DType::kFloat32, n, rng);
//     EXPECT_LE(...);                // on failure also prints
//   }                                //   "seed N (rerun with STEPGRAPH_TEST_SEED=N)"
//
// The seed comes from std::random_device, so every run draws fresh inputs,
// unless the environment variable STEPGRAPH_TEST_SEED holds one: then every
// seed in the run is that one (under Bazel:
// `bazel test --test_env=STEPGRAPH_TEST_SEED=N //tests/...`).
//
// While a TestSeed (or SeededRng) lives, the note is on GoogleTest's trace
// stack, as with SCOPED_TRACE: keep them on the stack (or as members of an
// object on the stack) so they end in the reverse order they began.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <optional>
#include <random>
#include <string>

namespace stepgraph::testing {

inline constexpr const char* kTestSeedVariable = "STEPGRAPH_TEST_SEED";

// The seed STEPGRAPH_TEST_SEED holds, if it is set; a value that is not a
// number in [0, 2^32) is a test failure (and is ignored).
inline std::optional<std::uint32_t> test_seed_from_environment() {
  const char* text = std::getenv(kTestSeedVariable);
  if (text == nullptr || *text == '\0') return std::nullopt;
  char* end = nullptr;
  const unsigned long long value = std::strtoull(text, &end, 10);
  if (*end != '\0' || *text == '-' || value > 0xFFFFFFFFull) {
    ADD_FAILURE() << kTestSeedVariable << "='" << text << "' is not a seed: give a number in [0, 4294967295]";
    return std::nullopt;
  }
  return static_cast<std::uint32_t>(value);
}

// STEPGRAPH_TEST_SEED if set, else a fresh one from std::random_device.
inline std::uint32_t pick_test_seed() {
  if (const std::optional<std::uint32_t> seed = test_seed_from_environment()) return *seed;
  return std::random_device{}();
}

// "seed N (rerun with STEPGRAPH_TEST_SEED=N)".
inline std::string seed_note(std::uint32_t seed) {
  const std::string n = std::to_string(seed);
  return "seed " + n + " (rerun with " + kTestSeedVariable + "=" + n + ")";
}

// A seed, and a trace that adds seed_note() to every failure while it lives.
class TestSeed {
 public:
  explicit TestSeed(const char* file = __builtin_FILE(), int line = __builtin_LINE())
      : TestSeed(pick_test_seed(), file, line) {}
  TestSeed(std::uint32_t seed, const char* file, int line) : seed_(seed), trace_(file, line, seed_note(seed)) {}
  TestSeed(const TestSeed&) = delete;
  TestSeed& operator=(const TestSeed&) = delete;

  std::uint32_t value() const { return seed_; }

 private:
  std::uint32_t seed_;
  ::testing::ScopedTrace trace_;
};

// A std::mt19937 seeded by a TestSeed: use it where a test would write
// std::mt19937 rng(std::random_device{}()). Passes as std::mt19937&.
class SeededRng : private TestSeed, public std::mt19937 {
 public:
  explicit SeededRng(const char* file = __builtin_FILE(), int line = __builtin_LINE())
      : TestSeed(file, line), std::mt19937(TestSeed::value()) {}
  using TestSeed::value;
  // The engine: for calls that deduce the generator's type.
  std::mt19937& engine() { return *this; }
};

}  // namespace stepgraph::testing

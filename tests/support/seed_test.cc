// The seed helper: STEPGRAPH_TEST_SEED is honoured, and a failure under a
// TestSeed or SeededRng says which seed to rerun with.
#include "tests/support/seed.h"

#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>
#include <random>
#include <string>

namespace stepgraph::testing {
namespace {

// Sets STEPGRAPH_TEST_SEED for one test and puts back what was there.
class SeedVariable {
 public:
  explicit SeedVariable(const char* value) {
    if (const char* old = std::getenv(kTestSeedVariable)) saved_ = old;
    setenv(kTestSeedVariable, value, 1);
  }
  ~SeedVariable() {
    if (saved_) {
      setenv(kTestSeedVariable, saved_->c_str(), 1);
    } else {
      unsetenv(kTestSeedVariable);
    }
  }

 private:
  std::optional<std::string> saved_;
};

TEST(TestSeedTest, EnvironmentOverrideIsHonoured) {
  const SeedVariable variable("12345");
  EXPECT_EQ(pick_test_seed(), 12345u);
  const TestSeed seed;
  EXPECT_EQ(seed.value(), 12345u);
  SeededRng rng;
  EXPECT_EQ(rng.value(), 12345u);
  std::mt19937 same(12345u);
  EXPECT_EQ(rng(), same());  // the engine is seeded with it
}

TEST(TestSeedTest, LargestSeedIsAccepted) {
  const SeedVariable variable("4294967295");
  EXPECT_EQ(pick_test_seed(), 4294967295u);
}

TEST(TestSeedTest, MalformedOverrideIsAFailureThatNamesTheVariable) {
  const SeedVariable variable("12x");
  EXPECT_NONFATAL_FAILURE(pick_test_seed(), "STEPGRAPH_TEST_SEED='12x' is not a seed");
  const SeedVariable too_big("4294967296");
  EXPECT_NONFATAL_FAILURE(pick_test_seed(), "is not a seed");
}

TEST(TestSeedTest, WithoutTheVariableSeedsAreDrawnFresh) {
  const SeedVariable variable("");  // empty counts as unset
  // Two draws from std::random_device agree by chance once in 2^32 runs;
  // three equal ones would mean the seed is not drawn at all.
  const std::uint32_t a = pick_test_seed(), b = pick_test_seed(), c = pick_test_seed();
  EXPECT_FALSE(a == b && b == c) << a;
}

TEST(TestSeedTest, FailureMessageNamesTheSeedAndHowToRerun) {
  const SeedVariable variable("987654321");
  EXPECT_NONFATAL_FAILURE(
      {
        const TestSeed seed;
        ADD_FAILURE() << "a check on random inputs failed";
      },
      "seed 987654321 (rerun with STEPGRAPH_TEST_SEED=987654321)");
  EXPECT_NONFATAL_FAILURE(
      {
        SeededRng rng;
        EXPECT_EQ(rng() % 2, 2u);
      },
      "seed 987654321 (rerun with STEPGRAPH_TEST_SEED=987654321)");
}

TEST(TestSeedTest, NoteEndsWithItsScope) {
  const SeedVariable variable("42");
  { const TestSeed seed; }
  ::testing::TestPartResultArray results;
  {
    const ::testing::ScopedFakeTestPartResultReporter reporter(
        ::testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &results);
    ADD_FAILURE() << "after the seed's scope";
  }
  ASSERT_EQ(results.size(), 1);
  EXPECT_EQ(std::string(results.GetTestPartResult(0).message()).find("seed 42"), std::string::npos)
      << results.GetTestPartResult(0).message();
}

}  // namespace
}  // namespace stepgraph::testing

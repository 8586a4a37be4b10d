// GraphCache: capture on a miss, hits by value key, LRU eviction by pool
// bytes, failed captures, lifetimes of evicted entries, typed lookups, stats.
#include "graphs/graph_cache.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

#include "engine/error.h"
#include "graphs/graph_key.h"
#include "tests/support/expect_error.h"

namespace stepgraph {
namespace {

class FakeGraph : public CachedGraph {
 public:
  explicit FakeGraph(std::int64_t bytes) : bytes_(bytes) {}
  std::int64_t pool_bytes() const override { return bytes_; }
  void set_pool_bytes(std::int64_t bytes) { bytes_ = bytes; }

 private:
  std::int64_t bytes_;
};

class OtherGraph : public CachedGraph {
 public:
  std::int64_t pool_bytes() const override { return 1; }
};

// A capture that makes FakeGraphs of `bytes` pool bytes and counts its calls.
struct Capture {
  std::int64_t bytes = 100;
  int calls = 0;

  std::function<std::shared_ptr<CachedGraph>()> fn() {
    return [this]() -> std::shared_ptr<CachedGraph> {
      ++calls;
      return std::make_shared<FakeGraph>(bytes);
    };
  }
};

GraphKey key_of(const std::string& name, std::int64_t tokens = 1024) {
  GraphKey key;
  key.add("graph", name).add("tokens", tokens);
  return key;
}

struct ExpectedStats {
  std::int64_t hits, misses, captures, evictions, entries, pool_bytes;
};

void expect_stats(const GraphCache& cache, const ExpectedStats& expected) {
  const GraphCache::Stats stats = cache.stats();
  EXPECT_EQ(stats.hits, expected.hits);
  EXPECT_EQ(stats.misses, expected.misses);
  EXPECT_EQ(stats.captures, expected.captures);
  EXPECT_EQ(stats.evictions, expected.evictions);
  EXPECT_EQ(stats.entries, expected.entries);
  EXPECT_EQ(stats.pool_bytes, expected.pool_bytes);
}

TEST(GraphCacheTest, MissCapturesOnceAndEqualKeysHit) {
  GraphCache cache(1000);
  Capture capture;
  const auto first = cache.get_or_capture(key_of("mlp"), capture.fn());
  ASSERT_NE(first, nullptr);
  EXPECT_EQ(capture.calls, 1);
  expect_stats(cache, {.hits = 0, .misses = 1, .captures = 1, .evictions = 0, .entries = 1, .pool_bytes = 100});

  // A key built separately with the same values hits without capturing.
  const auto second = cache.get_or_capture(key_of("mlp"), capture.fn());
  const auto third = cache.get_or_capture(key_of("mlp"), capture.fn());
  EXPECT_EQ(second, first);
  EXPECT_EQ(third, first);
  EXPECT_EQ(capture.calls, 1);
  expect_stats(cache, {.hits = 2, .misses = 1, .captures = 1, .evictions = 0, .entries = 1, .pool_bytes = 100});
}

TEST(GraphCacheTest, ChangedKeyCapturesAnew) {
  GraphCache cache(1000);
  Capture capture;
  const auto a = cache.get_or_capture(key_of("mlp", 1024), capture.fn());
  const auto b = cache.get_or_capture(key_of("mlp", 2048), capture.fn());
  const auto c = cache.get_or_capture(key_of("attention", 1024), capture.fn());
  EXPECT_NE(a, b);
  EXPECT_NE(a, c);
  EXPECT_NE(b, c);
  EXPECT_EQ(capture.calls, 3);
  expect_stats(cache, {.hits = 0, .misses = 3, .captures = 3, .evictions = 0, .entries = 3, .pool_bytes = 300});
}

TEST(GraphCacheTest, EvictsLeastRecentlyUsedByPoolBytes) {
  GraphCache cache(300);
  Capture capture;  // 100 bytes each
  cache.get_or_capture(key_of("a"), capture.fn());
  cache.get_or_capture(key_of("b"), capture.fn());
  cache.get_or_capture(key_of("c"), capture.fn());
  expect_stats(cache, {.hits = 0, .misses = 3, .captures = 3, .evictions = 0, .entries = 3, .pool_bytes = 300});

  // A hit makes "a" the most recently used, so "b" is now the oldest.
  cache.get_or_capture(key_of("a"), capture.fn());
  cache.get_or_capture(key_of("d"), capture.fn());
  EXPECT_TRUE(cache.contains(key_of("a")));
  EXPECT_FALSE(cache.contains(key_of("b")));
  EXPECT_TRUE(cache.contains(key_of("c")));
  EXPECT_TRUE(cache.contains(key_of("d")));
  expect_stats(cache, {.hits = 1, .misses = 4, .captures = 4, .evictions = 1, .entries = 3, .pool_bytes = 300});

  // find() refreshes too: "c" is kept, "a" (now the oldest) goes.
  EXPECT_NE(cache.find(key_of("c")), nullptr);
  cache.get_or_capture(key_of("e"), capture.fn());
  EXPECT_FALSE(cache.contains(key_of("a")));
  EXPECT_TRUE(cache.contains(key_of("c")));
  EXPECT_TRUE(cache.contains(key_of("d")));
  EXPECT_TRUE(cache.contains(key_of("e")));
  expect_stats(cache, {.hits = 2, .misses = 5, .captures = 5, .evictions = 2, .entries = 3, .pool_bytes = 300});

  // A 250-byte entry evicts oldest first until it fits: d, then c, then e.
  // (After "e", the order from newest is e, c, d.)
  capture.bytes = 250;
  cache.get_or_capture(key_of("big"), capture.fn());
  EXPECT_TRUE(cache.contains(key_of("big")));
  EXPECT_FALSE(cache.contains(key_of("c")));
  EXPECT_FALSE(cache.contains(key_of("d")));
  EXPECT_FALSE(cache.contains(key_of("e")));
  expect_stats(cache, {.hits = 2, .misses = 6, .captures = 6, .evictions = 5, .entries = 1, .pool_bytes = 250});

  // An evicted key captures again on its next use.
  capture.bytes = 50;
  cache.get_or_capture(key_of("b"), capture.fn());
  EXPECT_EQ(capture.calls, 7);
  expect_stats(cache, {.hits = 2, .misses = 7, .captures = 7, .evictions = 5, .entries = 2, .pool_bytes = 300});
}

TEST(GraphCacheTest, EvictsOnlyAsManyAsNeeded) {
  GraphCache cache(300);
  Capture capture;
  cache.get_or_capture(key_of("a"), capture.fn());
  cache.get_or_capture(key_of("b"), capture.fn());
  cache.get_or_capture(key_of("c"), capture.fn());
  capture.bytes = 150;
  cache.get_or_capture(key_of("d"), capture.fn());  // 450 -> drop a (350) -> drop b (250)
  EXPECT_FALSE(cache.contains(key_of("a")));
  EXPECT_FALSE(cache.contains(key_of("b")));
  EXPECT_TRUE(cache.contains(key_of("c")));
  EXPECT_TRUE(cache.contains(key_of("d")));
  expect_stats(cache, {.hits = 0, .misses = 4, .captures = 4, .evictions = 2, .entries = 2, .pool_bytes = 250});
}

TEST(GraphCacheTest, OversizedEntryStaysAlone) {
  GraphCache cache(100);
  Capture capture;
  capture.bytes = 60;
  cache.get_or_capture(key_of("small"), capture.fn());
  capture.bytes = 500;
  const auto big = cache.get_or_capture(key_of("big"), capture.fn());
  ASSERT_NE(big, nullptr);
  EXPECT_TRUE(cache.contains(key_of("big")));
  EXPECT_FALSE(cache.contains(key_of("small")));
  expect_stats(cache, {.hits = 0, .misses = 2, .captures = 2, .evictions = 1, .entries = 1, .pool_bytes = 500});

  // It hits like any entry, and goes when the next capture needs room.
  EXPECT_EQ(cache.get_or_capture(key_of("big"), capture.fn()), big);
  capture.bytes = 10;
  cache.get_or_capture(key_of("next"), capture.fn());
  EXPECT_FALSE(cache.contains(key_of("big")));
  expect_stats(cache, {.hits = 1, .misses = 3, .captures = 3, .evictions = 2, .entries = 1, .pool_bytes = 10});
}

TEST(GraphCacheTest, ThrowingCaptureLeavesNoEntry) {
  GraphCache cache(1000);
  Capture capture;
  cache.get_or_capture(key_of("kept"), capture.fn());
  int calls = 0;
  const auto throwing = [&calls]() -> std::shared_ptr<CachedGraph> {
    ++calls;
    throw std::runtime_error("capture failed");
  };
  EXPECT_THROW(cache.get_or_capture(key_of("broken"), throwing), std::runtime_error);
  EXPECT_THROW(cache.get_or_capture(key_of("broken"), throwing), std::runtime_error);
  EXPECT_EQ(calls, 2);  // nothing was stored, so the second call tried again
  EXPECT_FALSE(cache.contains(key_of("broken")));
  EXPECT_TRUE(cache.contains(key_of("kept")));
  expect_stats(cache, {.hits = 0, .misses = 3, .captures = 1, .evictions = 0, .entries = 1, .pool_bytes = 100});

  // A later capture under that key works.
  cache.get_or_capture(key_of("broken"), capture.fn());
  EXPECT_TRUE(cache.contains(key_of("broken")));
  expect_stats(cache, {.hits = 0, .misses = 4, .captures = 2, .evictions = 0, .entries = 2, .pool_bytes = 200});
}

TEST(GraphCacheTest, CaptureReturningNullIsInternalError) {
  GraphCache cache(1000);
  try {
    cache.get_or_capture(key_of("null"), []() -> std::shared_ptr<CachedGraph> { return nullptr; });
    FAIL() << "a null capture was accepted";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInternal);
    EXPECT_NE(error.message().find("returned no graph"), std::string::npos) << error.message();
  }
  EXPECT_FALSE(cache.contains(key_of("null")));
  expect_stats(cache, {.hits = 0, .misses = 1, .captures = 0, .evictions = 0, .entries = 0, .pool_bytes = 0});
}

TEST(GraphCacheTest, HeldEvictedEntryStaysAlive) {
  GraphCache cache(100);
  Capture capture;
  std::shared_ptr<CachedGraph> held = cache.get_or_capture(key_of("held"), capture.fn());
  std::weak_ptr<CachedGraph> held_weak = held;
  std::weak_ptr<CachedGraph> dropped_weak = cache.get_or_capture(key_of("dropped"), capture.fn());  // evicts "held"
  EXPECT_FALSE(cache.contains(key_of("held")));
  EXPECT_FALSE(held_weak.expired());
  EXPECT_EQ(held->pool_bytes(), 100);

  cache.get_or_capture(key_of("third"), capture.fn());  // evicts "dropped", which nobody holds
  EXPECT_TRUE(dropped_weak.expired());
  expect_stats(cache, {.hits = 0, .misses = 3, .captures = 3, .evictions = 2, .entries = 1, .pool_bytes = 100});

  held.reset();  // the last holder goes: now it is released
  EXPECT_TRUE(held_weak.expired());
}

TEST(GraphCacheTest, TypedGetOrCapture) {
  GraphCache cache(1000);
  int calls = 0;
  const auto make_fake = [&calls] {
    ++calls;
    return std::make_shared<FakeGraph>(64);
  };
  const std::shared_ptr<FakeGraph> first = cache.get_or_capture<FakeGraph>(key_of("typed"), make_fake);
  const std::shared_ptr<FakeGraph> again = cache.get_or_capture<FakeGraph>(key_of("typed"), make_fake);
  EXPECT_EQ(first, again);
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(first->pool_bytes(), 64);

  // The base type is fine too.
  EXPECT_EQ(cache.get_or_capture<CachedGraph>(key_of("typed"), make_fake), first);
  expect_stats(cache, {.hits = 2, .misses = 1, .captures = 1, .evictions = 0, .entries = 1, .pool_bytes = 64});
}

TEST(GraphCacheTest, TypedGetOrCaptureWithTheWrongTypeIsAnError) {
  GraphCache cache(1000);
  cache.get_or_capture<FakeGraph>(key_of("shared"), [] { return std::make_shared<FakeGraph>(10); });
  try {
    cache.get_or_capture<OtherGraph>(key_of("shared"), [] { return std::make_shared<OtherGraph>(); });
    FAIL() << "an entry of another type was returned";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(error.message().find("two different kinds of graph"), std::string::npos) << error.message();
    EXPECT_NE(error.message().find("graph=shared"), std::string::npos) << error.message();
  }
  // The stored entry is untouched.
  EXPECT_NE(std::dynamic_pointer_cast<FakeGraph>(cache.find(key_of("shared"))), nullptr);
}

TEST(GraphCacheTest, FindContainsEraseClear) {
  GraphCache cache(1000);
  Capture capture;
  EXPECT_EQ(cache.find(key_of("a")), nullptr);  // a miss by find changes nothing
  EXPECT_FALSE(cache.contains(key_of("a")));
  expect_stats(cache, {.hits = 0, .misses = 0, .captures = 0, .evictions = 0, .entries = 0, .pool_bytes = 0});

  const auto a = cache.get_or_capture(key_of("a"), capture.fn());
  cache.get_or_capture(key_of("b"), capture.fn());
  EXPECT_EQ(cache.find(key_of("a")), a);
  EXPECT_TRUE(cache.contains(key_of("a")));
  expect_stats(cache, {.hits = 1, .misses = 2, .captures = 2, .evictions = 0, .entries = 2, .pool_bytes = 200});

  cache.erase(key_of("a"));
  cache.erase(key_of("never stored"));  // a no-op
  EXPECT_FALSE(cache.contains(key_of("a")));
  EXPECT_TRUE(cache.contains(key_of("b")));
  expect_stats(cache, {.hits = 1, .misses = 2, .captures = 2, .evictions = 0, .entries = 1, .pool_bytes = 100});

  cache.clear();
  EXPECT_FALSE(cache.contains(key_of("b")));
  expect_stats(cache, {.hits = 1, .misses = 2, .captures = 2, .evictions = 0, .entries = 0, .pool_bytes = 0});

  cache.get_or_capture(key_of("a"), capture.fn());  // captures again after erase
  EXPECT_EQ(capture.calls, 3);
}

TEST(GraphCacheTest, PoolBytesAreReadOnceAtInsertion) {
  GraphCache cache(1000);
  auto graph = std::make_shared<FakeGraph>(100);
  cache.get_or_capture(key_of("a"), [graph] { return graph; });
  graph->set_pool_bytes(5000);  // later changes do not move the accounting
  expect_stats(cache, {.hits = 0, .misses = 1, .captures = 1, .evictions = 0, .entries = 1, .pool_bytes = 100});
  cache.erase(key_of("a"));
  expect_stats(cache, {.hits = 0, .misses = 1, .captures = 1, .evictions = 0, .entries = 0, .pool_bytes = 0});
}

TEST(GraphCacheTest, CaptureMayUseTheCache) {
  // A model's capture looks up its layer's graph in the same cache.
  GraphCache cache(1000);
  Capture layer_capture;
  GraphKey layer_key = key_of("layer");
  GraphKey model_key;
  model_key.add("model", "gpt").add("layer", layer_key);
  const auto model = cache.get_or_capture(model_key, [&]() -> std::shared_ptr<CachedGraph> {
    cache.get_or_capture(layer_key, layer_capture.fn());
    return std::make_shared<FakeGraph>(300);
  });
  ASSERT_NE(model, nullptr);
  EXPECT_TRUE(cache.contains(layer_key));
  EXPECT_TRUE(cache.contains(model_key));
  expect_stats(cache, {.hits = 0, .misses = 2, .captures = 2, .evictions = 0, .entries = 2, .pool_bytes = 400});
}

TEST(GraphCacheTest, BoundMustBePositive) {
  EXPECT_ERROR_CONTAINS(GraphCache(0), "graph cache: max_pool_bytes must be > 0, got 0");
  EXPECT_ERROR_CONTAINS(GraphCache(-1), "max_pool_bytes must be > 0, got -1");
  EXPECT_EQ(GraphCache(42).max_pool_bytes(), 42);
}

}  // namespace
}  // namespace stepgraph

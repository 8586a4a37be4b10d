// GraphCache: captured graphs by value key (GraphKey), bounded by the pool
// memory they hold (a pool several entries share counted once). A miss captures once and stores the result; when the
// total pool bytes exceed the bound, least-recently-used entries are evicted.
// CUDA-free: an entry is anything that owns pool memory (CachedGraph).
//
//   GraphCache cache(8ll << 30);
//   auto graph = cache.get_or_capture<MlpGraph>(key, [&] { return capture_mlp(config); });
//
// Eviction only drops the cache's reference (a shared_ptr): whoever still
// holds an evicted entry keeps it alive, and its pool is released when the
// last holder lets go. So the bound limits what the cache keeps alive, not
// what the process holds.
//
// Not thread-safe: use one cache per thread, or lock around every call.
#pragma once

#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <type_traits>
#include <typeinfo>
#include <unordered_map>

#include "engine/error.h"
#include "graphs/graph_key.h"

namespace stepgraph {

// What the cache holds: anything that owns pool memory.
class CachedGraph {
 public:
  virtual ~CachedGraph() = default;
  virtual std::int64_t pool_bytes() const = 0;
  // The memory pool_bytes() counts: graphs planned into one shared pool (one
  // per shape bucket, Note [Steps sharing one pool]) return that pool, so
  // the cache counts it once however many of them it holds.
  virtual const void* pool_identity() const { return this; }
};

class GraphCache {
 public:
  // Counters count since construction (clear() and erase() keep them);
  // entries and pool_bytes describe what is held now.
  struct Stats {
    std::int64_t hits = 0;
    std::int64_t misses = 0;
    std::int64_t captures = 0;   // captures stored (a throwing capture is a miss, not a capture)
    std::int64_t evictions = 0;  // entries dropped for the bound (not erase() or clear())
    std::int64_t entries = 0;
    std::int64_t pool_bytes = 0;
  };

  explicit GraphCache(std::int64_t max_pool_bytes);  // must be > 0

  // Hit: returns the entry and marks it most recently used. Miss: calls
  // capture(), stores the result, evicts least-recently-used entries until the
  // total pool bytes are within the bound (never the entry just inserted: if
  // it alone exceeds the bound it stays, with a warning), returns it.
  // A capture() that throws leaves the cache unchanged; capture() returning
  // nullptr is an Error(kInternal). Pool bytes are read once, at insertion.
  std::shared_ptr<CachedGraph> get_or_capture(const GraphKey& key,
                                              const std::function<std::shared_ptr<CachedGraph>()>& capture);

  // Typed: the entry as a T. An entry of another kind under this key is an
  // Error(kInvalidArgument).
  template <typename T>
  std::shared_ptr<T> get_or_capture(const GraphKey& key, const std::function<std::shared_ptr<T>()>& capture) {
    static_assert(std::is_base_of_v<CachedGraph, T>, "GraphCache holds CachedGraph subclasses");
    std::shared_ptr<CachedGraph> graph =
        get_or_capture(key, [&capture]() -> std::shared_ptr<CachedGraph> { return capture(); });
    std::shared_ptr<T> typed = std::dynamic_pointer_cast<T>(graph);
    const CachedGraph& stored = *graph;
    SG_CHECK(typed != nullptr, "graph cache: the entry for ", key.to_string(), " is a ", typeid(stored).name(),
             ", not the requested ", typeid(T).name(),
             "; two different kinds of graph were stored under one key: add a field that tells them apart");
    return typed;
  }

  // A hit counts and refreshes recency; a miss returns nullptr and changes
  // nothing (it captures nothing, so it is not counted).
  std::shared_ptr<CachedGraph> find(const GraphKey& key);
  // No stats change, no recency change.
  bool contains(const GraphKey& key) const;
  // Drops the entry if there is one.
  void erase(const GraphKey& key);
  // Drops every entry.
  void clear();

  Stats stats() const;
  std::int64_t max_pool_bytes() const { return max_pool_bytes_; }

 private:
  struct Entry {
    GraphKey key;
    std::shared_ptr<CachedGraph> graph;
    std::int64_t pool_bytes = 0;
    const void* pool = nullptr;  // CachedGraph::pool_identity
  };
  struct HeldPool {
    std::int64_t bytes = 0;
    int entries = 0;
  };
  using Order = std::list<Entry>;  // most recently used first

  void evict_to_bound();
  void drop(Order::iterator entry);

  std::int64_t max_pool_bytes_;
  Order order_;
  std::unordered_map<GraphKey, Order::iterator, GraphKeyHash> index_;
  std::unordered_map<const void*, HeldPool> pools_;  // what stats_.pool_bytes adds up, each pool once
  Stats stats_;
};

}  // namespace stepgraph

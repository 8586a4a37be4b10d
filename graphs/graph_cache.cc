// GraphCache: lookups, capture on a miss, and LRU eviction by pool bytes.
#include "graphs/graph_cache.h"

#include <iterator>
#include <utility>

#include "engine/logging.h"

namespace stepgraph {

GraphCache::GraphCache(std::int64_t max_pool_bytes) : max_pool_bytes_(max_pool_bytes) {
  SG_CHECK(max_pool_bytes > 0, "graph cache: max_pool_bytes must be > 0, got ", max_pool_bytes);
}

std::shared_ptr<CachedGraph> GraphCache::get_or_capture(const GraphKey& key,
                                                        const std::function<std::shared_ptr<CachedGraph>()>& capture) {
  if (std::shared_ptr<CachedGraph> hit = find(key)) return hit;

  ++stats_.misses;
  // Nothing is held across capture(): it may itself use this cache (a model
  // capturing its layers), and if it throws the cache is left as it was.
  std::shared_ptr<CachedGraph> graph = capture();
  SG_CHECK_CODE(graph != nullptr, ErrorCode::kInternal, "graph cache: the capture for ", key.to_string(),
                " returned no graph");
  SG_CHECK_CODE(!index_.contains(key), ErrorCode::kInternal, "graph cache: the capture for ", key.to_string(),
                " stored an entry under its own key");
  const std::int64_t bytes = graph->pool_bytes();
  SG_CHECK_CODE(bytes >= 0, ErrorCode::kInternal, "graph cache: the graph for ", key.to_string(),
                " reports negative pool bytes (", bytes, ")");

  const void* pool = graph->pool_identity();
  order_.push_front(Entry{key, graph, bytes, pool});
  index_.emplace(key, order_.begin());
  ++stats_.captures;
  HeldPool& held = pools_[pool];
  if (held.entries++ == 0) {
    held.bytes = bytes;
    stats_.pool_bytes += bytes;
  }
  logger().debug("graph cache: captured {} ({} pool bytes)", key.to_string(), bytes);

  if (bytes > max_pool_bytes_) {
    logger().warn(
        "graph cache: {} holds {} pool bytes, more than the cache's bound of {}; it is kept, alone, "
        "until something else is captured",
        key.to_string(), bytes, max_pool_bytes_);
  }
  evict_to_bound();
  return graph;
}

std::shared_ptr<CachedGraph> GraphCache::find(const GraphKey& key) {
  const auto found = index_.find(key);
  if (found == index_.end()) return nullptr;
  order_.splice(order_.begin(), order_, found->second);  // iterators stay valid
  ++stats_.hits;
  return found->second->graph;
}

bool GraphCache::contains(const GraphKey& key) const { return index_.contains(key); }

void GraphCache::erase(const GraphKey& key) {
  const auto found = index_.find(key);
  if (found != index_.end()) drop(found->second);
}

void GraphCache::clear() {
  index_.clear();
  order_.clear();
  pools_.clear();
  stats_.pool_bytes = 0;
}

GraphCache::Stats GraphCache::stats() const {
  Stats now = stats_;
  now.entries = static_cast<std::int64_t>(order_.size());
  return now;
}

// Evicts from the least recently used end; the front (the entry just
// inserted) always stays.
void GraphCache::evict_to_bound() {
  while (stats_.pool_bytes > max_pool_bytes_ && order_.size() > 1) {
    const auto victim = std::prev(order_.end());
    logger().debug("graph cache: evicted {} ({} pool bytes)", victim->key.to_string(), victim->pool_bytes);
    drop(victim);
    ++stats_.evictions;
  }
}

// Only the cache's reference goes; other holders keep the graph alive.
void GraphCache::drop(Order::iterator entry) {
  const auto held = pools_.find(entry->pool);
  if (held != pools_.end() && --held->second.entries == 0) {  // the pool's last entry
    stats_.pool_bytes -= held->second.bytes;
    pools_.erase(held);
  }
  index_.erase(entry->key);
  order_.erase(entry);
}

}  // namespace stepgraph

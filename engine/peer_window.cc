#include "engine/peer_window.h"

#include <cstring>
#include <map>
#include <mutex>
#include <utility>

#include "engine/error.h"
#include "engine/logging.h"

namespace stepgraph {
namespace {

// The live windows by (communicator, slot): slots are unique per
// communicator while their steps live (Note [The pool as symmetric memory]).
struct Registry {
  std::mutex mutex;
  std::map<std::pair<std::uint64_t, std::int64_t>, std::weak_ptr<PeerWindow>> by_slot;
};

Registry& registry() {
  static Registry* instance = new Registry;  // never destroyed: windows may outlive static destruction order
  return *instance;
}

}  // namespace

std::string_view peer_transport_name(PeerTransport transport) {
  switch (transport) {
    case PeerTransport::kNccl: return "nccl";
    case PeerTransport::kPeerCopy: return "peer_copy";
  }
  return "unknown";
}

PeerWindow::PeerWindow(std::uint64_t communicator, int rank, std::byte* base, std::int64_t bytes,
                       std::vector<Peer> peers, std::function<void()> release)
    : communicator_(communicator),
      rank_(rank),
      base_(base),
      bytes_(bytes),
      peers_(std::move(peers)),
      release_(std::move(release)) {}

std::shared_ptr<PeerWindow> PeerWindow::make(std::uint64_t communicator, int rank, std::byte* base,
                                             std::int64_t bytes, std::vector<Peer> peers,
                                             std::function<void()> release) {
  SG_CHECK_CODE(rank >= 0 && static_cast<std::size_t>(rank) < peers.size(), ErrorCode::kInternal,
                "a peer window of rank ", rank, " with ", peers.size(), " peers");
  std::shared_ptr<PeerWindow> window(
      new PeerWindow(communicator, rank, base, bytes, std::move(peers), std::move(release)));
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  for (const PeerReceive& receive : window->peers_[static_cast<std::size_t>(rank)].receives) {
    std::weak_ptr<PeerWindow>& slot = r.by_slot[{communicator, receive.slot}];
    SG_CHECK_CODE(slot.expired(), ErrorCode::kInternal, "peer window: slot ", receive.slot,
                  " of communicator #", communicator, " is held by a live step already");
    slot = window;
  }
  return window;
}

PeerWindow::~PeerWindow() {
  {
    Registry& r = registry();
    std::lock_guard lock(r.mutex);
    for (const PeerReceive& receive : peers_[static_cast<std::size_t>(rank_)].receives) {
      const auto found = r.by_slot.find({communicator_, receive.slot});
      if (found != r.by_slot.end() && found->second.expired()) r.by_slot.erase(found);
    }
  }
  if (release_) {
    try {
      release_();
    } catch (const std::exception& e) {
      logger().error("releasing a peer window failed: {}", e.what());
    }
  }
}

const PeerReceive* PeerWindow::find(int rank, std::int64_t slot) const {
  if (rank < 0 || static_cast<std::size_t>(rank) >= peers_.size()) return nullptr;
  for (const PeerReceive& receive : peers_[static_cast<std::size_t>(rank)].receives) {
    if (receive.slot == slot) return &receive;
  }
  return nullptr;
}

void* PeerWindow::receive_address(int to, std::int64_t slot, std::int64_t bytes) const {
  const PeerReceive* receive = find(to, slot);
  SG_CHECK_CODE(receive != nullptr, ErrorCode::kInvalidState, "send_recv in slot ", slot, " to rank ", to,
                ": that rank's captured step receives nothing in this slot (the ranks traced different calls)");
  SG_CHECK_CODE(receive->bytes == bytes, ErrorCode::kInvalidState, "send_recv in slot ", slot, " sends ", bytes,
                " bytes but rank ", to, " receives ", receive->bytes, " (the ranks traced different calls)");
  const Peer& peer = peers_[static_cast<std::size_t>(to)];
  SG_CHECK_CODE(peer.base != nullptr, ErrorCode::kInternal, "peer window: rank ", to, "'s pool is not mapped");
  return peer.base + receive->offset;
}

bool PeerWindow::receives_at(std::int64_t slot, const void* address) const {
  const PeerReceive* receive = find(rank_, slot);
  return receive != nullptr && static_cast<const std::byte*>(address) == base_ + receive->offset;
}

std::shared_ptr<PeerWindow> find_peer_window(std::uint64_t communicator, std::int64_t slot, const void* address) {
  std::shared_ptr<PeerWindow> window;
  {
    Registry& r = registry();
    std::lock_guard lock(r.mutex);
    const auto found = r.by_slot.find({communicator, slot});
    if (found == r.by_slot.end()) return nullptr;
    window = found->second.lock();
  }
  return window != nullptr && window->receives_at(slot, address) ? window : nullptr;
}

std::string encode_peer_receives(const std::vector<PeerReceive>& receives) {
  std::string out(receives.size() * sizeof(PeerReceive), '\0');
  if (!receives.empty()) std::memcpy(out.data(), receives.data(), out.size());
  return out;
}

std::vector<PeerReceive> decode_peer_receives(std::string_view bytes, std::string_view who) {
  SG_CHECK_CODE(bytes.size() % sizeof(PeerReceive) == 0, ErrorCode::kInvalidState, who, ": a receive table of ",
                bytes.size(), " bytes is not a whole number of entries");
  std::vector<PeerReceive> out(bytes.size() / sizeof(PeerReceive));
  if (!out.empty()) std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

}  // namespace stepgraph

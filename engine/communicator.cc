#include "engine/communicator.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <vector>
#include <mutex>
#include <string>
#include <unordered_map>

#include "engine/error.h"

namespace stepgraph {
namespace {

// The live communicators by id (Note [Collectives are ops]).
struct Registry {
  std::mutex mutex;
  std::unordered_map<std::uint64_t, Communicator*> live;
};

Registry& registry() {
  static Registry* instance = new Registry;  // never destroyed: communicators may outlive static destruction order
  return *instance;
}

std::atomic<std::uint64_t> next_id{1};

}  // namespace

std::string_view reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kMax: return "max";
  }
  return "?";
}

Communicator::Communicator(std::string name, int rank, int world_size)
    : name_(std::move(name)), rank_(rank), world_size_(world_size), id_(next_id.fetch_add(1)) {
  SG_CHECK(!name_.empty(), "a communicator needs a name (it appears in errors): 'world', 'dp', 'tp', ...");
  SG_CHECK(world_size >= 1, "communicator '", name_, "': world size must be >= 1, got ", world_size);
  SG_CHECK(rank >= 0 && rank < world_size, "communicator '", name_, "': rank must be in [0, ", world_size, "), got ",
           rank);
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  r.live.emplace(id_, this);
}

Communicator::~Communicator() {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  r.live.erase(id_);
}

std::string Communicator::describe() const {
  return detail::concat("communicator '", name_, "' (rank ", rank_, " of ", world_size_, ", ", device_name(device()),
                        ")");
}

void Communicator::set_peer_transport(PeerTransport transport, std::string reason) {
  peer_transport_ = transport;
  peer_transport_reason_ = std::move(reason);
}

std::shared_ptr<PeerWindow> Communicator::share_window(std::byte*, std::int64_t, const std::vector<PeerReceive>&) {
  SG_THROW(ErrorCode::kUnsupported, describe(), " cannot share a pool with its peers (", peer_transport_reason_, ")");
}

void Communicator::window_send_recv(const PeerWindow&, std::int64_t, const void*, int, void*, int, std::int64_t,
                                    CUstream_st*) {
  SG_THROW(ErrorCode::kUnsupported, describe(), " has no peer windows (", peer_transport_reason_, ")");
}

void Communicator::window_post(const PeerWindow&, std::int64_t, PeerFlag, int, CUstream_st*) {
  SG_THROW(ErrorCode::kUnsupported, describe(), " has no peer windows (", peer_transport_reason_, ")");
}

void Communicator::window_await(const PeerWindow&, std::int64_t, PeerFlag, int, CUstream_st*) {
  SG_THROW(ErrorCode::kUnsupported, describe(), " has no peer windows (", peer_transport_reason_, ")");
}

std::unique_ptr<Communicator> Communicator::split(int color, int key, std::string name) {
  SG_CHECK(color >= 0, describe(), " split '", name, "': color must be >= 0, got ", color);
  const std::vector<std::string> all = exchange(detail::concat(color, " ", key), detail::concat("split '", name, "'"));
  struct Member {
    int color, key, rank;
  };
  std::vector<Member> members;
  for (int r = 0; r < world_size_; ++r) {
    Member m{0, 0, r};
    SG_CHECK(std::sscanf(all[static_cast<std::size_t>(r)].c_str(), "%d %d", &m.color, &m.key) == 2, describe(),
             " split '", name, "': rank ", r, " sent '", all[static_cast<std::size_t>(r)], "', not a color and key");
    if (m.color == color) members.push_back(m);
  }
  std::stable_sort(members.begin(), members.end(), [](const Member& a, const Member& b) { return a.key < b.key; });
  Group group{color, 0, static_cast<int>(members.size()), members.front().rank, splits_++};
  for (std::size_t i = 0; i < members.size(); ++i) {
    if (members[i].rank == rank_) group.rank = static_cast<int>(i);
  }
  return make_group(group, std::move(name));
}

std::unique_ptr<Communicator> Communicator::make_group(const Group&, std::string name) {
  SG_CHECK_CODE(false, ErrorCode::kUnsupported, describe(), " cannot split into '", name,
                "': only NCCL and thread-world communicators split (a 2-D world of host processes is not supported; "
                "run it on cuda, or with one kind of parallelism)");
  return nullptr;
}

void Communicator::check_device(Device device, std::string_view what) const {
  SG_CHECK(this->device() == device, what, ": ", describe(), " cannot move ", device_name(device),
           " tensors; make the communicator for the context's device");
}

void Communicator::check_count(std::string_view call, std::int64_t count) const {
  SG_CHECK(count >= 0, describe(), " ", call, ": count must be >= 0, got ", count);
}

void Communicator::check_peer(std::string_view call, int peer, std::string_view role) const {
  SG_CHECK(peer >= 0 && peer < world_size_, describe(), " ", call, ": ", role, " must be a rank in [0, ", world_size_,
           "), got ", peer);
  if (role == "peer") {
    SG_CHECK(peer != rank_, describe(), " ", call, ": the peer must be another rank, got this rank (", peer, ")");
  }
}

Communicator& find_communicator(std::uint64_t id) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  const auto it = r.live.find(id);
  SG_CHECK_CODE(it != r.live.end(), ErrorCode::kInvalidState, "communicator #", id,
                " was destroyed; a collective op or captured step still refers to it (keep the communicator alive "
                "for as long as the steps that use it)");
  return *it->second;
}

}  // namespace stepgraph

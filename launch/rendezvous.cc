#include "launch/rendezvous.h"

#include <poll.h>
#include <unistd.h>

#include <map>
#include <utility>

#include "launch/rendezvous_handshake.h"
#include "launch/rendezvous_secret.h"
#include "launch/rendezvous_wire.h"
#include "engine/logging.h"

// Note [Rendezvous protocol]
// A star through rank 0. Every message is a frame: an 8-byte little-endian
// length, then that many bytes; after a connection's handshake the bytes end
// in a MAC (Note [Rendezvous authentication] in rendezvous_auth.cc).
//   handshake (rank r <-> 0, once): hello (magic "SGRV", version, rank, world
//           size, nonce), challenge, response (rendezvous_handshake.cc);
//   join    (rank r -> 0, once): the run tag;
//   verdict (0 -> rank r, once): an answer with sequence 0.
//   request (rank r -> 0, per exchange): kind, sequence number, `what`, the rank's bytes.
//   answer  (0 -> rank r, per exchange): status, sequence number, then
//           ok:    the payload (all_gather: count, then each rank's length and bytes;
//                  broadcast: rank 0's bytes; barrier: nothing);
//           error: an ErrorCode and the message, raised as is on every rank.
// Rank 0 gathers the requests of all ranks at once (poll over every socket),
// so a rank that exits is seen the moment its socket closes, and no large
// send can deadlock against another; it then checks that every rank is in
// the same exchange (kind, sequence number, `what`) and answers. A failure
// anywhere becomes an error answer to every rank still connected, so every
// rank raises the same message naming the rank at fault. A rank sending a
// large request watches its socket: an answer arriving before the request is
// taken can only be an error, and it stops sending to read it.
//
// Where rank 0 listens: Note [Where rank 0 listens] in rendezvous_handshake.cc.

// Note [Peers wait twice as long]
// Rank 0 waits `timeout` for the other ranks; they wait twice that for rank
// 0's answer. When a rank is slow, rank 0 sees it first and its error answer,
// which names the slow rank, reaches the others before they give up on rank 0
// (which would name rank 0, an innocent bystander). Rank 0 itself being late
// by more than `timeout` is named by the others.

namespace stepgraph {
namespace {

using Clock = wire::Clock;
using std::chrono::milliseconds;
using wire::Io;
using wire::IoResult;
using wire::quoted;

constexpr std::size_t kMaxWhatBytes = 4096;
constexpr std::size_t kMaxRequestBytes = 64 + kMaxWhatBytes + Rendezvous::kMaxBlobBytes + kMacBytes;

// "rank 3", "ranks 1, 2, 5".
std::string ranks_text(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) out += (i == 0 ? "" : ", ") + std::to_string(ranks[i]);
  return out;
}

std::string join(const std::vector<std::string>& parts, std::string_view separator) {
  std::string out;
  for (std::size_t i = 0; i < parts.size(); ++i) out += (i == 0 ? "" : std::string(separator)) + parts[i];
  return out;
}

const char* exchange_name(std::uint8_t kind) {
  switch (kind) {
    case 1: return "all_gather";
    case 2: return "broadcast";
    case 3: return "barrier";
  }
  return "an unknown exchange";
}

}  // namespace

// ---- Rendezvous

std::unique_ptr<Rendezvous> Rendezvous::connect(const LaunchInfo& info, std::string_view run_tag,
                                                milliseconds timeout) {
  SG_CHECK(info.world_size >= 1, "rendezvous: world size ", info.world_size, " must be at least 1");
  SG_CHECK(info.rank >= 0 && info.rank < info.world_size, "rendezvous: rank ", info.rank, " is outside [0, ",
           info.world_size, ")");
  SG_CHECK(info.master_port >= 1 && info.master_port <= 65535, "rendezvous: port ", info.master_port,
           " is outside [1, 65535]");
  SG_CHECK(timeout.count() > 0, "rendezvous: the timeout must be positive, got ", timeout.count(), " ms");
  SG_CHECK(run_tag.size() <= handshake::kMaxTagBytes, "rendezvous: the run tag has ", run_tag.size(),
           " bytes, more than ", handshake::kMaxTagBytes, "; pass a hash of the configuration");
  if (info.world_size == 1) return std::unique_ptr<Rendezvous>(new Rendezvous(0, 1, timeout, {}, {}));
  // Without a secret, anyone who reaches rank 0's port could take a rank: on one host the rendezvous
  // stays on loopback (Note [Where rank 0 listens]); over several it does not start.
  SG_CHECK(!info.secret.empty() || info.world_size == info.local_world_size, "rank ", info.rank,
           ": this run spans several hosts (world size ", info.world_size, ", ", info.local_world_size,
           " per host) but has no rendezvous secret, so any process that reaches MASTER_ADDR:MASTER_PORT could join "
           "it; ",
           how_to_pass_a_secret());
  SG_CHECK(info.secret.size() <= kMaxSecretBytes, "rendezvous: the secret has ", info.secret.size(),
           " bytes, more than ", kMaxSecretBytes);

  std::vector<handshake::Connection> connections;
  std::vector<std::string> late_faults(static_cast<std::size_t>(info.world_size));
  if (info.rank == 0) {
    connections = handshake::accept_ranks(info, run_tag, timeout, &late_faults);
  } else {
    connections.push_back(handshake::join_rank0(info, run_tag, timeout));
  }
  std::vector<int> sockets;
  std::vector<FrameMac> macs;
  for (handshake::Connection& connection : connections) {
    sockets.push_back(connection.fd.release());
    macs.push_back(std::move(connection.mac));
  }
  std::unique_ptr<Rendezvous> rendezvous(
      new Rendezvous(info.rank, info.world_size, timeout, std::move(sockets), std::move(macs)));
  rendezvous->late_faults_ = std::move(late_faults);
  return rendezvous;
}

Rendezvous::Rendezvous(int rank, int world_size, milliseconds timeout, std::vector<int> sockets,
                       std::vector<FrameMac> macs)
    : rank_(rank), world_size_(world_size), timeout_(timeout), sockets_(std::move(sockets)), macs_(std::move(macs)) {}

Rendezvous::~Rendezvous() {
  for (const int fd : sockets_) {
    if (fd >= 0) ::close(fd);
  }
}

void Rendezvous::set_timeout(milliseconds timeout) {
  SG_CHECK(timeout.count() > 0, "rendezvous: the timeout must be positive, got ", timeout.count(), " ms");
  timeout_ = timeout;
}

void Rendezvous::check_usable(std::string_view local, std::string_view what) const {
  SG_CHECK_CODE(failure_.empty(), ErrorCode::kInvalidState, "rank ", rank_, ": the rendezvous failed earlier (",
                failure_, ") and cannot be used again; end this run");
  SG_CHECK(local.size() <= kMaxBlobBytes, "rendezvous ", quoted(what), ": rank ", rank_, " gives ", local.size(),
           " bytes, more than the ", kMaxBlobBytes, " one exchange takes");
  SG_CHECK(what.size() <= kMaxWhatBytes, "rendezvous: the name of an exchange has ", what.size(), " bytes, more than ",
           kMaxWhatBytes);
}

std::vector<std::string> Rendezvous::all_gather(std::string_view local, std::string_view what) {
  check_usable(local, what);
  if (world_size_ == 1) return {std::string(local)};
  const std::string payload = exchange(Exchange::kAllGather, local, what);
  const std::string context = detail::concat("all_gather ", quoted(what), " on rank ", rank_);
  wire::Reader reader(payload, "answer to " + context);
  const std::uint32_t count = reader.u32();
  SG_CHECK_CODE(count == static_cast<std::uint32_t>(world_size_), ErrorCode::kIo, "malformed answer to ", context, ": ",
                count, " blobs for ", world_size_, " ranks");
  std::vector<std::string> blobs;
  blobs.reserve(count);
  for (std::uint32_t i = 0; i < count; ++i) blobs.emplace_back(reader.take(reader.u64()));
  return blobs;
}

std::string Rendezvous::broadcast(std::string_view from_rank0, std::string_view what) {
  check_usable(rank_ == 0 ? from_rank0 : std::string_view(), what);
  if (world_size_ == 1) return std::string(from_rank0);
  return exchange(Exchange::kBroadcast, rank_ == 0 ? from_rank0 : std::string_view(), what);
}

void Rendezvous::barrier(std::string_view what) {
  check_usable({}, what);
  if (world_size_ == 1) return;
  (void)exchange(Exchange::kBarrier, {}, what);
}

void Rendezvous::fail(ErrorCode code, std::string message) {
  failure_ = message;
  SG_THROW(code, message);
}

std::string Rendezvous::exchange(Exchange kind, std::string_view local, std::string_view what) {
  ++sequence_;
  return rank_ == 0 ? exchange_as_root(kind, local, what) : exchange_as_peer(kind, local, what);
}

std::string Rendezvous::exchange_as_root(Exchange kind, std::string_view local, std::string_view what) {
  const std::string name =
      detail::concat(exchange_name(static_cast<std::uint8_t>(kind)), " ", quoted(what), " (exchange ", sequence_, ")");
  const std::size_t world = static_cast<std::size_t>(world_size_);
  // Faults grouped by what went wrong, each with the ranks it happened to.
  std::map<std::string, std::vector<int>> faults;
  std::vector<bool> gone(world, false);  // ranks whose connection closed: no one to tell
  ErrorCode code = ErrorCode::kIo;
  for (std::size_t rank = 1; rank < world; ++rank) {
    if (!late_faults_[rank].empty()) faults[late_faults_[rank]].push_back(static_cast<int>(rank));
  }

  std::vector<wire::FrameReader> readers(world, wire::FrameReader(kMaxRequestBytes));
  std::vector<std::string> requests(world);
  std::vector<int> pending;
  for (int rank = 1; rank < world_size_; ++rank) pending.push_back(rank);
  const Clock::time_point deadline = Clock::now() + timeout_;
  while (faults.empty() && !pending.empty()) {
    std::vector<pollfd> ready;
    for (const int rank : pending) ready.push_back({sockets_[static_cast<std::size_t>(rank)], POLLIN, 0});
    if (wire::poll_until(ready.data(), ready.size(), deadline) == 0) {
      faults[detail::concat("did not answer within ", timeout_.count(), " ms")] = pending;
      break;
    }
    std::vector<int> still;
    for (std::size_t i = 0; i < pending.size(); ++i) {
      const int rank = pending[i];
      if (ready[i].revents == 0) {
        still.push_back(rank);
        continue;
      }
      wire::FrameReader& reader = readers[static_cast<std::size_t>(rank)];
      IoResult result = reader.step(sockets_[static_cast<std::size_t>(rank)]);
      if (result.status == Io::kDone) {
        result =
            wire::open_sealed(macs_[static_cast<std::size_t>(rank)], reader, &requests[static_cast<std::size_t>(rank)]);
      }
      switch (result.status) {
        case Io::kDone: break;
        case Io::kBadMac:
          faults["sent a request with a wrong MAC (altered on the way, or not from that rank)"].push_back(rank);
          gone[static_cast<std::size_t>(rank)] = true;  // the connection can no longer be trusted
          break;
        case Io::kPending: still.push_back(rank); break;
        case Io::kClosed:
          faults[wire::closed_text(result)].push_back(rank);
          gone[static_cast<std::size_t>(rank)] = true;
          break;
        case Io::kTooLarge:
          faults[detail::concat("sent a frame of ", reader.announced(), " bytes, more than ", reader.limit(),
                                " (a different StepGraph build?)")]
              .push_back(rank);
          break;
        default: faults["failed"].push_back(rank); break;
      }
    }
    pending = std::move(still);
  }

  std::vector<std::string_view> blobs(world);
  blobs[0] = local;
  std::vector<std::string> mismatches;
  if (faults.empty()) {
    for (int rank = 1; rank < world_size_; ++rank) {
      const std::string& request = requests[static_cast<std::size_t>(rank)];
      try {
        wire::Reader reader(request, detail::concat("request from rank ", rank, " to ", name));
        const std::uint8_t their_kind = reader.u8();
        const std::uint64_t their_sequence = reader.u64();
        const std::string_view their_what = reader.take(reader.u32());
        blobs[static_cast<std::size_t>(rank)] = reader.rest();
        if (their_kind != static_cast<std::uint8_t>(kind) || their_sequence != sequence_ || their_what != what) {
          mismatches.push_back(detail::concat("rank ", rank, " is in ", exchange_name(their_kind), " ",
                                              quoted(their_what), " (exchange ", their_sequence, ")"));
        }
      } catch (const Error& error) {
        mismatches.push_back(error.message());
      }
    }
  }

  if (!faults.empty() || !mismatches.empty()) {
    std::vector<std::string> parts;
    for (const auto& [reason, ranks] : faults) parts.push_back(ranks_text(ranks) + " " + reason);
    if (!mismatches.empty()) {
      code = ErrorCode::kInvalidState;
      parts.push_back(join(mismatches, "; ") + " while rank 0 is in " + name +
                      "; every rank must make the same exchanges in the same order");
    }
    const std::string message = name + " failed: " + join(parts, "; ");
    const Clock::time_point error_by = wire::error_deadline(timeout_);
    for (std::size_t rank = 1; rank < world; ++rank) {
      if (!gone[rank]) wire::send_error_answer(sockets_[rank], macs_[rank], sequence_, code, message, error_by);
    }
    fail(code, message);
  }

  std::string payload;
  switch (kind) {
    case Exchange::kAllGather: {
      std::size_t bytes = 4;
      for (const std::string_view blob : blobs) bytes += 8 + blob.size();
      payload.reserve(bytes);
      wire::put_u32(payload, static_cast<std::uint32_t>(world));
      for (const std::string_view blob : blobs) {
        wire::put_u64(payload, blob.size());
        payload += blob;
      }
      break;
    }
    case Exchange::kBroadcast: payload = std::string(local); break;
    case Exchange::kBarrier: break;
  }
  const std::string head = wire::ok_answer_head(sequence_);
  const Clock::time_point send_deadline = Clock::now() + timeout_;
  for (int rank = 1; rank < world_size_; ++rank) {
    const auto at = static_cast<std::size_t>(rank);
    const IoResult sent = wire::send_sealed(sockets_[at], macs_[at], {head, payload}, send_deadline);
    // The others have their answer; the next exchange reports this rank to everyone.
    if (sent.status != Io::kDone) {
      late_faults_[static_cast<std::size_t>(rank)] = detail::concat(
          sent.status == Io::kClosed ? wire::closed_text(sent) : "did not take its answer in time", " after ", name);
    }
  }
  return payload;
}

std::string Rendezvous::exchange_as_peer(Exchange kind, std::string_view local, std::string_view what) {
  const std::string name =
      detail::concat(exchange_name(static_cast<std::uint8_t>(kind)), " ", quoted(what), " (exchange ", sequence_, ")");
  const int fd = sockets_[0];
  std::string head;
  wire::put_u8(head, static_cast<std::uint8_t>(kind));
  wire::put_u64(head, sequence_);
  wire::put_u32(head, static_cast<std::uint32_t>(what.size()));
  head += what;
  // See Note [Peers wait twice as long].
  const milliseconds patience = 2 * timeout_;
  const Clock::time_point deadline = Clock::now() + patience;
  FrameMac& mac = macs_[0];
  IoResult result = wire::send_sealed(fd, mac, {head, local}, deadline, wire::WhileSending::kStopOnInput);
  const std::uint64_t limit = 64 + kMacBytes + static_cast<std::uint64_t>(world_size_) * (8 + kMaxBlobBytes);
  wire::FrameReader reader(limit);
  std::string body;
  if (result.status == Io::kDone || result.status == Io::kAnswerArrived) {
    result = wire::read_sealed(fd, mac, reader, deadline, &body);
  } else if (result.status == Io::kClosed) {
    // Rank 0 may have answered (with the reason) before it went: read what arrived.
    const IoResult answered = wire::read_sealed(fd, mac, reader, Clock::now(), &body);
    if (answered.status == Io::kDone) result = answered;
  }
  switch (result.status) {
    case Io::kDone: break;
    case Io::kClosed:
      fail(ErrorCode::kIo, detail::concat(name, " failed on rank ", rank_, ": rank 0 ", wire::closed_text(result)));
    case Io::kTimedOut:
      fail(ErrorCode::kIo,
           detail::concat(name, " failed on rank ", rank_, ": rank 0 did not answer within ", patience.count(), " ms"));
    case Io::kBadMac:
      fail(ErrorCode::kIo, detail::concat(name, " failed on rank ", rank_,
                                          ": the answer from rank 0 has a wrong MAC (altered on the way, or not from "
                                          "rank 0)"));
    default:
      fail(ErrorCode::kIo, detail::concat(name, " failed on rank ", rank_, ": rank 0 sent a frame of ",
                                          reader.announced(), " bytes, more than ", limit));
  }
  wire::Answer answer;
  try {
    answer = wire::decode_answer(std::move(body), sequence_, detail::concat(name, " on rank ", rank_));
  } catch (const Error& error) {
    fail(error.code(), error.message());
  }
  if (answer.status != wire::kAnswerOk) {
    fail(answer.code, detail::concat(answer.payload, " (reported to rank ", rank_, " by rank 0)"));
  }
  return std::move(answer.payload);
}

}  // namespace stepgraph

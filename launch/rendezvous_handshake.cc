#include "launch/rendezvous_handshake.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <optional>
#include <thread>
#include <utility>

#include "launch/rendezvous_secret.h"
#include "engine/logging.h"

// Note [Where rank 0 listens]
// Rank 0 listens on one address, never on every interface (0.0.0.0):
//   - with a secret, the address MASTER_ADDR resolves to on rank 0's host; on
//     a run over several hosts, the first that is not loopback (a hostname may
//     resolve to Debian's 127.0.1.1 on its own host and to another address on
//     the others), and an Error if there is none;
//   - without one (a single-host run: Rendezvous::connect refuses a run over
//     several hosts without a secret), loopback only: MASTER_ADDR's address if
//     it is a loopback one, 127.0.0.1 otherwise, where the other ranks, on the
//     same host, then connect too. Other users of the host can still reach a
//     loopback port; a secret keeps them out.
//
// Note [Joining under load]
// Rank 0's join loop checks its deadline on every pass, whatever poll()
// says. It holds at most kMaxUnauthenticated connections that have not
// passed the handshake, each for at most kHandshakeLimit; a new connection
// past the cap, or an accept() that fails for lack of descriptors (EMFILE,
// ENFILE), drops the oldest of them. With none to drop, it stops accepting
// for a while (10 ms, doubling to 500 ms) instead of spinning on a listener
// that stays readable, and logs that at most once every 5 s. A rank whose
// connection was dropped before it got its challenge connects again.

namespace stepgraph::handshake {
namespace {

using std::chrono::milliseconds;
using wire::Clock;
using wire::Fd;
using wire::Io;
using wire::IoResult;
using wire::quoted;

constexpr std::uint32_t kMagic = 0x53475256;  // "SGRV"
// 1: unauthenticated; 2: the challenge and MACs of Note [Rendezvous authentication].
constexpr std::uint32_t kVersion = 2;
constexpr std::size_t kHelloBytes = 4 + 4 + 4 + 4 + 1 + kNonceBytes;
constexpr std::size_t kChallengeHeadBytes = 4 + 4 + 1 + kNonceBytes;
// A version-1 hello carries the run tag: read it whole, to name its version.
constexpr std::size_t kMaxHelloBytes = 64 + kMaxTagBytes;
constexpr std::size_t kMaxChallengeBytes = 128;
constexpr std::size_t kMaxResponseBytes = 64;
constexpr std::size_t kMaxJoinBytes = 8 + kMaxTagBytes + kMacBytes;
constexpr std::size_t kMaxVerdictBytes = (std::size_t{16} << 20) + kMacBytes;  // an error may list every rank
constexpr std::uint8_t kResponseProof = 1;
constexpr std::uint8_t kResponseRefused = 2;  // rank 0's proof did not check out
constexpr std::size_t kRefusalsNamed = 8;     // in rank 0's error; more are counted
constexpr int kAcceptsPerPass = 64;

std::string nonce_bytes(const Nonce& nonce) {
  return std::string(reinterpret_cast<const char*>(nonce.data()), nonce.size());
}

std::string address_text(const sockaddr_in& address) {
  char text[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &address.sin_addr, text, sizeof(text));
  return std::string(text) + ":" + std::to_string(ntohs(address.sin_port));
}

bool is_loopback(const sockaddr_in& address) { return (ntohl(address.sin_addr.s_addr) >> 24) == 127; }

// The IPv4 addresses `host` resolves to; none (and why in `failure`) when it resolves to none.
std::vector<sockaddr_in> resolve(const std::string& host, int port, std::string* failure) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int status = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  std::vector<sockaddr_in> addresses;
  if (status != 0) {
    *failure = "cannot resolve MASTER_ADDR=" + quoted(host) + ": " + ::gai_strerror(status);
    return addresses;
  }
  for (const addrinfo* at = found; at != nullptr; at = at->ai_next) {
    addresses.push_back(*reinterpret_cast<const sockaddr_in*>(at->ai_addr));
  }
  ::freeaddrinfo(found);
  return addresses;
}

sockaddr_in loopback(int port) {
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<std::uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return address;
}

// Without a secret: MASTER_ADDR's loopback addresses, else 127.0.0.1. See Note [Where rank 0 listens].
std::vector<sockaddr_in> loopback_addresses(const LaunchInfo& info) {
  std::string failure;
  std::vector<sockaddr_in> found = resolve(info.master_addr, info.master_port, &failure);
  std::erase_if(found, [](const sockaddr_in& address) { return !is_loopback(address); });
  if (found.empty()) found.push_back(loopback(info.master_port));
  return found;
}

// See Note [Where rank 0 listens].
sockaddr_in listen_address(const LaunchInfo& info) {
  if (info.secret.empty()) return loopback_addresses(info).front();
  std::string failure;
  const std::vector<sockaddr_in> resolved = resolve(info.master_addr, info.master_port, &failure);
  SG_CHECK_CODE(!resolved.empty(), ErrorCode::kIo, "rank 0 ", failure, "; set MASTER_ADDR to this host's address");
  for (const sockaddr_in& address : resolved) {
    SG_CHECK(address.sin_addr.s_addr != htonl(INADDR_ANY), "MASTER_ADDR=", quoted(info.master_addr),
             " is every interface (0.0.0.0), where rank 0 does not listen; set MASTER_ADDR to the address of rank "
             "0's host that the other ranks reach");
  }
  if (info.world_size == info.local_world_size) return resolved.front();
  for (const sockaddr_in& address : resolved) {
    if (!is_loopback(address)) return address;
  }
  SG_THROW(ErrorCode::kInvalidArgument, "MASTER_ADDR=", quoted(info.master_addr), " resolves to ",
           address_text(resolved.front()),
           " on rank 0's host, a loopback address the other hosts cannot reach; set MASTER_ADDR to an address of "
           "rank 0's host that the other hosts reach (e.g. its IP address)");
}

// The addresses the other ranks try for rank 0.
std::vector<sockaddr_in> rank0_addresses(const LaunchInfo& info, std::string* failure) {
  if (info.secret.empty()) return loopback_addresses(info);
  return resolve(info.master_addr, info.master_port, failure);
}

Fd listen_socket(const LaunchInfo& info) {
  const sockaddr_in address = listen_address(info);
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  SG_CHECK_CODE(fd.get() >= 0, ErrorCode::kIo, "rank 0 cannot open a socket: ", wire::errno_text(errno));
  const int one = 1;
  SG_CHECK_CODE(::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) == 0, ErrorCode::kIo,
                "rank 0 cannot set SO_REUSEADDR: ", wire::errno_text(errno));
  if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0) {
    const int error = errno;
    SG_CHECK_CODE(error != EADDRINUSE, ErrorCode::kIo, "rank 0 cannot listen on ", address_text(address),
                  ": the port is in use (another run, or another program); choose another MASTER_PORT than ",
                  info.master_port);
    SG_CHECK_CODE(error != EADDRNOTAVAIL, ErrorCode::kIo, "rank 0 cannot listen on ", address_text(address),
                  ": MASTER_ADDR=", quoted(info.master_addr), " is no address of this host, where rank 0 runs");
    SG_THROW(ErrorCode::kIo, "rank 0 cannot listen on ", address_text(address), ": ", wire::errno_text(error));
  }
  SG_CHECK_CODE(::listen(fd.get(), SOMAXCONN) == 0, ErrorCode::kIo, "rank 0 cannot listen on ", address_text(address),
                ": ", wire::errno_text(errno));
  logger().debug("rendezvous: rank 0 listens on {}", address_text(address));
  return fd;
}

// ---- the handshake's frames

struct HelloFrame {
  std::uint32_t version = 0;
  int rank = 0;
  int world_size = 0;
  bool has_secret = false;
};

std::string encode_hello(const LaunchInfo& info, const Nonce& nonce) {
  std::string body;
  wire::put_u32(body, kMagic);
  wire::put_u32(body, kVersion);
  wire::put_u32(body, static_cast<std::uint32_t>(info.rank));
  wire::put_u32(body, static_cast<std::uint32_t>(info.world_size));
  wire::put_u8(body, info.secret.empty() ? 0 : 1);
  body += nonce_bytes(nonce);
  return body;
}

// nullopt for bytes that are no StepGraph hello (wrong magic, or too short to tell).
std::optional<HelloFrame> decode_hello(std::string_view body) {
  if (body.size() < 8) return std::nullopt;
  wire::Reader reader(body, "hello");
  if (reader.u32() != kMagic) return std::nullopt;
  HelloFrame hello;
  hello.version = reader.u32();
  // Version 1 has rank and world size in the same place: read to name them.
  if (body.size() >= 16) {
    hello.rank = static_cast<int>(reader.u32());
    hello.world_size = static_cast<int>(reader.u32());
  }
  if (hello.version != kVersion) return hello;  // another build: the rest is not read
  if (body.size() != kHelloBytes) return std::nullopt;
  hello.has_secret = reader.u8() != 0;
  return hello;
}

std::string challenge_head(bool has_secret, const Nonce& nonce) {
  std::string head;
  wire::put_u32(head, kMagic);
  wire::put_u32(head, kVersion);
  wire::put_u8(head, has_secret ? 1 : 0);
  head += nonce_bytes(nonce);
  return head;
}

std::string response(std::uint8_t kind, std::string_view proof) {
  std::string body;
  wire::put_u8(body, kind);
  body += proof;
  return body;
}

// Log lines about connections that are no rank, and about descriptors: at
// most one every 5 s, with a count of those left out, so a flood of bad
// connections cannot flood the log.
class RateLimitedLog {
 public:
  void warn(const std::string& line) {
    const Clock::time_point now = Clock::now();
    if (now < next_) {
      ++suppressed_;
      return;
    }
    if (suppressed_ > 0) {
      logger().warn("rendezvous: {} (and {} similar message(s) in the last 5 s left out)", line, suppressed_);
    } else {
      logger().warn("rendezvous: {}", line);
    }
    suppressed_ = 0;
    next_ = now + std::chrono::seconds(5);
  }

  // Says how many lines were left out since the last one.
  void flush() {
    if (suppressed_ > 0) logger().warn("rendezvous: {} similar message(s) left out", suppressed_);
    suppressed_ = 0;
  }

 private:
  Clock::time_point next_{};
  std::size_t suppressed_ = 0;
};

std::string descriptor_limit_text() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return "";
  return detail::concat(" (this process may open ", limit.rlim_cur, " descriptors: ulimit -n)");
}

// ---- rank 0

// A rank that passed the handshake and said which run it belongs to.
struct Admitted {
  HelloFrame hello;
  std::string run_tag;
  Connection connection;
};

// A connection on its way through the handshake (rank 0's side).
struct Joining {
  enum class Stage { kHello, kResponse, kJoin };
  Fd fd;
  std::string address;  // the peer's address:port
  Clock::time_point since;
  Stage stage = Stage::kHello;
  wire::FrameReader reader{kMaxHelloBytes};
  HelloFrame hello;
  std::string transcript;  // the hello, then the challenge's head
  FrameMac mac;
};

std::string claimed(const Joining& joiner) {
  std::string out = "a process at " + joiner.address;
  if (joiner.stage != Joining::Stage::kHello) out += detail::concat(" claiming rank ", joiner.hello.rank);
  return out;
}

class RankZeroJoin {
 public:
  RankZeroJoin(const LaunchInfo& info, milliseconds timeout)
      : info_(info), timeout_(timeout), listener_(listen_socket(info)), deadline_(Clock::now() + timeout) {}

  // Until as many ranks were admitted as there are other ranks (they may still disagree), or the deadline.
  std::vector<Admitted> run() {
    const std::size_t expected = static_cast<std::size_t>(info_.world_size) - 1;
    while (admitted_.size() < expected) {
      const Clock::time_point now = Clock::now();
      if (now >= deadline_) break;
      drop_stalled(now);
      const bool listening = now >= paused_until_;
      std::vector<pollfd> ready;
      if (listening) ready.push_back({listener_.get(), POLLIN, 0});
      Clock::time_point wake = listening ? deadline_ : std::min(deadline_, paused_until_);
      for (const Joining& joiner : joining_) {
        ready.push_back({joiner.fd.get(), POLLIN, 0});
        wake = std::min(wake, joiner.since + handshake_limit());
      }
      if (wire::poll_until(ready.data(), ready.size(), wake) == 0) continue;
      const std::size_t first_joiner = listening ? 1 : 0;
      // Serve the connections that are ready before accepting new ones (which may drop old ones).
      const std::size_t count = joining_.size();
      for (std::size_t i = 0; i < count; ++i) {
        if (ready[first_joiner + i].revents != 0) serve(joining_[i]);
      }
      std::erase_if(joining_, [](const Joining& joiner) { return joiner.fd.get() < 0; });
      if (listening && ready[0].revents != 0) accept_some();
    }
    log_.flush();
    descriptor_log_.flush();
    return std::move(admitted_);
  }

  // For rank 0's error: the connections refused, and descriptor trouble.
  std::string refusals() const {
    std::string out;
    if (!refused_.empty()) {
      out += "; refused: ";
      for (std::size_t i = 0; i < refused_.size(); ++i) out += (i == 0 ? "" : ", ") + refused_[i];
      if (refused_count_ > refused_.size()) out += detail::concat(" (", refused_count_, " refused in all)");
    }
    if (strangers_ > 0) {
      out +=
          detail::concat("; ", strangers_, " other connection(s) to rank 0 were no rank of this run (no valid hello)");
    }
    if (accept_failures_ > 0) {
      out += detail::concat("; rank 0 ran out of descriptors ", accept_failures_,
                            " time(s) while accepting connections", descriptor_limit_text());
    }
    return out;
  }

 private:
  milliseconds handshake_limit() const { return std::min(timeout_, kHandshakeLimit); }

  // Closes `joiner`; one that claimed a rank is named in rank 0's error, the others are counted.
  void refuse(Joining& joiner, const std::string& why) {
    const std::string line = claimed(joiner) + " " + why;
    if (joiner.stage == Joining::Stage::kHello) {
      ++strangers_;
    } else {
      if (refused_.size() < kRefusalsNamed) refused_.push_back(line);
      ++refused_count_;
    }
    log_.warn(line);
    joiner.fd.reset();
  }

  void drop_stalled(Clock::time_point now) {
    for (Joining& joiner : joining_) {
      if (now - joiner.since >= handshake_limit()) {
        refuse(joiner, detail::concat("did not finish its handshake within ", handshake_limit().count(), " ms"));
      }
    }
    std::erase_if(joining_, [](const Joining& joiner) { return joiner.fd.get() < 0; });
  }

  // Makes room for one more connection: drops the oldest that has not passed
  // the handshake, preferring one that has not even said hello (a rank says it
  // the moment it connects).
  bool drop_oldest() {
    if (joining_.empty()) return false;
    auto victim = std::find_if(joining_.begin(), joining_.end(),
                               [](const Joining& joiner) { return joiner.stage == Joining::Stage::kHello; });
    if (victim == joining_.end()) victim = joining_.begin();
    refuse(*victim, "was dropped: too many connections at once had not finished their handshake");
    joining_.erase(victim);
    return true;
  }

  void accept_some() {
    for (int i = 0; i < kAcceptsPerPass; ++i) {
      if (joining_.size() >= kMaxUnauthenticated) drop_oldest();
      sockaddr_in peer{};
      socklen_t length = sizeof(peer);
      const int accepted =
          ::accept4(listener_.get(), reinterpret_cast<sockaddr*>(&peer), &length, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (accepted >= 0) {
        backoff_ = milliseconds(10);
        wire::set_no_delay(accepted);
        joining_.push_back({Fd(accepted), address_text(peer), Clock::now()});
        serve(joining_.back());  // its hello may be there already
        if (joining_.back().fd.get() < 0) joining_.pop_back();
        continue;
      }
      const int error = errno;
      if (error == EINTR || error == ECONNABORTED) continue;
      if (error == EAGAIN || error == EWOULDBLOCK) return;
      if (error == EMFILE || error == ENFILE || error == ENOBUFS || error == ENOMEM) {
        ++accept_failures_;
        if (drop_oldest()) continue;
        // Nothing of ours to close: wait instead of spinning on a listener that stays readable.
        paused_until_ = Clock::now() + backoff_;
        descriptor_log_.warn(detail::concat("rank 0 cannot accept a connection: ", wire::errno_text(error),
                                            descriptor_limit_text(), "; retrying in ", backoff_.count(), " ms"));
        backoff_ = std::min(backoff_ * 2, milliseconds(500));
        return;
      }
      descriptor_log_.warn("rank 0 cannot accept a connection: " + wire::errno_text(error));
      paused_until_ = Clock::now() + backoff_;
      return;
    }
  }

  // Reads what `joiner` sent and moves it through the handshake; closes it (fd reset) when done or refused.
  void serve(Joining& joiner) {
    while (joiner.fd.get() >= 0) {
      const IoResult result = joiner.reader.step(joiner.fd.get());
      if (result.status == Io::kPending) return;
      if (result.status == Io::kClosed) {
        if (joiner.stage != Joining::Stage::kHello) refuse(joiner, "closed the connection during its handshake");
        joiner.fd.reset();
        return;
      }
      if (result.status == Io::kTooLarge) {
        refuse(joiner, detail::concat("announced a frame of ", joiner.reader.announced(),
                                      " bytes during its handshake, "
                                      "more than ",
                                      joiner.reader.limit()));
        return;
      }
      switch (joiner.stage) {
        case Joining::Stage::kHello: on_hello(joiner); break;
        case Joining::Stage::kResponse: on_response(joiner); break;
        case Joining::Stage::kJoin: on_join(joiner); return;
      }
    }
  }

  void on_hello(Joining& joiner) {
    const std::string body = joiner.reader.take();
    const std::optional<HelloFrame> hello = decode_hello(body);
    if (!hello.has_value()) {
      refuse(joiner, "sent no StepGraph hello (no rank of this run)");
      return;
    }
    joiner.hello = *hello;
    joiner.stage = Joining::Stage::kResponse;  // from here it claims a rank
    const bool mine = !info_.secret.empty();
    const Nonce nonce = make_nonce();
    const std::string head = challenge_head(mine, nonce);
    joiner.transcript = body + head;
    const std::string proof = prove(info_.secret, ProofRole::kRank0, joiner.transcript);
    // Small, on a fresh connection: it fits the socket's buffer, or the peer is no rank of ours.
    const IoResult sent = wire::send_frame(joiner.fd.get(), head + proof, Clock::now());
    if (hello->version != kVersion) {
      refuse(joiner, detail::concat("speaks rendezvous protocol version ", hello->version, ", rank 0 version ",
                                    kVersion, " (another StepGraph build)"));
    } else if (hello->has_secret != mine) {
      refuse(joiner, mine ? "has no rendezvous secret, rank 0 has one" : "has a rendezvous secret, rank 0 has none");
    } else if (sent.status != Io::kDone) {
      refuse(joiner, "did not take rank 0's challenge");
    } else {
      joiner.reader = wire::FrameReader(kMaxResponseBytes);
    }
  }

  void on_response(Joining& joiner) {
    const std::string body = joiner.reader.take();
    if (body.size() == 1 && static_cast<std::uint8_t>(body[0]) == kResponseRefused) {
      refuse(joiner, "could not check rank 0's proof: its rendezvous secret differs from rank 0's");
      return;
    }
    const std::string expected = prove(info_.secret, ProofRole::kPeer, joiner.transcript);
    if (body.size() != 1 + kMacBytes || static_cast<std::uint8_t>(body[0]) != kResponseProof ||
        !proof_matches(std::string_view(body).substr(1), expected)) {
      refuse(joiner, "failed to prove the rendezvous secret (another secret, or no rank of this run)");
      return;
    }
    joiner.mac = FrameMac::for_rank0(info_.secret, joiner.transcript);
    joiner.stage = Joining::Stage::kJoin;
    joiner.reader = wire::FrameReader(kMaxJoinBytes);
  }

  void on_join(Joining& joiner) {
    std::string body;
    if (wire::open_sealed(joiner.mac, joiner.reader, &body).status != Io::kDone) {
      refuse(joiner, "sent a frame with a wrong MAC right after its handshake (altered on the way?)");
      return;
    }
    Admitted admitted{joiner.hello, "", {}};
    try {
      wire::Reader reader(body, "join");
      admitted.run_tag = std::string(reader.take(reader.u32()));
    } catch (const Error& error) {
      refuse(joiner, error.message());
      return;
    }
    admitted.connection = {std::move(joiner.fd), std::move(joiner.mac)};
    admitted_.push_back(std::move(admitted));
  }

  const LaunchInfo& info_;
  milliseconds timeout_;
  Fd listener_;
  Clock::time_point deadline_;
  std::vector<Joining> joining_;
  std::vector<Admitted> admitted_;
  std::vector<std::string> refused_;
  std::size_t refused_count_ = 0;
  std::size_t strangers_ = 0;
  std::size_t accept_failures_ = 0;
  Clock::time_point paused_until_{};
  milliseconds backoff_{10};
  RateLimitedLog log_;             // connections refused
  RateLimitedLog descriptor_log_;  // accept() failing
};

std::string endpoint(const LaunchInfo& info) { return info.master_addr + ":" + std::to_string(info.master_port); }

// "rank 3", "ranks 1, 2, 5".
std::string ranks_text(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) out += (i == 0 ? "" : ", ") + std::to_string(ranks[i]);
  return out;
}

std::string join_parts(const std::vector<std::string>& parts, std::string_view separator) {
  std::string out;
  for (std::size_t i = 0; i < parts.size(); ++i) out += (i == 0 ? "" : std::string(separator)) + parts[i];
  return out;
}

// ---- the other ranks

// A connected socket to `address`, or an empty Fd with the reason in `failure`.
Fd try_connect(const sockaddr_in& address, Clock::time_point deadline, std::string* failure) {
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  SG_CHECK_CODE(fd.get() >= 0, ErrorCode::kIo, "rendezvous: cannot open a socket: ", wire::errno_text(errno));
  int status = ::connect(fd.get(), reinterpret_cast<const sockaddr*>(&address), sizeof(address));
  if (status != 0 && (errno == EINPROGRESS || errno == EINTR)) {
    pollfd ready{fd.get(), POLLOUT, 0};
    if (wire::poll_until(&ready, 1, deadline) == 0) {
      *failure = "connecting timed out";
      return Fd();
    }
    int error = 0;
    socklen_t length = sizeof(error);
    if (::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &error, &length) != 0) error = errno;
    errno = error;
    status = error == 0 ? 0 : -1;
  }
  if (status != 0) {
    *failure = wire::errno_text(errno);
    return Fd();
  }
  // A loopback connection to a port nobody listens on can connect to itself
  // (TCP simultaneous open, when the kernel picks the same port as the
  // source): a rank retrying before rank 0 listens would then talk to itself.
  sockaddr_in self{};
  sockaddr_in peer{};
  socklen_t self_length = sizeof(self);
  socklen_t peer_length = sizeof(peer);
  if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&self), &self_length) == 0 &&
      ::getpeername(fd.get(), reinterpret_cast<sockaddr*>(&peer), &peer_length) == 0 &&
      self.sin_addr.s_addr == peer.sin_addr.s_addr && self.sin_port == peer.sin_port) {
    *failure = "connected to itself (nobody listening yet)";
    return Fd();
  }
  return fd;
}

}  // namespace

std::vector<Connection> accept_ranks(const LaunchInfo& info, std::string_view run_tag, milliseconds timeout,
                                     std::vector<std::string>* late_faults) {
  RankZeroJoin join(info, timeout);
  std::vector<Admitted> admitted = join.run();
  const std::size_t expected = static_cast<std::size_t>(info.world_size) - 1;

  std::vector<std::string> mismatches;
  // Stopped early: as many ranks were admitted as there are other ranks, so the missing ones never will be.
  const bool heard_enough = admitted.size() >= expected;
  std::vector<bool> present(static_cast<std::size_t>(info.world_size), false);  // admitted, and agrees
  std::vector<bool> heard(static_cast<std::size_t>(info.world_size), false);    // admitted
  present[0] = heard[0] = true;
  for (const Admitted& one : admitted) {
    const HelloFrame& hello = one.hello;
    if (hello.rank > 0 && hello.rank < info.world_size) heard[static_cast<std::size_t>(hello.rank)] = true;
    if (hello.world_size != info.world_size) {
      mismatches.push_back(detail::concat("rank ", hello.rank, " has world size ", hello.world_size,
                                          ", rank 0 has world size ", info.world_size));
    } else if (hello.rank <= 0 || hello.rank >= info.world_size) {
      mismatches.push_back(detail::concat("a process says it is rank ", hello.rank, ", outside [1, ", info.world_size,
                                          ") (rank 0 is this one)"));
    } else if (one.run_tag != run_tag) {
      mismatches.push_back(
          detail::concat("rank ", hello.rank, " has run tag ", quoted(one.run_tag), ", rank 0 has ", quoted(run_tag)));
    } else if (present[static_cast<std::size_t>(hello.rank)]) {
      mismatches.push_back(
          detail::concat("rank ", hello.rank, " joined twice (two processes say they are rank ", hello.rank, ")"));
    } else {
      present[static_cast<std::size_t>(hello.rank)] = true;
    }
  }
  std::vector<int> missing;
  for (int rank = 1; rank < info.world_size; ++rank) {
    if (!heard[static_cast<std::size_t>(rank)]) missing.push_back(rank);
  }

  if (!mismatches.empty() || !missing.empty()) {
    std::string message =
        "rendezvous of " + std::to_string(info.world_size) + " ranks at " + endpoint(info) + " failed: ";
    if (!mismatches.empty()) {
      message += join_parts(mismatches, "; ") +
                 "; every rank must be started by the same launch, with the same world size and run tag";
      if (!missing.empty()) message += "; also ";
    }
    if (!missing.empty()) {
      message += heard_enough
                     ? ranks_text(missing) + " did not join (no process says it is " + ranks_text(missing) + ")"
                     : ranks_text(missing) + " did not join within " + std::to_string(timeout.count()) +
                           " ms: is every rank running, with the same MASTER_ADDR, MASTER_PORT, world size and "
                           "rendezvous secret?";
      if (info.launcher == "slurm") message += " (under Slurm, start every rank with srun, not the batch script alone)";
    }
    message += join.refusals();
    const ErrorCode code = mismatches.empty() ? ErrorCode::kIo : ErrorCode::kInvalidArgument;
    const Clock::time_point deadline = wire::error_deadline(timeout);
    for (Admitted& one : admitted) {
      wire::send_error_answer(one.connection.fd.get(), one.connection.mac, 0, code, message, deadline);
    }
    SG_THROW(code, message);
  }

  std::vector<Connection> connections(static_cast<std::size_t>(info.world_size));
  const std::string verdict = wire::ok_answer_head(0);
  const Clock::time_point send_deadline = Clock::now() + timeout;
  for (Admitted& one : admitted) {
    const IoResult sent = wire::send_sealed(one.connection.fd.get(), one.connection.mac, {verdict}, send_deadline);
    if (sent.status != Io::kDone) {
      (*late_faults)[static_cast<std::size_t>(one.hello.rank)] =
          detail::concat(sent.status == Io::kClosed ? wire::closed_text(sent) : "stalled", " right after joining");
    }
    connections[static_cast<std::size_t>(one.hello.rank)] = std::move(one.connection);
  }
  logger().debug("rendezvous: rank 0 of {} at {}: every rank joined", info.world_size, endpoint(info));
  return connections;
}

Connection join_rank0(const LaunchInfo& info, std::string_view run_tag, milliseconds timeout) {
  const Clock::time_point deadline = Clock::now() + timeout;
  const std::string context = detail::concat("rank ", info.rank, "'s rendezvous at ", endpoint(info));
  std::string failure = "no attempt";
  milliseconds pause(10);
  while (true) {
    Fd fd;
    std::string address;
    for (const sockaddr_in& candidate : rank0_addresses(info, &failure)) {
      fd = try_connect(candidate, deadline, &failure);
      if (fd.get() >= 0) {
        address = address_text(candidate);
        break;
      }
    }
    if (fd.get() >= 0) {
      wire::set_no_delay(fd.get());
      // See Note [Peers wait twice as long] in rendezvous.cc.
      const Clock::time_point answer_deadline = Clock::now() + 2 * timeout;
      const Nonce nonce = make_nonce();
      const std::string hello = encode_hello(info, nonce);
      IoResult result = wire::send_frame(fd.get(), hello, answer_deadline);
      // Rank 0 answers a hello at once: its challenge is not worth the long wait of the verdict.
      const Clock::time_point challenge_deadline =
          std::min(answer_deadline, std::max(deadline, Clock::now() + std::min(timeout, milliseconds(1000))));
      wire::FrameReader challenge_reader(kMaxChallengeBytes);
      if (result.status == Io::kDone) result = wire::read_frame(fd.get(), challenge_reader, challenge_deadline);
      SG_CHECK_CODE(result.status != Io::kTimedOut, ErrorCode::kIo, "the process at ", address,
                    " sent no rendezvous challenge to rank ", info.rank, " within ", timeout.count(),
                    " ms: is it rank 0 of this run, or another program listening on MASTER_PORT ", info.master_port,
                    "?");
      SG_CHECK_CODE(result.status != Io::kTooLarge, ErrorCode::kIo, "the process at ", address,
                    " is no StepGraph rank 0 (it announced a challenge of ", challenge_reader.announced(),
                    " bytes); is another program listening on MASTER_PORT ", info.master_port, "?");
      if (result.status == Io::kDone) {
        const std::string challenge = challenge_reader.take();
        if (challenge.size() < 8) {
          SG_THROW(ErrorCode::kIo, "the process at ", address, " is no StepGraph rank 0 (", challenge.size(),
                   " bytes where its challenge should be); is another program listening on MASTER_PORT ",
                   info.master_port, "?");
        }
        wire::Reader reader(challenge, "challenge from rank 0");
        const std::uint32_t magic = reader.u32();
        const std::uint32_t version = reader.u32();
        SG_CHECK_CODE(magic == kMagic, ErrorCode::kIo, "the process at ", address,
                      " is no StepGraph rank 0 (it sent no rendezvous challenge); is another program listening on "
                      "MASTER_PORT ",
                      info.master_port, "?");
        SG_CHECK_CODE(version == kVersion, ErrorCode::kInvalidArgument, "rank 0 at ", address,
                      " speaks rendezvous protocol version ", version, ", rank ", info.rank, " version ", kVersion,
                      " (another StepGraph build); start every rank from the same build");
        SG_CHECK_CODE(challenge.size() == kChallengeHeadBytes + kMacBytes, ErrorCode::kIo, "the process at ", address,
                      " is no StepGraph rank 0 (a challenge of ", challenge.size(), " bytes, not ",
                      kChallengeHeadBytes + kMacBytes, ")");
        const bool theirs = reader.u8() != 0;
        const bool mine = !info.secret.empty();
        SG_CHECK_CODE(theirs || !mine, ErrorCode::kIo, "rank 0 at ", address,
                      " failed to prove the rendezvous secret to rank ", info.rank,
                      ": it says it has none (start every rank with the same secret), or another process listens on "
                      "MASTER_PORT ",
                      info.master_port, " in its place");
        SG_CHECK(mine || !theirs, "rank 0 at ", address, " has a rendezvous secret but rank ", info.rank, " has none; ",
                 how_to_pass_a_secret());
        (void)reader.take(kNonceBytes);
        const std::string transcript = hello + challenge.substr(0, kChallengeHeadBytes);
        const std::string_view proof = std::string_view(challenge).substr(kChallengeHeadBytes);
        if (!proof_matches(proof, prove(info.secret, ProofRole::kRank0, transcript))) {
          // Tell rank 0 (so that its error names this rank), then stop: nothing more from it can be believed.
          (void)wire::send_frame(fd.get(), response(kResponseRefused, ""), Clock::now() + milliseconds(200));
          SG_THROW(ErrorCode::kIo, "rank 0 at ", address, " failed to prove the rendezvous secret to rank ", info.rank,
                   ": rank 0 holds another secret (give every rank the same one), or another process listens on "
                   "MASTER_PORT ",
                   info.master_port, " in its place");
        }
        FrameMac mac = FrameMac::for_peer(info.secret, transcript);
        std::string join;
        wire::put_u32(join, static_cast<std::uint32_t>(run_tag.size()));
        join += run_tag;
        result = wire::send_frame(fd.get(), response(kResponseProof, prove(info.secret, ProofRole::kPeer, transcript)),
                                  answer_deadline);
        if (result.status == Io::kDone) result = wire::send_sealed(fd.get(), mac, {join}, answer_deadline);
        wire::FrameReader verdict_reader(kMaxVerdictBytes);
        std::string verdict;
        if (result.status == Io::kDone) {
          result = wire::read_sealed(fd.get(), mac, verdict_reader, answer_deadline, &verdict);
        }
        SG_CHECK_CODE(result.status != Io::kClosed, ErrorCode::kIo, "rank 0 ", wire::closed_text(result),
                      " before confirming ", context, "; its log says why");
        SG_CHECK_CODE(result.status != Io::kTimedOut, ErrorCode::kIo, "rank 0 did not confirm ", context, " within ",
                      2 * timeout.count(), " ms");
        SG_CHECK_CODE(result.status != Io::kBadMac, ErrorCode::kIo, "the answer from rank 0 to ", context,
                      " has a wrong MAC: it was altered on the way, or is not from rank 0");
        SG_CHECK_CODE(result.status == Io::kDone, ErrorCode::kIo, "malformed answer from rank 0 to ", context);
        const wire::Answer answer = wire::decode_answer(std::move(verdict), 0, context);
        SG_CHECK_CODE(answer.status == wire::kAnswerOk, answer.code, answer.payload, " (reported to rank ", info.rank,
                      " by rank 0)");
        return {std::move(fd), std::move(mac)};
      }
      // Closed before its challenge: rank 0 dropped this connection under load, or was not ready. Again.
      failure = "the connection closed before rank 0's challenge";
    }
    const Clock::time_point now = Clock::now();
    SG_CHECK_CODE(now < deadline, ErrorCode::kIo, "rank ", info.rank, " of ", info.world_size,
                  " could not reach rank 0 at ", endpoint(info), " within ", timeout.count(),
                  " ms (last attempt: ", failure,
                  "); is rank 0 running, with the same MASTER_ADDR and MASTER_PORT as this rank?");
    std::this_thread::sleep_for(std::min(pause, std::chrono::duration_cast<milliseconds>(deadline - now)));
    pause = std::min(pause * 2, milliseconds(250));
  }
}

}  // namespace stepgraph::handshake

#include "engine/launch/rendezvous.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <initializer_list>
#include <map>
#include <optional>
#include <system_error>
#include <thread>
#include <utility>

#include "engine/logging.h"

// Note [Rendezvous protocol]
// A star through rank 0. Every message is a frame: an 8-byte little-endian
// length, then that many bytes.
//   hello   (rank r -> 0, once): magic "SGRV", version, rank, world size, run tag.
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
// Rank 0 listens on the address MASTER_ADDR resolves to when the run is on
// one host (so a single-host run never listens beyond it), and on every
// interface when it spans several: a hostname may resolve to a loopback
// address on its own host (Debian's 127.0.1.1) and to another on the others.
//
// A connection on loopback to a port nobody listens on can connect to itself
// (TCP simultaneous open, when the kernel picks the same port as the source):
// a rank retrying before rank 0 listens would then talk to itself. Such a
// connection is closed and tried again.

// Note [Peers wait twice as long]
// Rank 0 waits `timeout` for the other ranks; they wait twice that for rank
// 0's answer. When a rank is slow, rank 0 sees it first and its error answer,
// which names the slow rank, reaches the others before they give up on rank 0
// (which would name rank 0, an innocent bystander). Rank 0 itself being late
// by more than `timeout` is named by the others.

namespace stepgraph {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr std::uint32_t kMagic = 0x53475256;  // "SGRV"
constexpr std::uint32_t kVersion = 1;
constexpr std::size_t kLengthBytes = 8;
constexpr std::size_t kMaxTagBytes = 4096;
constexpr std::size_t kMaxWhatBytes = 4096;
constexpr std::size_t kMaxHelloBytes = 64 + kMaxTagBytes;
constexpr std::size_t kMaxVerdictBytes = std::size_t{16} << 20;  // an error may list every rank
constexpr std::size_t kMaxRequestBytes = 64 + kMaxWhatBytes + Rendezvous::kMaxBlobBytes;
constexpr std::uint8_t kAnswerOk = 0;
constexpr std::uint8_t kAnswerError = 1;

std::string errno_text(int error) { return std::error_code(error, std::generic_category()).message(); }

// Text from the caller or the wire, fit for a message: quoted, escaped, and cut short.
std::string quoted(std::string_view text) {
  constexpr std::size_t kShown = 120;
  std::string out = "'";
  for (const char c : text.substr(0, kShown)) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte >= 0x20 && byte < 0x7f && c != '\'' && c != '\\') {
      out += c;
    } else {
      constexpr char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[byte >> 4];
      out += kHex[byte & 0xf];
    }
  }
  out += text.size() > kShown ? "'..." : "'";
  return out;
}

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

// ---- encoding

void put_u8(std::string& out, std::uint8_t value) { out.push_back(static_cast<char>(value)); }

void put_u32(std::string& out, std::uint32_t value) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xff));
}

void put_u64(std::string& out, std::uint64_t value) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xff));
}

std::uint64_t get_u64(const unsigned char* bytes) {
  std::uint64_t value = 0;
  for (int i = 0; i < 8; ++i) value |= std::uint64_t{bytes[i]} << (8 * i);
  return value;
}

std::string length_prefix(std::uint64_t length) {
  std::string out;
  put_u64(out, length);
  return out;
}

// Reads a frame's fields; a frame that ends early is an Error (kIo) naming `context`.
class Reader {
 public:
  Reader(std::string_view bytes, std::string context) : bytes_(bytes), context_(std::move(context)) {}

  std::uint8_t u8() { return static_cast<std::uint8_t>(take(1)[0]); }
  std::uint32_t u32() {
    const std::string_view b = take(4);
    std::uint32_t value = 0;
    for (int i = 0; i < 4; ++i) value |= std::uint32_t{static_cast<unsigned char>(b[i])} << (8 * i);
    return value;
  }
  std::uint64_t u64() { return get_u64(reinterpret_cast<const unsigned char*>(take(8).data())); }
  std::string_view take(std::uint64_t count) {
    SG_CHECK_CODE(count <= bytes_.size() - at_, ErrorCode::kIo, "malformed ", context_, ": ", bytes_.size(),
                  " bytes end early (a different StepGraph build on another rank?)");
    const std::string_view out = bytes_.substr(at_, count);
    at_ += count;
    return out;
  }
  std::string_view rest() { return take(bytes_.size() - at_); }

 private:
  std::string_view bytes_;
  std::size_t at_ = 0;
  std::string context_;
};

// ---- sockets

// Owns one file descriptor; closing never throws.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  ~Fd() { reset(); }

  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

void set_no_delay(int fd) {
  const int one = 1;
  // Latency only: small frames go out at once. Failing to set it is harmless.
  (void)::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

int poll_timeout_ms(Clock::time_point deadline) {
  const auto left = std::chrono::ceil<milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<std::int64_t>(left, 0, 1 << 30));
}

// poll() until something happens or `deadline`; returns the number of ready descriptors (0: the deadline passed).
int poll_until(pollfd* fds, std::size_t count, Clock::time_point deadline) {
  while (true) {
    const int ready = ::poll(fds, static_cast<nfds_t>(count), poll_timeout_ms(deadline));
    if (ready >= 0) return ready;
    SG_CHECK_CODE(errno == EINTR, ErrorCode::kIo, "rendezvous: poll failed: ", errno_text(errno));
  }
}

enum class Io {
  kDone,           // the frame was read or sent in full
  kPending,        // (reads) the socket has no more bytes now
  kClosed,         // the other end closed or reset the connection
  kTimedOut,       // the deadline passed
  kTooLarge,       // (reads) the frame announces more bytes than allowed
  kAnswerArrived,  // (sends that watch for input) the other end answered before taking it all
};

struct IoResult {
  Io status = Io::kDone;
  int error = 0;  // errno for kClosed by an error, 0 for an orderly close
};

// "rank 3 " + closed_text(...): the connection ended, as the reader or writer saw it.
std::string closed_text(const IoResult& result) {
  return result.error == 0 ? std::string("closed the connection (exited or crashed?)")
                           : "dropped the connection (" + errno_text(result.error) + "; exited or crashed?)";
}

// Reads one frame from a non-blocking socket, a piece at a time.
class FrameReader {
 public:
  explicit FrameReader(std::uint64_t limit) : limit_(limit) {}

  // Reads what the socket holds now, never past the end of the frame.
  IoResult step(int fd) {
    while (true) {
      char* into = nullptr;
      std::size_t want = 0;
      if (header_got_ < kLengthBytes) {
        into = reinterpret_cast<char*>(header_) + header_got_;
        want = kLengthBytes - header_got_;
      } else if (body_got_ < body_.size()) {
        into = body_.data() + body_got_;
        want = body_.size() - body_got_;
      } else {
        return {Io::kDone};
      }
      const ssize_t got = ::recv(fd, into, want, 0);
      if (got == 0) return {Io::kClosed, 0};
      if (got < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return {Io::kPending};
        return {Io::kClosed, errno};
      }
      if (header_got_ < kLengthBytes) {
        header_got_ += static_cast<std::size_t>(got);
        if (header_got_ == kLengthBytes) {
          announced_ = get_u64(header_);
          if (announced_ > limit_) return {Io::kTooLarge};
          body_.resize(announced_);
        }
      } else {
        body_got_ += static_cast<std::size_t>(got);
      }
    }
  }

  std::uint64_t announced() const { return announced_; }
  std::uint64_t limit() const { return limit_; }
  std::string take() { return std::move(body_); }

 private:
  std::uint64_t limit_;
  unsigned char header_[kLengthBytes] = {};
  std::size_t header_got_ = 0;
  std::uint64_t announced_ = 0;
  std::string body_;
  std::size_t body_got_ = 0;
};

IoResult read_frame(int fd, FrameReader& reader, Clock::time_point deadline) {
  while (true) {
    const IoResult result = reader.step(fd);
    if (result.status != Io::kPending) return result;
    pollfd ready{fd, POLLIN, 0};
    if (poll_until(&ready, 1, deadline) == 0) return {Io::kTimedOut};
  }
}

enum class WhileSending { kIgnoreInput, kStopOnInput };

// Sends `parts` back to back on a non-blocking socket (without SIGPIPE).
IoResult send_parts(int fd, std::initializer_list<std::string_view> parts, Clock::time_point deadline,
                    WhileSending input = WhileSending::kIgnoreInput) {
  for (const std::string_view part : parts) {
    std::size_t sent = 0;
    while (sent < part.size()) {
      const ssize_t n = ::send(fd, part.data() + sent, part.size() - sent, MSG_NOSIGNAL);
      if (n > 0) {
        sent += static_cast<std::size_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return {Io::kClosed, errno};
      const short events = POLLOUT | (input == WhileSending::kStopOnInput ? POLLIN : 0);
      pollfd ready{fd, events, 0};
      if (poll_until(&ready, 1, deadline) == 0) return {Io::kTimedOut};
      if (input == WhileSending::kStopOnInput && (ready.revents & (POLLIN | POLLHUP)) != 0) return {Io::kAnswerArrived};
    }
  }
  return {Io::kDone};
}

IoResult send_frame(int fd, std::string_view body, Clock::time_point deadline) {
  return send_parts(fd, {length_prefix(body.size()), body}, deadline);
}

std::string error_answer(std::uint64_t sequence, ErrorCode code, std::string_view message) {
  std::string body;
  put_u8(body, kAnswerError);
  put_u64(body, sequence);
  put_u32(body, static_cast<std::uint32_t>(code));
  body += message;
  return body;
}

std::string ok_answer_head(std::uint64_t sequence) {
  std::string head;
  put_u8(head, kAnswerOk);
  put_u64(head, sequence);
  return head;
}

// Best effort: the rank may be gone already, or too busy to take it in time.
void send_error_answer(int fd, std::uint64_t sequence, ErrorCode code, std::string_view message,
                       Clock::time_point deadline) {
  (void)send_frame(fd, error_answer(sequence, code, message), deadline);
}

// How long rank 0 tries to tell the others about a failure, all of them together.
Clock::time_point error_deadline(milliseconds timeout) { return Clock::now() + std::min(timeout, milliseconds(1000)); }

// An answer's payload, or the error rank 0 sent, raised here. `context` names the exchange.
struct Answer {
  std::uint8_t status = kAnswerOk;
  ErrorCode code = ErrorCode::kInternal;
  std::string payload;  // ok: the payload; error: the message
};

Answer decode_answer(std::string body, std::uint64_t sequence, const std::string& context) {
  Reader reader(body, "answer from rank 0 to " + context);
  Answer answer;
  answer.status = reader.u8();
  const std::uint64_t got = reader.u64();
  if (answer.status == kAnswerError) {
    answer.code = static_cast<ErrorCode>(reader.u32());
    answer.payload = std::string(reader.rest());
    return answer;
  }
  SG_CHECK_CODE(answer.status == kAnswerOk && got == sequence, ErrorCode::kIo, "malformed answer from rank 0 to ",
                context, ": status ", int{answer.status}, ", exchange ", got, " instead of ", sequence);
  body.erase(0, 9);  // status and sequence
  answer.payload = std::move(body);
  return answer;
}

const char* exchange_name(std::uint8_t kind) {
  switch (kind) {
    case 1: return "all_gather";
    case 2: return "broadcast";
    case 3: return "barrier";
  }
  return "an unknown exchange";
}

// ---- joining

struct Hello {
  std::uint32_t version = 0;
  int rank = 0;
  int world_size = 0;
  std::string run_tag;
  Fd fd;
};

std::string encode_hello(int rank, int world_size, std::string_view run_tag) {
  std::string body;
  put_u32(body, kMagic);
  put_u32(body, kVersion);
  put_u32(body, static_cast<std::uint32_t>(rank));
  put_u32(body, static_cast<std::uint32_t>(world_size));
  put_u32(body, static_cast<std::uint32_t>(run_tag.size()));
  body += run_tag;
  return body;
}

// nullopt for a connection that is not a StepGraph rank (wrong magic).
std::optional<Hello> decode_hello(std::string_view body) {
  Reader reader(body, "hello");
  if (body.size() < 4 || reader.u32() != kMagic) return std::nullopt;
  Hello hello;
  hello.version = reader.u32();
  hello.rank = static_cast<int>(reader.u32());
  hello.world_size = static_cast<int>(reader.u32());
  hello.run_tag = std::string(reader.take(reader.u32()));
  return hello;
}

std::string endpoint(const LaunchInfo& info) { return info.master_addr + ":" + std::to_string(info.master_port); }

// The IPv4 addresses `host` resolves to; an Error (kIo) naming `host` when it resolves to none.
std::vector<sockaddr_in> resolve(const std::string& host, int port, std::string* failure) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int status = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  std::vector<sockaddr_in> addresses;
  if (status != 0) {
    *failure = "cannot resolve " + quoted(host) + ": " + ::gai_strerror(status);
    return addresses;
  }
  for (const addrinfo* at = found; at != nullptr; at = at->ai_next) {
    addresses.push_back(*reinterpret_cast<const sockaddr_in*>(at->ai_addr));
  }
  ::freeaddrinfo(found);
  return addresses;
}

std::string address_text(const sockaddr_in& address) {
  char text[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &address.sin_addr, text, sizeof(text));
  return std::string(text) + ":" + std::to_string(ntohs(address.sin_port));
}

// See Note [Rendezvous protocol] for where rank 0 listens.
Fd listen_socket(const LaunchInfo& info) {
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<std::uint16_t>(info.master_port));
  address.sin_addr.s_addr = htonl(INADDR_ANY);
  if (info.world_size == info.local_world_size) {
    std::string failure;
    const std::vector<sockaddr_in> resolved = resolve(info.master_addr, info.master_port, &failure);
    SG_CHECK_CODE(!resolved.empty(), ErrorCode::kIo, "rank 0 ", failure, "; set MASTER_ADDR to this host's address");
    address = resolved.front();
  }
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  SG_CHECK_CODE(fd.get() >= 0, ErrorCode::kIo, "rank 0 cannot open a socket: ", errno_text(errno));
  const int one = 1;
  SG_CHECK_CODE(::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) == 0, ErrorCode::kIo,
                "rank 0 cannot set SO_REUSEADDR: ", errno_text(errno));
  if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0) {
    const int error = errno;
    SG_CHECK_CODE(error != EADDRINUSE, ErrorCode::kIo, "rank 0 cannot listen on ", address_text(address),
                  ": the port is in use (another run, or another program); choose another MASTER_PORT than ",
                  info.master_port);
    SG_CHECK_CODE(error != EADDRNOTAVAIL, ErrorCode::kIo, "rank 0 cannot listen on ", address_text(address),
                  ": MASTER_ADDR=", quoted(info.master_addr), " is no address of this host, where rank 0 runs");
    SG_THROW(ErrorCode::kIo, "rank 0 cannot listen on ", address_text(address), ": ", errno_text(error));
  }
  SG_CHECK_CODE(::listen(fd.get(), SOMAXCONN) == 0, ErrorCode::kIo, "rank 0 cannot listen on ", address_text(address),
                ": ", errno_text(errno));
  return fd;
}

// Rank 0: accepts a hello from every other rank and answers each with the verdict.
// Returns the connection to each rank by rank ([0] unused) and the ranks the OK verdict did not reach.
std::vector<Fd> accept_ranks(const LaunchInfo& info, std::string_view run_tag, milliseconds timeout,
                             std::vector<std::string>* late_faults) {
  const Fd listener = listen_socket(info);
  const Clock::time_point deadline = Clock::now() + timeout;
  const std::size_t expected = static_cast<std::size_t>(info.world_size) - 1;

  struct Joining {
    Fd fd;
    FrameReader reader{kMaxHelloBytes};
  };
  std::vector<Joining> joining;
  std::vector<Hello> hellos;
  // Until as many processes said hello as there are other ranks (they may
  // still disagree: see the checks below), or the deadline.
  while (hellos.size() < expected) {
    std::vector<pollfd> ready{{listener.get(), POLLIN, 0}};
    for (const Joining& joiner : joining) ready.push_back({joiner.fd.get(), POLLIN, 0});
    if (poll_until(ready.data(), ready.size(), deadline) == 0) break;
    while (true) {
      const int accepted = ::accept4(listener.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (accepted >= 0) {
        set_no_delay(accepted);
        joining.push_back({Fd(accepted)});
        continue;
      }
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) logger().warn("rendezvous: accept failed: {}", errno_text(errno));
      break;
    }
    for (Joining& joiner : joining) {
      const IoResult result = joiner.reader.step(joiner.fd.get());
      if (result.status == Io::kPending) continue;
      if (result.status == Io::kDone) {
        std::optional<Hello> hello;
        try {
          hello = decode_hello(joiner.reader.take());
        } catch (const Error& error) {
          logger().warn("rendezvous: dropping a connection with a malformed hello: {}", error.message());
        }
        if (hello.has_value()) {
          hello->fd = std::move(joiner.fd);
          hellos.push_back(std::move(*hello));
        } else {
          logger().warn("rendezvous: dropping a connection to {} that is no StepGraph rank", endpoint(info));
        }
      }
      joiner.fd.reset();  // done (moved into a hello), closed, or not one of ours
    }
    std::erase_if(joining, [](const Joining& joiner) { return joiner.fd.get() < 0; });
  }

  std::vector<std::string> mismatches;
  // Stopped early: as many processes said hello as there are other ranks, so the missing ones never will.
  const bool heard_enough = hellos.size() >= expected;
  std::vector<bool> present(static_cast<std::size_t>(info.world_size), false);  // said hello, and agrees
  std::vector<bool> heard(static_cast<std::size_t>(info.world_size), false);    // said hello
  present[0] = heard[0] = true;
  for (const Hello& hello : hellos) {
    if (hello.rank > 0 && hello.rank < info.world_size) heard[static_cast<std::size_t>(hello.rank)] = true;
    if (hello.version != kVersion) {
      mismatches.push_back(detail::concat("rank ", hello.rank, " speaks rendezvous protocol version ", hello.version,
                                          ", rank 0 version ", kVersion, " (another StepGraph build)"));
    } else if (hello.world_size != info.world_size) {
      mismatches.push_back(detail::concat("rank ", hello.rank, " has world size ", hello.world_size,
                                          ", rank 0 has world size ", info.world_size));
    } else if (hello.rank <= 0 || hello.rank >= info.world_size) {
      mismatches.push_back(detail::concat("a process says it is rank ", hello.rank, ", outside [1, ", info.world_size,
                                          ") (rank 0 is this one)"));
    } else if (hello.run_tag != run_tag) {
      mismatches.push_back(detail::concat("rank ", hello.rank, " has run tag ", quoted(hello.run_tag), ", rank 0 has ",
                                          quoted(run_tag)));
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
      message += join(mismatches, "; ") +
                 "; every rank must be started by the same launch, with the same world size and run tag";
      if (!missing.empty()) message += "; also ";
    }
    if (!missing.empty()) {
      message += heard_enough
                     ? ranks_text(missing) + " did not join (no process says it is " + ranks_text(missing) + ")"
                     : ranks_text(missing) + " did not join within " + std::to_string(timeout.count()) +
                           " ms: is every rank running, with the same MASTER_ADDR, MASTER_PORT and world size?";
      if (info.launcher == "slurm") message += " (under Slurm, start every rank with srun, not the batch script alone)";
    }
    const ErrorCode code = mismatches.empty() ? ErrorCode::kIo : ErrorCode::kInvalidArgument;
    const Clock::time_point deadline = error_deadline(timeout);
    for (const Hello& hello : hellos) send_error_answer(hello.fd.get(), 0, code, message, deadline);
    SG_THROW(code, message);
  }

  std::vector<Fd> sockets(static_cast<std::size_t>(info.world_size));
  const std::string verdict = ok_answer_head(0);
  const Clock::time_point send_deadline = Clock::now() + timeout;
  for (Hello& hello : hellos) {
    const IoResult sent = send_frame(hello.fd.get(), verdict, send_deadline);
    if (sent.status != Io::kDone) {
      (*late_faults)[static_cast<std::size_t>(hello.rank)] =
          detail::concat(sent.status == Io::kClosed ? closed_text(sent) : "stalled", " right after joining");
    }
    sockets[static_cast<std::size_t>(hello.rank)] = std::move(hello.fd);
  }
  logger().debug("rendezvous: rank 0 of {} listening at {}: every rank joined", info.world_size, endpoint(info));
  return sockets;
}

// A connected socket to `address`, or an empty Fd with the reason in `failure`.
Fd try_connect(const sockaddr_in& address, Clock::time_point deadline, std::string* failure) {
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  SG_CHECK_CODE(fd.get() >= 0, ErrorCode::kIo, "rendezvous: cannot open a socket: ", errno_text(errno));
  int status = ::connect(fd.get(), reinterpret_cast<const sockaddr*>(&address), sizeof(address));
  if (status != 0 && (errno == EINPROGRESS || errno == EINTR)) {
    pollfd ready{fd.get(), POLLOUT, 0};
    if (poll_until(&ready, 1, deadline) == 0) {
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
    *failure = errno_text(errno);
    return Fd();
  }
  // See Note [Rendezvous protocol]: a loopback connection to itself.
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

// Every rank but 0: connects to rank 0 (retrying until the deadline), says hello and waits for the verdict.
Fd join_rank0(const LaunchInfo& info, std::string_view run_tag, milliseconds timeout) {
  const Clock::time_point deadline = Clock::now() + timeout;
  std::string failure = "no attempt";
  milliseconds pause(10);
  Fd fd;
  while (fd.get() < 0) {
    for (const sockaddr_in& address : resolve(info.master_addr, info.master_port, &failure)) {
      fd = try_connect(address, deadline, &failure);
      if (fd.get() >= 0) break;
    }
    if (fd.get() >= 0) break;
    const Clock::time_point now = Clock::now();
    SG_CHECK_CODE(now < deadline, ErrorCode::kIo, "rank ", info.rank, " of ", info.world_size,
                  " could not reach rank 0 at ", endpoint(info), " within ", timeout.count(),
                  " ms (last attempt: ", failure,
                  "); is rank 0 running, with the same MASTER_ADDR and MASTER_PORT as this rank?");
    std::this_thread::sleep_for(std::min(pause, std::chrono::duration_cast<milliseconds>(deadline - now)));
    pause = std::min(pause * 2, milliseconds(250));
  }
  set_no_delay(fd.get());

  const std::string context = detail::concat("rank ", info.rank, "'s rendezvous at ", endpoint(info));
  // See Note [Peers wait twice as long].
  const Clock::time_point answer_deadline = Clock::now() + 2 * timeout;
  IoResult result = send_frame(fd.get(), encode_hello(info.rank, info.world_size, run_tag), answer_deadline);
  FrameReader reader(kMaxVerdictBytes);
  if (result.status == Io::kDone) result = read_frame(fd.get(), reader, answer_deadline);
  SG_CHECK_CODE(result.status != Io::kClosed, ErrorCode::kIo, "rank 0 ", closed_text(result), " before confirming ",
                context, "; its log says why");
  SG_CHECK_CODE(result.status != Io::kTimedOut, ErrorCode::kIo, "rank 0 did not confirm ", context, " within ",
                2 * timeout.count(), " ms");
  SG_CHECK_CODE(result.status == Io::kDone, ErrorCode::kIo, "malformed answer from rank 0 to ", context);
  const Answer answer = decode_answer(reader.take(), 0, context);
  SG_CHECK_CODE(answer.status == kAnswerOk, answer.code, answer.payload, " (reported to rank ", info.rank,
                " by rank 0)");
  return fd;
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
  SG_CHECK(run_tag.size() <= kMaxTagBytes, "rendezvous: the run tag has ", run_tag.size(), " bytes, more than ",
           kMaxTagBytes, "; pass a hash of the configuration");
  if (info.world_size == 1) return std::unique_ptr<Rendezvous>(new Rendezvous(0, 1, timeout, {}));

  std::vector<int> sockets;
  std::vector<std::string> late_faults(static_cast<std::size_t>(info.world_size));
  if (info.rank == 0) {
    for (Fd& fd : accept_ranks(info, run_tag, timeout, &late_faults)) sockets.push_back(fd.release());
  } else {
    sockets.push_back(join_rank0(info, run_tag, timeout).release());
  }
  std::unique_ptr<Rendezvous> rendezvous(new Rendezvous(info.rank, info.world_size, timeout, std::move(sockets)));
  rendezvous->late_faults_ = std::move(late_faults);
  return rendezvous;
}

Rendezvous::Rendezvous(int rank, int world_size, milliseconds timeout, std::vector<int> sockets)
    : rank_(rank), world_size_(world_size), timeout_(timeout), sockets_(std::move(sockets)) {}

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
  Reader reader(payload, "answer to " + context);
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

  std::vector<FrameReader> readers(world, FrameReader(kMaxRequestBytes));
  std::vector<std::string> requests(world);
  std::vector<int> pending;
  for (int rank = 1; rank < world_size_; ++rank) pending.push_back(rank);
  const Clock::time_point deadline = Clock::now() + timeout_;
  while (faults.empty() && !pending.empty()) {
    std::vector<pollfd> ready;
    for (const int rank : pending) ready.push_back({sockets_[static_cast<std::size_t>(rank)], POLLIN, 0});
    if (poll_until(ready.data(), ready.size(), deadline) == 0) {
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
      FrameReader& reader = readers[static_cast<std::size_t>(rank)];
      const IoResult result = reader.step(sockets_[static_cast<std::size_t>(rank)]);
      switch (result.status) {
        case Io::kDone: requests[static_cast<std::size_t>(rank)] = reader.take(); break;
        case Io::kPending: still.push_back(rank); break;
        case Io::kClosed:
          faults[closed_text(result)].push_back(rank);
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
        Reader reader(request, detail::concat("request from rank ", rank, " to ", name));
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
    const Clock::time_point error_by = error_deadline(timeout_);
    for (std::size_t rank = 1; rank < world; ++rank) {
      if (!gone[rank]) send_error_answer(sockets_[rank], sequence_, code, message, error_by);
    }
    fail(code, message);
  }

  std::string payload;
  switch (kind) {
    case Exchange::kAllGather: {
      std::size_t bytes = 4;
      for (const std::string_view blob : blobs) bytes += 8 + blob.size();
      payload.reserve(bytes);
      put_u32(payload, static_cast<std::uint32_t>(world));
      for (const std::string_view blob : blobs) {
        put_u64(payload, blob.size());
        payload += blob;
      }
      break;
    }
    case Exchange::kBroadcast: payload = std::string(local); break;
    case Exchange::kBarrier: break;
  }
  const std::string head = ok_answer_head(sequence_);
  const std::string prefix = length_prefix(head.size() + payload.size());
  const Clock::time_point send_deadline = Clock::now() + timeout_;
  for (int rank = 1; rank < world_size_; ++rank) {
    const IoResult sent = send_parts(sockets_[static_cast<std::size_t>(rank)], {prefix, head, payload}, send_deadline);
    // The others have their answer; the next exchange reports this rank to everyone.
    if (sent.status != Io::kDone) {
      late_faults_[static_cast<std::size_t>(rank)] = detail::concat(
          sent.status == Io::kClosed ? closed_text(sent) : "did not take its answer in time", " after ", name);
    }
  }
  return payload;
}

std::string Rendezvous::exchange_as_peer(Exchange kind, std::string_view local, std::string_view what) {
  const std::string name =
      detail::concat(exchange_name(static_cast<std::uint8_t>(kind)), " ", quoted(what), " (exchange ", sequence_, ")");
  const int fd = sockets_[0];
  std::string head;
  put_u8(head, static_cast<std::uint8_t>(kind));
  put_u64(head, sequence_);
  put_u32(head, static_cast<std::uint32_t>(what.size()));
  head += what;
  // See Note [Peers wait twice as long].
  const milliseconds patience = 2 * timeout_;
  const Clock::time_point deadline = Clock::now() + patience;
  IoResult result =
      send_parts(fd, {length_prefix(head.size() + local.size()), head, local}, deadline, WhileSending::kStopOnInput);
  const std::uint64_t limit = 64 + static_cast<std::uint64_t>(world_size_) * (8 + kMaxBlobBytes);
  FrameReader reader(limit);
  if (result.status == Io::kDone || result.status == Io::kAnswerArrived) {
    result = read_frame(fd, reader, deadline);
  } else if (result.status == Io::kClosed) {
    // Rank 0 may have answered (with the reason) before it went: read what arrived.
    const IoResult answered = read_frame(fd, reader, Clock::now());
    if (answered.status == Io::kDone) result = answered;
  }
  switch (result.status) {
    case Io::kDone: break;
    case Io::kClosed:
      fail(ErrorCode::kIo, detail::concat(name, " failed on rank ", rank_, ": rank 0 ", closed_text(result)));
    case Io::kTimedOut:
      fail(ErrorCode::kIo,
           detail::concat(name, " failed on rank ", rank_, ": rank 0 did not answer within ", patience.count(), " ms"));
    default:
      fail(ErrorCode::kIo, detail::concat(name, " failed on rank ", rank_, ": rank 0 sent a frame of ",
                                          reader.announced(), " bytes, more than ", limit));
  }
  Answer answer;
  try {
    answer = decode_answer(reader.take(), sequence_, detail::concat(name, " on rank ", rank_));
  } catch (const Error& error) {
    fail(error.code(), error.message());
  }
  if (answer.status != kAnswerOk) {
    fail(answer.code, detail::concat(answer.payload, " (reported to rank ", rank_, " by rank 0)"));
  }
  return std::move(answer.payload);
}

}  // namespace stepgraph

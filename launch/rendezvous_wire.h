// The rendezvous's wire: frames on non-blocking TCP sockets, the encoding of
// their fields, the answers rank 0 sends, and wire text made fit to print.
// Internal to launch/ (rendezvous.cc and rendezvous_handshake.cc); see
// Note [Rendezvous protocol] in rendezvous.cc.
//
// A frame is an 8-byte little-endian length, then that many bytes. After a
// connection's handshake each frame's bytes end in a MAC (rendezvous_auth.h):
// send_sealed adds it, read_sealed checks and strips it.
#pragma once

#include <poll.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>

#include "engine/error.h"
#include "engine/printable_text.h"
#include "launch/rendezvous_auth.h"

namespace stepgraph::wire {

using Clock = std::chrono::steady_clock;

inline constexpr std::size_t kLengthBytes = 8;
inline constexpr std::uint8_t kAnswerOk = 0;
inline constexpr std::uint8_t kAnswerError = 1;

std::string errno_text(int error);

// Text from the caller or the wire, fit for a message (engine/printable_text.h).
using ::stepgraph::escaped;
using ::stepgraph::quoted;

// ---- encoding (little-endian)

void put_u8(std::string& out, std::uint8_t value);
void put_u32(std::string& out, std::uint32_t value);
void put_u64(std::string& out, std::uint64_t value);
std::string length_prefix(std::uint64_t length);

// Reads a frame's fields; a frame that ends early is an Error (kIo) naming `context`.
class Reader {
 public:
  Reader(std::string_view bytes, std::string context) : bytes_(bytes), context_(std::move(context)) {}

  std::uint8_t u8();
  std::uint32_t u32();
  std::uint64_t u64();
  std::string_view take(std::uint64_t count);
  std::string_view rest() { return take(bytes_.size() - at_); }
  std::size_t left() const { return bytes_.size() - at_; }

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

void set_no_delay(int fd);

// poll() until something happens or `deadline`; returns the number of ready descriptors (0: the deadline passed).
int poll_until(pollfd* fds, std::size_t count, Clock::time_point deadline);

enum class Io {
  kDone,           // the frame was read or sent in full
  kPending,        // (reads) the socket has no more bytes now
  kClosed,         // the other end closed or reset the connection
  kTimedOut,       // the deadline passed
  kTooLarge,       // (reads) the frame announces more bytes than allowed
  kAnswerArrived,  // (sends that watch for input) the other end answered before taking it all
  kBadMac,         // (sealed reads) the frame's MAC is wrong: not from the authenticated peer, or altered
};

struct IoResult {
  Io status = Io::kDone;
  int error = 0;  // errno for kClosed by an error, 0 for an orderly close
};

// "rank 3 " + closed_text(...): the connection ended, as the reader or writer saw it.
std::string closed_text(const IoResult& result);

// Reads one frame from a non-blocking socket, a piece at a time. Its buffer
// grows with the bytes that arrive, never to what a peer merely announces.
class FrameReader {
 public:
  explicit FrameReader(std::uint64_t limit) : limit_(limit) {}

  // Reads what the socket holds now, never past the end of the frame.
  IoResult step(int fd);

  std::uint64_t announced() const { return announced_; }
  std::uint64_t limit() const { return limit_; }
  std::size_t received() const { return header_got_ + body_.size(); }
  std::string take() { return std::move(body_); }

 private:
  std::uint64_t limit_;
  unsigned char header_[kLengthBytes] = {};
  std::size_t header_got_ = 0;
  std::uint64_t announced_ = 0;
  std::string body_;
};

// Reads one frame, waiting until `deadline`.
IoResult read_frame(int fd, FrameReader& reader, Clock::time_point deadline);

enum class WhileSending { kIgnoreInput, kStopOnInput };

// Sends `parts` back to back on a non-blocking socket (without SIGPIPE).
IoResult send_parts(int fd, std::initializer_list<std::string_view> parts, Clock::time_point deadline,
                    WhileSending input = WhileSending::kIgnoreInput);
// One frame whose bytes are `body` (handshake frames, which carry no MAC).
IoResult send_frame(int fd, std::string_view body, Clock::time_point deadline);

// One frame whose bytes are `parts` back to back, then their MAC.
IoResult send_sealed(int fd, FrameMac& mac, std::initializer_list<std::string_view> parts, Clock::time_point deadline,
                     WhileSending input = WhileSending::kIgnoreInput);
// Reads one frame (`reader`'s limit counts the MAC too) and checks its MAC:
// kBadMac when it is wrong. On kDone, `body` holds the bytes without the MAC.
IoResult read_sealed(int fd, FrameMac& mac, FrameReader& reader, Clock::time_point deadline, std::string* body);
// After reader.step() returned kDone: checks the MAC of the frame read (kDone or kBadMac) and strips it into `body`.
IoResult open_sealed(FrameMac& mac, FrameReader& reader, std::string* body);

// ---- answers (rank 0 -> the others)

std::string error_answer(std::uint64_t sequence, ErrorCode code, std::string_view message);
std::string ok_answer_head(std::uint64_t sequence);

// Best effort: the rank may be gone already, or too busy to take it in time.
void send_error_answer(int fd, FrameMac& mac, std::uint64_t sequence, ErrorCode code, std::string_view message,
                       Clock::time_point deadline);

// How long rank 0 tries to tell the others about a failure, all of them together.
Clock::time_point error_deadline(std::chrono::milliseconds timeout);

// An answer's payload, or the error rank 0 sent. `context` names the exchange.
struct Answer {
  std::uint8_t status = kAnswerOk;
  ErrorCode code = ErrorCode::kInternal;
  std::string payload;  // ok: the payload; error: the message (escaped: it came off the wire)
};

Answer decode_answer(std::string body, std::uint64_t sequence, const std::string& context);

}  // namespace stepgraph::wire

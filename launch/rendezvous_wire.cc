#include "launch/rendezvous_wire.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <system_error>

namespace stepgraph::wire {
namespace {

// A frame's bytes are read this many at a time at most, so memory follows what arrived.
constexpr std::size_t kReadChunk = std::size_t{1} << 20;

int poll_timeout_ms(Clock::time_point deadline) {
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<std::int64_t>(left, 0, 1 << 30));
}

std::uint64_t get_u64(const unsigned char* bytes) {
  std::uint64_t value = 0;
  for (int i = 0; i < 8; ++i) value |= std::uint64_t{bytes[i]} << (8 * i);
  return value;
}

}  // namespace

std::string errno_text(int error) { return std::error_code(error, std::generic_category()).message(); }

// ---- encoding

void put_u8(std::string& out, std::uint8_t value) { out.push_back(static_cast<char>(value)); }

void put_u32(std::string& out, std::uint32_t value) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xff));
}

void put_u64(std::string& out, std::uint64_t value) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xff));
}

std::string length_prefix(std::uint64_t length) {
  std::string out;
  put_u64(out, length);
  return out;
}

std::uint8_t Reader::u8() { return static_cast<std::uint8_t>(take(1)[0]); }

std::uint32_t Reader::u32() {
  const std::string_view b = take(4);
  std::uint32_t value = 0;
  for (int i = 0; i < 4; ++i) value |= std::uint32_t{static_cast<unsigned char>(b[i])} << (8 * i);
  return value;
}

std::uint64_t Reader::u64() { return get_u64(reinterpret_cast<const unsigned char*>(take(8).data())); }

std::string_view Reader::take(std::uint64_t count) {
  SG_CHECK_CODE(count <= bytes_.size() - at_, ErrorCode::kIo, "malformed ", context_, ": ", bytes_.size(),
                " bytes end early (a different StepGraph build on another rank?)");
  const std::string_view out = bytes_.substr(at_, count);
  at_ += count;
  return out;
}

// ---- sockets

void set_no_delay(int fd) {
  const int one = 1;
  // Latency only: small frames go out at once. Failing to set it is harmless.
  (void)::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

int poll_until(pollfd* fds, std::size_t count, Clock::time_point deadline) {
  while (true) {
    const int ready = ::poll(fds, static_cast<nfds_t>(count), poll_timeout_ms(deadline));
    if (ready >= 0) return ready;
    SG_CHECK_CODE(errno == EINTR, ErrorCode::kIo, "rendezvous: poll failed: ", errno_text(errno));
  }
}

std::string closed_text(const IoResult& result) {
  return result.error == 0 ? std::string("closed the connection (exited or crashed?)")
                           : "dropped the connection (" + errno_text(result.error) + "; exited or crashed?)";
}

IoResult FrameReader::step(int fd) {
  while (true) {
    char* into = nullptr;
    std::size_t want = 0;
    const bool in_header = header_got_ < kLengthBytes;
    if (in_header) {
      into = reinterpret_cast<char*>(header_) + header_got_;
      want = kLengthBytes - header_got_;
    } else if (body_.size() < announced_) {
      // Grow by what may come now, not by what was announced.
      const std::size_t had = body_.size();
      want = static_cast<std::size_t>(std::min<std::uint64_t>(announced_ - had, kReadChunk));
      body_.resize(had + want);
      into = body_.data() + had;
    } else {
      return {Io::kDone};
    }
    const ssize_t got = ::recv(fd, into, want, 0);
    const int error = errno;
    if (!in_header) body_.resize(body_.size() - want + static_cast<std::size_t>(std::max<ssize_t>(got, 0)));
    if (got == 0) return {Io::kClosed, 0};
    if (got < 0) {
      if (error == EINTR) continue;
      if (error == EAGAIN || error == EWOULDBLOCK) return {Io::kPending};
      return {Io::kClosed, error};
    }
    if (in_header) {
      header_got_ += static_cast<std::size_t>(got);
      if (header_got_ == kLengthBytes) {
        announced_ = get_u64(header_);
        if (announced_ > limit_) return {Io::kTooLarge};
      }
    }
  }
}

IoResult read_frame(int fd, FrameReader& reader, Clock::time_point deadline) {
  while (true) {
    const IoResult result = reader.step(fd);
    if (result.status != Io::kPending) return result;
    pollfd ready{fd, POLLIN, 0};
    if (poll_until(&ready, 1, deadline) == 0) return {Io::kTimedOut};
  }
}

IoResult send_parts(int fd, std::initializer_list<std::string_view> parts, Clock::time_point deadline,
                    WhileSending input) {
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

IoResult send_sealed(int fd, FrameMac& mac, std::initializer_list<std::string_view> parts, Clock::time_point deadline,
                     WhileSending input) {
  std::uint64_t length = 0;
  for (const std::string_view part : parts) length += part.size();
  const std::string tag = mac.seal(parts);
  const std::string prefix = length_prefix(length + kMacBytes);
  // At most a head and a payload: the prefix, they, and the tag go out in one send_parts.
  std::string_view all[4] = {};
  std::size_t count = 0;
  for (const std::string_view part : parts) {
    SG_CHECK_CODE(count < 2, ErrorCode::kInternal, "send_sealed takes at most two parts");
    all[count++] = part;
  }
  return send_parts(fd, {prefix, all[0], all[1], tag}, deadline, input);
}

IoResult open_sealed(FrameMac& mac, FrameReader& reader, std::string* body) {
  std::string frame = reader.take();
  if (!mac.open(frame)) return {Io::kBadMac};
  *body = std::move(frame);
  return {Io::kDone};
}

IoResult read_sealed(int fd, FrameMac& mac, FrameReader& reader, Clock::time_point deadline, std::string* body) {
  const IoResult result = read_frame(fd, reader, deadline);
  return result.status == Io::kDone ? open_sealed(mac, reader, body) : result;
}

// ---- answers

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

void send_error_answer(int fd, FrameMac& mac, std::uint64_t sequence, ErrorCode code, std::string_view message,
                       Clock::time_point deadline) {
  (void)send_sealed(fd, mac, {error_answer(sequence, code, message)}, deadline);
}

Clock::time_point error_deadline(std::chrono::milliseconds timeout) {
  return Clock::now() + std::min(timeout, std::chrono::milliseconds(1000));
}

Answer decode_answer(std::string body, std::uint64_t sequence, const std::string& context) {
  Reader reader(body, "answer from rank 0 to " + context);
  Answer answer;
  answer.status = reader.u8();
  const std::uint64_t got = reader.u64();
  if (answer.status == kAnswerError) {
    const std::uint32_t code = reader.u32();
    answer.code = code >= static_cast<std::uint32_t>(ErrorCode::kInvalidArgument) &&
                          code <= static_cast<std::uint32_t>(ErrorCode::kInternal)
                      ? static_cast<ErrorCode>(code)
                      : ErrorCode::kIo;
    answer.payload = escaped(reader.rest());
    return answer;
  }
  SG_CHECK_CODE(answer.status == kAnswerOk && got == sequence, ErrorCode::kIo, "malformed answer from rank 0 to ",
                context, ": status ", int{answer.status}, ", exchange ", got, " instead of ", sequence);
  body.erase(0, 9);  // status and sequence
  answer.payload = std::move(body);
  return answer;
}

}  // namespace stepgraph::wire

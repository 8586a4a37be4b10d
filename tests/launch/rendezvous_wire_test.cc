// The rendezvous's wire on a socket pair: a frame's buffer grows with the
// bytes that arrive (not with what the peer announces), oversize
// announcements are refused before any allocation, sealed frames pass and
// altered ones fail, and wire text is escaped before it is printed.
#include "launch/rendezvous_wire.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

namespace stepgraph {
namespace {

using wire::Io;

long max_rss_kib() {
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss;
}

// A connected pair of non-blocking stream sockets, closed at the end.
struct SocketPair {
  int a = -1;
  int b = -1;
  SocketPair() {
    int fds[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, fds), 0);
    a = fds[0];
    b = fds[1];
  }
  ~SocketPair() {
    if (a >= 0) ::close(a);
    ::close(b);
  }
};

TEST(RendezvousWireTest, AFrameBufferGrowsWithTheBytesThatArrive) {
  SocketPair pair;
  constexpr std::uint64_t kAnnounced = std::uint64_t{1} << 30;  // 1 GiB announced, 1000 bytes sent
  const std::string head = wire::length_prefix(kAnnounced);
  ASSERT_EQ(::write(pair.a, head.data(), head.size()), 8);
  const std::string some(1000, 'x');
  ASSERT_EQ(::write(pair.a, some.data(), some.size()), 1000);
  const long before = max_rss_kib();
  wire::FrameReader reader(kAnnounced);
  EXPECT_EQ(reader.step(pair.b).status, Io::kPending);
  EXPECT_EQ(reader.announced(), kAnnounced);
  EXPECT_EQ(reader.received(), 8u + 1000u);
  EXPECT_LT(max_rss_kib() - before, 64 * 1024) << "the reader allocated for bytes that never came";
  // The peer goes with its frame unfinished: an orderly close, not a frame.
  ::close(pair.a);
  pair.a = -1;
  EXPECT_EQ(reader.step(pair.b).status, Io::kClosed);
}

TEST(RendezvousWireTest, AnOversizeAnnouncementIsRefusedAtItsHeader) {
  SocketPair pair;
  const std::string head = wire::length_prefix(~std::uint64_t{0});
  ASSERT_EQ(::write(pair.a, head.data(), head.size()), 8);
  wire::FrameReader reader(4096);
  EXPECT_EQ(reader.step(pair.b).status, Io::kTooLarge);
  EXPECT_EQ(reader.received(), 8u);
}

TEST(RendezvousWireTest, AFrameInPiecesIsReadWhole) {
  SocketPair pair;
  const std::string body(3 << 20, 'q');  // larger than one read
  const std::string bytes = wire::length_prefix(body.size()) + body;
  wire::FrameReader reader(body.size());
  std::size_t sent = 0;
  wire::IoResult result{Io::kPending};
  while (result.status == Io::kPending) {
    const ssize_t n = ::send(pair.a, bytes.data() + sent, std::min<std::size_t>(bytes.size() - sent, 100000), 0);
    if (n > 0) sent += static_cast<std::size_t>(n);
    result = reader.step(pair.b);
  }
  EXPECT_EQ(result.status, Io::kDone);
  EXPECT_EQ(reader.take(), body);
}

TEST(RendezvousWireTest, SealedFramesPassAndAlteredOnesFail) {
  SocketPair pair;
  FrameMac sender = FrameMac::for_peer("secret", "transcript");
  FrameMac receiver = FrameMac::for_rank0("secret", "transcript");
  const auto deadline = wire::Clock::now() + std::chrono::seconds(5);
  ASSERT_EQ(wire::send_sealed(pair.a, sender, {"head", "payload"}, deadline).status, Io::kDone);
  wire::FrameReader reader(1024);
  std::string body;
  ASSERT_EQ(wire::read_sealed(pair.b, receiver, reader, deadline, &body).status, Io::kDone);
  EXPECT_EQ(body, "headpayload");

  // The next frame, one byte altered on the way.
  FrameMac copy = sender;
  const std::string tag = copy.seal({"second"});
  std::string altered = wire::length_prefix(6 + kMacBytes) + "secOnd" + tag;
  ASSERT_EQ(::write(pair.a, altered.data(), altered.size()), static_cast<ssize_t>(altered.size()));
  wire::FrameReader second(1024);
  EXPECT_EQ(wire::read_sealed(pair.b, receiver, second, deadline, &body).status, Io::kBadMac);
}

TEST(RendezvousWireTest, WireTextIsEscapedBeforeItIsPrinted) {
  const std::string hostile = std::string("ok \x1b[2J\x1b]0;title\x07 'q' \\ \x7f\xff\n");
  EXPECT_EQ(wire::quoted(hostile), "'ok \\x1b[2J\\x1b]0;title\\x07 \\x27q\\x27 \\x5c \\x7f\\xff\\x0a'");
  EXPECT_EQ(wire::escaped(hostile), "ok \\x1b[2J\\x1b]0;title\\x07 'q' \\ \\x7f\\xff\\x0a");
  EXPECT_EQ(wire::quoted(std::string(200, 'a'), 4), "'aaaa'...");
  EXPECT_EQ(wire::escaped(std::string(200, 'a'), 4), "aaaa...");
}

TEST(RendezvousWireTest, AnErrorAnswerComesBackEscapedWithAKnownCode) {
  std::string body = wire::error_answer(3, static_cast<ErrorCode>(999), "bad \x1b[31mred");
  const wire::Answer answer = wire::decode_answer(body, 3, "test");
  EXPECT_EQ(answer.status, wire::kAnswerError);
  EXPECT_EQ(answer.code, ErrorCode::kIo);  // an unknown code off the wire
  EXPECT_EQ(answer.payload, "bad \\x1b[31mred");
}

}  // namespace
}  // namespace stepgraph

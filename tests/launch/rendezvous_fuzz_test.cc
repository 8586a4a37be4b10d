// The rendezvous against hostile input on loopback: garbage, oversize
// announcements, impostors without the secret or with a wrong one, a rogue
// rank 0 that listens first, descriptor exhaustion. Every case ends in a
// clear error, or the genuine ranks carry on, within the configured timeout
// plus 2 s; nothing hostile is ever admitted. Runs in CI under
// AddressSanitizer too (tag asan_fuzz; .bazelrc's --config=asan).
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "engine/error.h"
#include "launch/rendezvous.h"
#include "tests/launch/forked_ranks.h"

namespace stepgraph {
namespace {

using namespace ::stepgraph::testing;  // NOLINT(google-build-using-namespace): the harness of forked_ranks.h

constexpr milliseconds kTimeout(1500);
constexpr milliseconds kBound = kTimeout + seconds(2);  // no case may take longer
const std::string kSecret = "fuzz-secret-0123456789abcdef-A";
const std::string kOtherSecret = "fuzz-secret-0123456789abcdef-B";

LaunchInfo secret_rank(int rank, int world, int port, const std::string& secret = kSecret) {
  LaunchInfo info = rank_info(rank, world, port);
  info.secret = secret;
  return info;
}

// In a child: `call` raises an Error with `code` and every word, within kBound.
int expect_error_in_time(const std::function<void()>& call, ErrorCode code,
                         std::initializer_list<std::string_view> words) {
  const Clock::time_point start = Clock::now();
  const int status = expect_error(call, code, words);
  const auto took = std::chrono::duration_cast<milliseconds>(Clock::now() - start);
  CHILD_CHECK(took < kBound, "took ", took.count(), " ms, more than ", kBound.count());
  return status;
}

// ---- raw bytes on the wire, as a process that is no rank would send them

std::string u32_bytes(std::uint32_t value) {
  std::string out;
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xff));
  return out;
}

std::string u64_bytes(std::uint64_t value) {
  return u32_bytes(static_cast<std::uint32_t>(value)) + u32_bytes(value >> 32);
}

std::string frame(std::string_view body) { return u64_bytes(body.size()) + std::string(body); }

// A version-2 hello (rendezvous_handshake.cc) with a fixed nonce.
std::string hello_frame(int rank, int world, bool has_secret) {
  return frame(u32_bytes(0x53475256) + u32_bytes(2) + u32_bytes(static_cast<std::uint32_t>(rank)) +
               u32_bytes(static_cast<std::uint32_t>(world)) + std::string(1, has_secret ? '\1' : '\0') +
               std::string(32, 'n'));
}

std::string random_bytes(std::size_t count, std::uint32_t seed) {
  std::mt19937 generator(seed);
  std::string out(count, '\0');
  for (char& c : out) c = static_cast<char>(generator() & 0xff);
  return out;
}

sockaddr_in loopback_address(int port, const char* ip = "127.0.0.1") {
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<std::uint16_t>(port));
  ::inet_pton(AF_INET, ip, &address.sin_addr);
  return address;
}

// A blocking connection to 127.0.0.1:port, retried every 20 ms while nobody listens yet; -1 if none.
int connect_raw(int port, int attempts = 150) {
  for (int attempt = 0; attempt < attempts; ++attempt) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const sockaddr_in address = loopback_address(port);
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) == 0) return fd;
    ::close(fd);
    std::this_thread::sleep_for(milliseconds(20));
  }
  return -1;
}

void send_all(int fd, std::string_view bytes) {
  std::size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t n = ::send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return;
    sent += static_cast<std::size_t>(n);
  }
}

// What arrives on `fd` until it closes or `wait` passes.
std::string receive_for(int fd, milliseconds wait) {
  timeval limit{};
  limit.tv_sec = static_cast<time_t>(wait.count() / 1000);
  limit.tv_usec = static_cast<suseconds_t>((wait.count() % 1000) * 1000);
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof(limit));
  std::string out;
  char buffer[4096];
  const Clock::time_point until = Clock::now() + wait;
  while (Clock::now() < until) {
    const ssize_t n = ::recv(fd, buffer, sizeof(buffer), 0);
    if (n <= 0) break;
    out.append(buffer, static_cast<std::size_t>(n));
  }
  return out;
}

// A listener on 127.0.0.1:port taken before any rank 0 can (the rogue of the rogue-rank-0 cases).
int listen_raw(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  const sockaddr_in address = loopback_address(port);
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0 || ::listen(fd, 16) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// One child tells another that it is done (a file appears), so a case's order does not rest on sleeps.
struct Signal {
  std::string path;
  explicit Signal(const char* name) {
    const char* dir = std::getenv("TEST_TMPDIR");
    path = std::string(dir != nullptr ? dir : "/tmp") + "/" + name + "." + std::to_string(::getpid());
    ::unlink(path.c_str());
  }
  void raise() const { std::ofstream(path).put('1'); }
  // Waits until raised, at most `limit`.
  void wait(milliseconds limit = seconds(5)) const {
    const Clock::time_point until = Clock::now() + limit;
    while (::access(path.c_str(), F_OK) != 0 && Clock::now() < until) std::this_thread::sleep_for(milliseconds(10));
  }
};

long max_rss_kib() {
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss;
}

// Two genuine ranks exchange; true when each got both blobs.
int genuine_exchange(Rendezvous& rendezvous, int rank) {
  const std::vector<std::string> all = rendezvous.all_gather(std::to_string(rank), "ranks");
  CHILD_CHECK(all == (std::vector<std::string>{"0", "1"}), "rank ", rank, " got another world");
  return 0;
}

// ---- garbage and oversize

TEST(RendezvousFuzzTest, GarbageAndOversizeAnnouncementsAreRefusedWhileTheRanksJoin) {
  const int port = free_port();
  const Signal sent("garbage_sent");
  expect_all_succeeded(run_processes(3, [&](int process) {
    if (process == 2) {
      std::vector<int> held;
      const std::vector<std::string> attacks = {
          random_bytes(4096, 1),                                         // noise
          u64_bytes(std::uint64_t{1} << 62) + random_bytes(1 << 20, 2),  // announces 4 EiB, sends 1 MiB
          u64_bytes(~std::uint64_t{0}),                                  // announces 2^64 - 1
          u64_bytes(4000) + random_bytes(4000, 3),                       // a hello-sized frame of noise
          frame(u32_bytes(0x53475256) + u32_bytes(2) + "short"),         // our magic, cut short
          frame(u32_bytes(0x53475256) + u32_bytes(1) + u32_bytes(1) + u32_bytes(2) + u32_bytes(3) + "tag"),  // v1
          std::string("GET / HTTP/1.1\r\n\x1b[2J\r\n\r\n"),
      };
      for (const std::string& attack : attacks) {
        const int fd = connect_raw(port);
        CHILD_CHECK(fd >= 0, "cannot reach rank 0");
        send_all(fd, attack);
        held.push_back(fd);
      }
      sent.raise();
      std::this_thread::sleep_for(milliseconds(800));
      for (const int fd : held) ::close(fd);
      return 0;
    }
    if (process == 1) sent.wait();  // after the garbage
    const long before = max_rss_kib();
    auto rendezvous = Rendezvous::connect(secret_rank(process, 2, port), "run", kTimeout);
    CHILD_CHECK(max_rss_kib() - before < 64 * 1024, "rank ", process, " grew by ", max_rss_kib() - before,
                " KiB over announcements it never received");
    return genuine_exchange(*rendezvous, process);
  }));
}

TEST(RendezvousFuzzTest, RankZeroAmongStrangersOnlyEndsInTime) {
  const int port = free_port();
  expect_all_succeeded(run_processes(2, [&](int process) {
    if (process == 1) {
      for (std::uint32_t round = 0; round < 400; ++round) {
        const int fd = connect_raw(port, round == 0 ? 150 : 1);
        if (fd < 0) return 0;  // rank 0 gave up
        send_all(fd, random_bytes(64 + round % 512, round));
        ::close(fd);
        std::this_thread::sleep_for(milliseconds(5));
      }
      return 0;
    }
    return expect_error_in_time([&] { (void)Rendezvous::connect(secret_rank(0, 2, port), "run", kTimeout); },
                                ErrorCode::kIo, {"rank 1 did not join within 1500 ms", "no rank of this run"});
  }));
}

// ---- impostors

TEST(RendezvousFuzzTest, AnImpostorWithoutTheSecretCannotTakeARank) {
  const int port = free_port();
  const Signal refused("impostor_refused");
  expect_all_succeeded(run_processes(3, [&](int process) {
    if (process == 2) {  // says it is rank 1, has no secret
      const int status = expect_error_in_time(
          [&] { (void)Rendezvous::connect(rank_info(1, 2, port), "run", kTimeout); }, ErrorCode::kInvalidArgument,
          {"has a rendezvous secret but rank 1 has none", "STEPGRAPH_RENDEZVOUS_SECRET"});
      refused.raise();
      return status;
    }
    if (process == 1) refused.wait();  // the impostor comes first
    auto rendezvous = Rendezvous::connect(secret_rank(process, 2, port), "run", kTimeout);
    return genuine_exchange(*rendezvous, process);
  }));
}

TEST(RendezvousFuzzTest, AForgedProofIsRefusedAndNamed) {
  // Speaks the protocol, but cannot compute the proof: claims rank 1 with made-up bytes.
  const int port = free_port();
  expect_all_succeeded(run_processes(2, [&](int process) {
    if (process == 1) {
      const int fd = connect_raw(port);
      CHILD_CHECK(fd >= 0, "cannot reach rank 0");
      send_all(fd, hello_frame(1, 2, true));
      const std::string challenge = receive_for(fd, milliseconds(500));
      CHILD_CHECK(challenge.size() == 8 + 73, "a challenge of ", challenge.size(), " bytes");
      send_all(fd, frame(std::string(1, '\1') + std::string(32, 'A')));
      const std::string after = receive_for(fd, kBound);
      CHILD_CHECK(after.empty(), "rank 0 sent ", after.size(), " bytes to a forged proof");
      ::close(fd);
      return 0;
    }
    return expect_error_in_time([&] { (void)Rendezvous::connect(secret_rank(0, 2, port), "run", kTimeout); },
                                ErrorCode::kIo,
                                {"rank 1 did not join", "claiming rank 1 failed to prove the rendezvous secret"});
  }));
}

TEST(RendezvousFuzzTest, AWrongSecretIsNamedOnEveryRank) {
  // Ranks 0 and 1 share a secret; rank 2 holds another.
  const int port = free_port();
  expect_all_succeeded(run_processes(3, [&](int rank) {
    if (rank == 2) {
      return expect_error_in_time(
          [&] { (void)Rendezvous::connect(secret_rank(2, 3, port, kOtherSecret), "run", kTimeout); }, ErrorCode::kIo,
          {"rank 0 at 127.0.0.1:", "failed to prove the rendezvous secret to rank 2"});
    }
    return expect_error_in_time(
        [&] { (void)Rendezvous::connect(secret_rank(rank, 3, port), "run", kTimeout); }, ErrorCode::kIo,
        {"rank 2 did not join", "claiming rank 2 could not check rank 0's proof", "secret differs"});
  }));
}

// ---- a rogue rank 0

enum class Rogue { kEcho, kFakeChallenge, kSilent, kHuge, kNoSecret };

int rogue_rank0(int port, Rogue rogue) {
  const int listener = listen_raw(port);
  CHILD_CHECK(listener >= 0, "the rogue cannot listen");
  const int fd = ::accept(listener, nullptr, nullptr);
  CHILD_CHECK(fd >= 0, "the rogue accepted nothing");
  const std::string hello = receive_for(fd, milliseconds(300));
  switch (rogue) {
    case Rogue::kEcho: send_all(fd, hello); break;
    case Rogue::kFakeChallenge:
    case Rogue::kNoSecret:
      send_all(fd,
               frame(u32_bytes(0x53475256) + u32_bytes(2) + std::string(1, rogue == Rogue::kNoSecret ? '\0' : '\1') +
                     random_bytes(32, 7) + random_bytes(32, 8)));
      break;
    case Rogue::kSilent: break;
    case Rogue::kHuge: send_all(fd, u64_bytes(std::uint64_t{1} << 40) + random_bytes(4096, 9)); break;
  }
  // Whatever the peer sends now is all a rogue gets: no proof of its own (the peer refused first).
  const std::string after = receive_for(fd, kBound);
  CHILD_CHECK(after.find(std::string(32, 'n')) == std::string::npos, "the peer sent its hello twice");
  ::close(fd);
  ::close(listener);
  return 0;
}

void expect_rogue_refused(Rogue rogue, std::initializer_list<std::string_view> words) {
  const int port = free_port();
  expect_all_succeeded(run_processes(2, [&](int process) {
    if (process == 0) return rogue_rank0(port, rogue);
    std::this_thread::sleep_for(milliseconds(100));  // the rogue listens first
    return expect_error_in_time([&] { (void)Rendezvous::connect(secret_rank(1, 2, port), "run", kTimeout); },
                                ErrorCode::kIo, words);
  }));
}

TEST(RendezvousFuzzTest, ARogueRankZeroThatEchoesIsRefused) {
  expect_rogue_refused(Rogue::kEcho, {"is no StepGraph rank 0"});
}

TEST(RendezvousFuzzTest, ARogueRankZeroWithAFakeChallengeIsRefused) {
  expect_rogue_refused(Rogue::kFakeChallenge, {"rank 0 at 127.0.0.1:", "failed to prove the rendezvous secret"});
}

TEST(RendezvousFuzzTest, ARogueRankZeroThatSaysItHasNoSecretIsRefused) {
  expect_rogue_refused(Rogue::kNoSecret, {"failed to prove the rendezvous secret", "it says it has none"});
}

TEST(RendezvousFuzzTest, ASilentRogueRankZeroIsATimeout) {
  expect_rogue_refused(Rogue::kSilent, {"sent no rendezvous challenge"});
}

TEST(RendezvousFuzzTest, ARogueRankZeroAnnouncingAHugeFrameIsRefused) {
  expect_rogue_refused(Rogue::kHuge, {"is no StepGraph rank 0", "announced a challenge of 1099511627776 bytes"});
}

// ---- descriptors

// In a child: stderr into a file (to count log lines), the descriptor limit lowered to `limit`.
std::string capture_stderr_and_limit_descriptors(rlim_t limit) {
  char path[] = "/tmp/rendezvous_fuzz_log_XXXXXX";
  const int log = ::mkstemp(path);
  ::dup2(log, 2);
  ::close(log);
  rlimit lowered{limit, limit};
  ::setrlimit(RLIMIT_NOFILE, &lowered);
  return path;
}

int count_lines_with(const std::string& path, std::string_view word) {
  std::ifstream in(path);
  int count = 0;
  for (std::string line; std::getline(in, line);) count += line.find(word) != std::string::npos ? 1 : 0;
  return count;
}

TEST(RendezvousFuzzTest, DescriptorExhaustionEndsInTimeWithoutFloodingTheLog) {
  // Every descriptor but the listener's is taken: accept() fails with EMFILE
  // while connections wait, and the listener stays readable.
  const int port = free_port();
  expect_all_succeeded(run_processes(2, [&](int process) {
    if (process == 1) {
      std::vector<int> held;
      for (int i = 0; i < 20; ++i) {
        const int fd = connect_raw(port, i == 0 ? 150 : 1);
        if (fd < 0) break;  // rank 0 is done
        held.push_back(fd);
      }
      std::this_thread::sleep_for(kBound);
      for (const int fd : held) ::close(fd);
      return 0;
    }
    const std::string log = capture_stderr_and_limit_descriptors(64);
    std::vector<int> filler;
    for (int fd = ::open("/dev/null", O_RDONLY); fd >= 0; fd = ::open("/dev/null", O_RDONLY)) filler.push_back(fd);
    CHILD_CHECK(!filler.empty(), "no descriptor to fill");
    ::close(filler.back());  // room for the listener only
    filler.pop_back();
    const int status = expect_error_in_time(
        [&] { (void)Rendezvous::connect(secret_rank(0, 2, port), "run", kTimeout); }, ErrorCode::kIo,
        {"rank 1 did not join within 1500 ms", "rank 0 ran out of descriptors", "ulimit -n"});
    const int lines = count_lines_with(log, "cannot accept");
    ::unlink(log.c_str());
    CHILD_CHECK(lines >= 1 && lines <= 3, lines, " log lines about accept() in ", kTimeout.count(), " ms");
    return status;
  }));
}

TEST(RendezvousFuzzTest, IdleConnectionsBeyondTheLimitsDoNotKeepARankOut) {
  // 200 idle connections against a descriptor limit of 64 and a cap of 128
  // connections in their handshake: the oldest idle ones are dropped, and the
  // genuine rank that comes later joins.
  const int port = free_port();
  expect_all_succeeded(run_processes(3, [&](int process) {
    if (process == 2) {
      std::vector<int> held;
      for (int i = 0; i < 200; ++i) {
        const int fd = connect_raw(port, i == 0 ? 150 : 1);
        if (fd < 0) break;  // rank 0 is done
        held.push_back(fd);
      }
      std::this_thread::sleep_for(milliseconds(1500));
      for (const int fd : held) ::close(fd);
      return 0;
    }
    if (process == 1) {
      std::this_thread::sleep_for(milliseconds(500));
    } else {
      ::unlink(capture_stderr_and_limit_descriptors(64).c_str());  // its log is not read here
    }
    auto rendezvous = Rendezvous::connect(secret_rank(process, 2, port), "run", kTimeout);
    return genuine_exchange(*rendezvous, process);
  }));
}

// ---- where rank 0 listens, and runs without a secret

TEST(RendezvousFuzzTest, RankZeroListensOnMasterAddrOnly) {
  // 127.0.0.2 is loopback too, but another address: rank 0 must not answer on 127.0.0.1.
  const int port = free_port();
  expect_all_succeeded(run_processes(2, [&](int process) {
    LaunchInfo info = secret_rank(process, 2, port);
    info.master_addr = "127.0.0.2";
    if (process == 1) {
      std::this_thread::sleep_for(milliseconds(200));
      const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      const sockaddr_in elsewhere = loopback_address(port, "127.0.0.1");
      const int refused = ::connect(fd, reinterpret_cast<const sockaddr*>(&elsewhere), sizeof(elsewhere));
      ::close(fd);
      CHILD_CHECK(refused != 0, "rank 0 answers on 127.0.0.1 although MASTER_ADDR is 127.0.0.2");
    }
    auto rendezvous = Rendezvous::connect(info, "run", kTimeout);
    return genuine_exchange(*rendezvous, process);
  }));
}

// This host's first IPv4 address that is not loopback, if any.
std::string host_address() {
  ifaddrs* all = nullptr;
  if (::getifaddrs(&all) != 0) return "";
  std::string found;
  for (const ifaddrs* at = all; at != nullptr && found.empty(); at = at->ifa_next) {
    if (at->ifa_addr == nullptr || at->ifa_addr->sa_family != AF_INET) continue;
    const auto* address = reinterpret_cast<const sockaddr_in*>(at->ifa_addr);
    if ((ntohl(address->sin_addr.s_addr) >> 24) == 127) continue;
    char text[INET_ADDRSTRLEN] = {};
    ::inet_ntop(AF_INET, &address->sin_addr, text, sizeof(text));
    found = text;
  }
  ::freeifaddrs(all);
  return found;
}

TEST(RendezvousFuzzTest, AMultiHostRunListensOnItsAddressNotOnEveryInterface) {
  const std::string address = host_address();
  if (address.empty()) GTEST_SKIP() << "this host has no IPv4 address but loopback";
  const int port = free_port();
  // Ranks 0 and 1 of a world of 4 over two hosts: rank 0 listens; nothing answers on loopback.
  expect_all_succeeded(run_processes(2, [&](int process) {
    if (process == 1) {
      std::this_thread::sleep_for(milliseconds(300));
      const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      const sockaddr_in loop = loopback_address(port);
      const int refused = ::connect(fd, reinterpret_cast<const sockaddr*>(&loop), sizeof(loop));
      ::close(fd);
      CHILD_CHECK(refused != 0, "rank 0 of a multi-host run answers on 127.0.0.1: it listens on every interface");
      return 0;
    }
    LaunchInfo info = secret_rank(0, 4, port);
    info.local_world_size = 2;
    info.master_addr = address;
    return expect_error_in_time([&] { (void)Rendezvous::connect(info, "run", milliseconds(800)); }, ErrorCode::kIo,
                                {"did not join"});
  }));
}

TEST(RendezvousFuzzTest, AMultiHostRunWithoutASecretDoesNotStart) {
  LaunchInfo info = rank_info(1, 4, free_port());
  info.local_world_size = 2;
  info.local_rank = 1;
  try {
    (void)Rendezvous::connect(info, "run", kTimeout);
    ADD_FAILURE() << "a multi-host run started without a secret";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
    for (const char* word : {"spans several hosts", "no rendezvous secret",
                             "STEPGRAPH_RENDEZVOUS_SECRET=", "STEPGRAPH_RENDEZVOUS_SECRET_FILE"}) {
      EXPECT_NE(error.message().find(word), std::string::npos) << word << " in: " << error.message();
    }
  }
}

TEST(RendezvousFuzzTest, AMultiHostRankZeroRefusesALoopbackOrWildcardMasterAddr) {
  for (const char* master : {"127.0.0.1", "0.0.0.0"}) {
    LaunchInfo info = secret_rank(0, 4, free_port());
    info.local_world_size = 2;
    info.master_addr = master;
    try {
      (void)Rendezvous::connect(info, "run", kTimeout);
      ADD_FAILURE() << "rank 0 listened at " << master << " for a multi-host run";
    } catch (const Error& error) {
      EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument) << error.message();
      EXPECT_NE(error.message().find(master), std::string::npos) << error.message();
      EXPECT_NE(error.message().find("set MASTER_ADDR to"), std::string::npos) << error.message();
    }
  }
}

// ---- wire text

TEST(RendezvousFuzzTest, TerminalEscapesInWireTextAreEscapedInEveryMessage) {
  const int port = free_port();
  expect_all_succeeded(run_processes(2, [&](int rank) {
    const std::string tag = rank == 1 ? std::string("tag\x1b]0;owned\x07\x1b[2J\n") : "tag";
    try {
      (void)Rendezvous::connect(secret_rank(rank, 2, port), tag, kTimeout);
    } catch (const Error& error) {
      CHILD_CHECK(error.message().find("run tag") != std::string::npos, error.message());
      CHILD_CHECK(error.message().find('\x1b') == std::string::npos, "a raw escape in: ", error.message());
      CHILD_CHECK(error.message().find('\x07') == std::string::npos, "a raw bell in: ", error.message());
      CHILD_CHECK(error.message().find("\\x1b") != std::string::npos, error.message());
      return 0;
    }
    CHILD_CHECK(false, "rank ", rank, " joined a run with another tag");
  }));
}

}  // namespace
}  // namespace stepgraph

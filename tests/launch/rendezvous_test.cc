// Rendezvous between real processes: each test forks one child per rank on
// 127.0.0.1 through forked_ranks.h (a child reports by exit code; a hang is
// killed and fails the test instead of stalling it).
#include "launch/rendezvous.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "engine/error.h"
#include "tests/launch/forked_ranks.h"
#include "tests/support/expect_error.h"

namespace stepgraph {
namespace {

using namespace ::stepgraph::testing;  // NOLINT(google-build-using-namespace): the harness of forked_ranks.h

constexpr int kWorld = 4;

std::string blob_of(int rank, std::size_t bytes) {
  std::string blob(bytes, '\0');
  for (std::size_t i = 0; i < bytes; ++i)
    blob[i] = static_cast<char>((i * 131 + static_cast<std::size_t>(rank) * 7) % 251);
  return blob;
}

// ---- exchanges

TEST(RendezvousTest, AllGatherBroadcastBarrierOnFourRanks) {
  const int port = free_port();
  expect_all_succeeded(run_processes(kWorld, [&](int rank) {
    auto rendezvous = Rendezvous::connect(rank_info(rank, kWorld, port), "run-a", seconds(5));
    CHILD_CHECK(rendezvous->rank() == rank && rendezvous->world_size() == kWorld);
    for (int round = 0; round < 20; ++round) {
      // Sizes differ by rank and round, empty included.
      const std::string mine =
          std::string(static_cast<std::size_t>((rank * 5 + round) % 7), 'a' + rank) + std::to_string(round);
      const std::vector<std::string> all = rendezvous->all_gather(mine, "round blobs");
      CHILD_CHECK(all.size() == kWorld, "got ", all.size());
      for (int r = 0; r < kWorld; ++r) {
        const std::string expected =
            std::string(static_cast<std::size_t>((r * 5 + round) % 7), 'a' + r) + std::to_string(round);
        CHILD_CHECK(all[static_cast<std::size_t>(r)] == expected, "rank ", r, " round ", round);
      }
      const std::string id =
          rendezvous->broadcast(rank == 0 ? "unique id " + std::to_string(round) : "ignored", "nccl unique id");
      CHILD_CHECK(id == "unique id " + std::to_string(round), "got '", id, "'");
      rendezvous->barrier("end of round");
    }
    CHILD_CHECK(rendezvous->all_gather("", "empty") == std::vector<std::string>(kWorld));
    CHILD_CHECK(rendezvous->broadcast("", "empty broadcast").empty());
    return 0;
  }));
}

TEST(RendezvousTest, EightMegabyteBlobs) {
  const int port = free_port();
  constexpr std::size_t kBytes = std::size_t{8} << 20;
  expect_all_succeeded(run_processes(kWorld, [&](int rank) {
    auto rendezvous = Rendezvous::connect(rank_info(rank, kWorld, port), "big", seconds(5));
    const std::vector<std::string> all = rendezvous->all_gather(blob_of(rank, kBytes), "large blobs");
    CHILD_CHECK(all.size() == kWorld);
    for (int r = 0; r < kWorld; ++r) CHILD_CHECK(all[static_cast<std::size_t>(r)] == blob_of(r, kBytes), "rank ", r);
    const std::string from0 = rendezvous->broadcast(rank == 0 ? blob_of(9, kBytes) : "", "large broadcast");
    CHILD_CHECK(from0 == blob_of(9, kBytes));
    rendezvous->barrier("done");
    return 0;
  }));
}

TEST(RendezvousTest, WorldOfOneNeedsNoSocket) {
  LaunchInfo info;
  info.master_addr = "no-such-host.invalid";  // never resolved
  auto rendezvous = Rendezvous::connect(info, "alone", milliseconds(1));
  EXPECT_EQ(rendezvous->rank(), 0);
  EXPECT_EQ(rendezvous->world_size(), 1);
  EXPECT_EQ(rendezvous->all_gather("mine", "solo"), std::vector<std::string>{"mine"});
  EXPECT_EQ(rendezvous->broadcast("id", "solo"), "id");
  rendezvous->barrier("solo");
  const std::string too_big(Rendezvous::kMaxBlobBytes + 1, 'x');
  EXPECT_ERROR_CONTAINS(rendezvous->all_gather(too_big, "huge"), "'huge'", "more than the");
}

TEST(RendezvousTest, BadArgumentsAreErrors) {
  const int port = free_port();
  EXPECT_ERROR_CONTAINS((void)Rendezvous::connect(rank_info(4, kWorld, port), "t", seconds(1)), "rank 4",
                        "outside [0, 4)");
  EXPECT_ERROR_CONTAINS((void)Rendezvous::connect(rank_info(1, kWorld, port), "t", milliseconds(0)), "timeout",
                        "positive");
  EXPECT_ERROR_CONTAINS((void)Rendezvous::connect(rank_info(1, kWorld, 0), "t", seconds(1)), "port 0");
  EXPECT_ERROR_CONTAINS((void)Rendezvous::connect(rank_info(0, 1, port), std::string(5000, 't'), seconds(1)), "run tag",
                        "5000 bytes");
}

TEST(RendezvousTest, PortInUseIsAnError) {
  // A listener without SO_REUSEADDR holds the port: rank 0 cannot listen there.
  const int holder = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  ASSERT_EQ(::bind(holder, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  ASSERT_EQ(::listen(holder, 1), 0);
  ASSERT_EQ(::getsockname(holder, reinterpret_cast<sockaddr*>(&address), &length), 0);
  const int port = ntohs(address.sin_port);
  try {
    (void)Rendezvous::connect(rank_info(0, 2, port), "t", seconds(1));
    ADD_FAILURE() << "rank 0 listened on a port in use";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kIo);
    EXPECT_NE(error.message().find("in use"), std::string::npos) << error.message();
    EXPECT_NE(error.message().find("MASTER_PORT"), std::string::npos) << error.message();
  }
  ::close(holder);
}

TEST(RendezvousTest, AStrangerOnThePortIsIgnored) {
  // Something that is no rank connects first and sends junk; the run goes on.
  const int port = free_port();
  expect_all_succeeded(run_processes(3, [&](int process) {
    if (process == 2) {
      std::this_thread::sleep_for(milliseconds(50));
      const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in address{};
      address.sin_family = AF_INET;
      address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      address.sin_port = htons(static_cast<std::uint16_t>(port));
      for (int attempt = 0; attempt < 100; ++attempt) {
        if (::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0) break;
        std::this_thread::sleep_for(milliseconds(20));
      }
      const char junk[] = "GET / HTTP/1.1\r\n\r\n";
      (void)::send(fd, junk, sizeof(junk), MSG_NOSIGNAL);
      std::this_thread::sleep_for(milliseconds(500));
      ::close(fd);
      return 0;
    }
    if (process == 1) std::this_thread::sleep_for(milliseconds(200));  // after the stranger
    auto rendezvous = Rendezvous::connect(rank_info(process, 2, port), "t", seconds(5));
    CHILD_CHECK(rendezvous->all_gather(std::to_string(process), "ranks") == (std::vector<std::string>{"0", "1"}));
    return 0;
  }));
}

// ---- ranks that disagree

TEST(RendezvousTest, WorldSizeMismatchIsAnErrorOnEveryRank) {
  const int port = free_port();
  expect_all_succeeded(run_processes(kWorld, [&](int rank) {
    const int world = rank == 2 ? 3 : kWorld;
    return expect_error([&] { (void)Rendezvous::connect(rank_info(rank, world, port), "run", seconds(5)); },
                        ErrorCode::kInvalidArgument, {"rank 2 has world size 3", "rank 0 has world size 4"});
  }));
}

TEST(RendezvousTest, RunTagMismatchIsAnErrorOnEveryRank) {
  const int port = free_port();
  expect_all_succeeded(run_processes(kWorld, [&](int rank) {
    const std::string tag = rank == 1 ? "flags-b" : "flags-a";
    return expect_error([&] { (void)Rendezvous::connect(rank_info(rank, kWorld, port), tag, seconds(5)); },
                        ErrorCode::kInvalidArgument, {"rank 1 has run tag 'flags-b'", "rank 0 has 'flags-a'"});
  }));
}

TEST(RendezvousTest, DuplicateRankIsAnErrorOnEveryRank) {
  // Processes say they are ranks 0, 1, 1, 2: rank 1 twice, rank 3 never.
  const int port = free_port();
  expect_all_succeeded(run_processes(kWorld, [&](int process) {
    const int rank = process == 0 ? 0 : (process == 3 ? 2 : 1);
    return expect_error([&] { (void)Rendezvous::connect(rank_info(rank, kWorld, port), "run", seconds(5)); },
                        ErrorCode::kInvalidArgument, {"rank 1 joined twice", "rank 3 did not join"});
  }));
}

TEST(RendezvousTest, ExchangesOutOfOrderAreAnErrorOnEveryRank) {
  const int port = free_port();
  expect_all_succeeded(run_processes(kWorld, [&](int rank) {
    auto rendezvous = Rendezvous::connect(rank_info(rank, kWorld, port), "run", seconds(5));
    rendezvous->barrier("start");
    return expect_error(
        [&] {
          if (rank == 2) {
            rendezvous->barrier("sync");
          } else {
            (void)rendezvous->all_gather("hash", "capture hashes");
          }
        },
        ErrorCode::kInvalidState, {"rank 2 is in barrier 'sync' (exchange 2)", "all_gather 'capture hashes'"});
  }));
}

// ---- ranks that are gone

TEST(RendezvousTest, ARankThatExitsIsNamedByTheOthersQuickly) {
  const int port = free_port();
  constexpr milliseconds kTimeout(1500);
  expect_all_succeeded(run_processes(kWorld, [&](int rank) {
    auto rendezvous = Rendezvous::connect(rank_info(rank, kWorld, port), "run", seconds(5));
    rendezvous->barrier("before");
    if (rank == 3) ::_exit(0);  // gone without a word
    rendezvous->set_timeout(kTimeout);
    const Clock::time_point start = Clock::now();
    const int code = expect_error([&] { (void)rendezvous->all_gather("hash", "flag hashes"); }, ErrorCode::kIo,
                                  {"rank 3", "the connection", "all_gather 'flag hashes'"});
    const int named = expect_error([&] { (void)rendezvous->all_gather("hash", "flag hashes"); },
                                   ErrorCode::kInvalidState, {"failed earlier", "rank 3"});
    CHILD_CHECK(Clock::now() - start < 2 * kTimeout + seconds(1), "took too long");
    return code | named;
  }));
}

TEST(RendezvousTest, ARankThatDoesNotAnswerIsATimeoutNamingIt) {
  const int port = free_port();
  constexpr milliseconds kTimeout(1500);
  expect_all_succeeded(run_processes(kWorld, [&](int rank) {
    auto rendezvous = Rendezvous::connect(rank_info(rank, kWorld, port), "run", seconds(5));
    rendezvous->set_timeout(kTimeout);
    if (rank == 3) {
      // Alive, but comes only after the others gave up on it: it learns why from rank 0 (or sees it gone).
      std::this_thread::sleep_for(2 * kTimeout);
      return expect_error([&] { rendezvous->barrier("step 7"); }, ErrorCode::kIo, {"rank 3", "barrier 'step 7'"});
    }
    const Clock::time_point start = Clock::now();
    const int code = expect_error([&] { rendezvous->barrier("step 7"); }, ErrorCode::kIo,
                                  {"rank 3 did not answer within 1500 ms", "barrier 'step 7'"});
    CHILD_CHECK(Clock::now() - start < 2 * kTimeout + seconds(1), "took too long");
    return code;
  }));
}

TEST(RendezvousTest, ARankThatNeverShowsIsATimeoutNamingIt) {
  // World of 4, but only ranks 0, 1, 2 start.
  const int port = free_port();
  constexpr milliseconds kTimeout(2000);
  expect_all_succeeded(run_processes(3, [&](int rank) {
    const Clock::time_point start = Clock::now();
    const int code = expect_error([&] { (void)Rendezvous::connect(rank_info(rank, kWorld, port), "run", kTimeout); },
                                  ErrorCode::kIo, {"rank 3 did not join within 2000 ms", "MASTER_PORT"});
    CHILD_CHECK(Clock::now() - start < 2 * kTimeout + seconds(1), "took too long");
    return code;
  }));
}

TEST(RendezvousTest, RankZeroThatNeverShowsIsATimeout) {
  const int port = free_port();
  constexpr milliseconds kTimeout(1000);
  expect_all_succeeded(run_processes(2, [&](int process) {
    const int rank = process + 1;
    return expect_error([&] { (void)Rendezvous::connect(rank_info(rank, 3, port), "run", kTimeout); }, ErrorCode::kIo,
                        {"could not reach rank 0 at 127.0.0.1:", "within 1000 ms"});
  }));
}

}  // namespace
}  // namespace stepgraph

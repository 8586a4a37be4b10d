// ops::ring_shift on host thread worlds: eager through the mailbox, captured
// through peer windows (Note [The pool as symmetric memory]): the same bytes,
// replayed 10,000 times; and what goes wrong is an Error, never a hang.
#include "ops/collective_ops.h"

#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <vector>

#include "engine/host_world.h"
#include "engine/peer_window.h"
#include "graphs/captured_step.h"
#include "ops/elementwise_ops.h"
#include "tests/support/expect_error.h"

namespace stepgraph {
namespace {

using namespace std::chrono_literals;

// Rank r's values: element i is r * 1000 + i + step (changes per step).
std::vector<float> rank_values(int r, int step, std::int64_t n) {
  std::vector<float> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = static_cast<float>(r * 1000 + i + step);
  return v;
}

class RingShiftTest : public ::testing::TestWithParam<int> {};

// Three shifts in a row: rank r ends with rank r - 3's values (mod N), eager
// and captured, and the captured step moves every shift by peer copy.
TEST_P(RingShiftTest, CapturedShiftsEqualEagerOverTenThousandReplays) {
  const int n = GetParam();
  constexpr std::int64_t kCount = 16;
  HostWorld::run(n, [&](Communicator& comm) {
    const int r = comm.rank();
    const std::string who = "rank " + std::to_string(r) + " of " + std::to_string(n);
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    const Tensor x = ctx.persistent("x", {Shape{kCount}, DType::kFloat32});
    auto shift_three = [&] {
      Tensor t = ops::copy(ctx, x);
      for (int i = 0; i < 3; ++i) t = ops::ring_shift(ctx, comm, t);
      return t;
    };
    auto graph = CapturedStep::capture(ctx, [&] { return std::vector<Tensor>{shift_three()}; },
                                       {.pool_report_policy = PoolReportPolicy::kError, .communicators = {&comm}});
    const int source = ((r - 3) % n + n) % n;
    for (int step = 0; step < 10000; ++step) {
      const std::vector<float> mine = rank_values(r, step, kCount);
      ctx.copy_from_host(x, mine.data(), mine.size() * sizeof(float));
      const std::int64_t before = comm.window_transfers();
      graph->replay();
      ASSERT_EQ(comm.window_transfers() - before, 3) << who << " replay " << step;
      ASSERT_EQ(ctx.to_vector<float>(graph->outputs()[0]), rank_values(source, step, kCount))
          << who << " replay " << step;
      if (step % 2500 == 0) {
        const std::int64_t eager_before = comm.window_transfers();
        EXPECT_EQ(ctx.to_vector<float>(shift_three()), rank_values(source, step, kCount)) << who << " eager";
        EXPECT_EQ(comm.window_transfers(), eager_before) << who << ": an eager shift took a peer window";
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, RingShiftTest, ::testing::Values(2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& info) { return "n" + std::to_string(info.param); });

// Ranks whose traced shifts differ (one rank shifts twice, the others once)
// stop at capture with the uniformity check's Error on every rank.
TEST(RingShiftTest, RanksThatShiftDifferentlyAreRefusedAtCapture) {
  HostWorld::run(2, [](Communicator& comm) {
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    const Tensor x = ctx.persistent("x", {Shape{4}, DType::kFloat32});
    EXPECT_ERROR_CONTAINS(CapturedStep::capture(ctx,
                                                [&] {
                                                  Tensor t = ops::ring_shift(ctx, comm, x);
                                                  if (comm.rank() == 0) t = ops::ring_shift(ctx, comm, t);
                                                  return std::vector<Tensor>{t};
                                                },
                                                {.communicators = {&comm}}),
                          "would record different collectives");
  });
}

// A world without peer copies captures the same shifts through the mailbox.
TEST(RingShiftTest, WithoutPeerCopiesTheCapturedShiftUsesNoWindow) {
  HostWorld::run(
      2,
      [](Communicator& comm) {
        EXPECT_EQ(comm.peer_transport(), PeerTransport::kNccl);
        Context ctx(Device::kHost, 2);
        ctx.set_communication_stream(2);
        const Tensor x = ctx.persistent("x", {Shape{4}, DType::kFloat32});
        const std::vector<float> mine = rank_values(comm.rank(), 0, 4);
        ctx.copy_from_host(x, mine.data(), mine.size() * sizeof(float));
        auto graph = CapturedStep::capture(ctx, [&] { return std::vector<Tensor>{ops::ring_shift(ctx, comm, x)}; },
                                           {.communicators = {&comm}});
        graph->replay();
        EXPECT_EQ(ctx.to_vector<float>(graph->outputs()[0]), rank_values(1 - comm.rank(), 0, 4));
        EXPECT_EQ(comm.window_transfers(), 0);
      },
      HostWorld::kDefaultTimeout, /*peer_copies=*/false);
}

// A rank that stops replaying leaves its peer waiting on a flag: the wait
// ends with an Error after the world's timeout, not a hang.
TEST(RingShiftTest, APeerThatNeverPostsIsAnErrorWithinTheTimeout) {
  const auto start = std::chrono::steady_clock::now();
  EXPECT_ERROR_CONTAINS(HostWorld::run(
                            2,
                            [](Communicator& comm) {
                              Context ctx(Device::kHost, 2);
                              ctx.set_communication_stream(2);
                              const Tensor x = ctx.persistent("x", {Shape{4}, DType::kFloat32});
                              auto graph = CapturedStep::capture(
                                  ctx, [&] { return std::vector<Tensor>{ops::ring_shift(ctx, comm, x)}; },
                                  {.communicators = {&comm}});
                              graph->replay();
                              if (comm.rank() == 0) graph->replay();  // rank 1 never comes
                            },
                            500ms),
                        "never posted its flag");
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 30.0);
}

// The window's checks: a receive in another slot or of other bytes is an
// Error naming both, and a window's slots are found while it lives only.
TEST(PeerWindowTest, ReceiveTablesAreCheckedAndSlotsLiveWithTheirWindow) {
  std::vector<std::byte> pool0(64), pool1(64);
  std::vector<PeerWindow::Peer> peers(2);
  peers[0].receives = {{.slot = 7, .offset = 16, .bytes = 8}};
  peers[1].base = pool1.data();
  peers[1].receives = {{.slot = 7, .offset = 32, .bytes = 8}};
  int released = 0;
  {
    const auto window = PeerWindow::make(/*communicator=*/424242, /*rank=*/0, pool0.data(), 64, peers,
                                         [&] { ++released; });
    EXPECT_EQ(window->receive_address(1, 7, 8), pool1.data() + 32);
    EXPECT_ERROR_CONTAINS(window->receive_address(1, 8, 8), "receives nothing in this slot");
    EXPECT_ERROR_CONTAINS(window->receive_address(1, 7, 4), "sends 4 bytes but rank 1 receives 8");
    EXPECT_EQ(find_peer_window(424242, 7, pool0.data() + 16), window);
    EXPECT_EQ(find_peer_window(424242, 7, pool0.data() + 8), nullptr);  // not this slot's buffer
    EXPECT_EQ(find_peer_window(424243, 7, pool0.data() + 16), nullptr);
  }
  EXPECT_EQ(released, 1);
  EXPECT_EQ(find_peer_window(424242, 7, pool0.data() + 16), nullptr);
  const std::vector<PeerReceive> table = {{1, 2, 3}, {4, 5, 6}};
  const std::vector<PeerReceive> back = decode_peer_receives(encode_peer_receives(table), "test");
  ASSERT_EQ(back.size(), 2u);
  EXPECT_EQ(back[1].slot, 4);
  EXPECT_EQ(back[1].bytes, 6);
  EXPECT_ERROR_CONTAINS(decode_peer_receives("abc", "a table"), "a table", "not a whole number");
}

}  // namespace
}  // namespace stepgraph

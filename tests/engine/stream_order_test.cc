#include "engine/stream_order.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "engine/error.h"
#include "tests/support/expect_error.h"

namespace stepgraph {
namespace {

using Ids = std::vector<std::int64_t>;
using Waits = std::vector<StreamWait>;
using Clock = std::vector<std::int64_t>;

// Prepares and issues one instruction; returns the waits it needed.
Waits run(StreamOrder& order, int stream, const Ids& reads, const Ids& writes) {
  Waits waits = order.prepare(stream, reads, writes);
  order.issue(stream, reads, writes);
  return waits;
}

TEST(StreamOrderTest, SameStreamNeedsNoWaits) {
  StreamOrder order(2);
  EXPECT_EQ(run(order, 0, {}, {1}), Waits{});
  EXPECT_EQ(run(order, 0, {1}, {2}), Waits{});
  EXPECT_EQ(run(order, 0, {1, 2}, {1}), Waits{});
  EXPECT_EQ(run(order, 0, {}, {2}), Waits{});
  EXPECT_EQ(order.clock(0), (Clock{4, 0}));
  EXPECT_EQ(order.clock(1), (Clock{0, 0}));
}

TEST(StreamOrderTest, IssueCountsTokensPerStream) {
  StreamOrder order(2);
  EXPECT_EQ(order.stream_count(), 2);
  EXPECT_EQ(order.issue(0, {}, {}), 1);
  EXPECT_EQ(order.issue(1, {}, {}), 1);
  EXPECT_EQ(order.issue(0, {}, {}), 2);
  EXPECT_EQ(order.clock(0)[0], 2);
  EXPECT_EQ(order.clock(1)[1], 1);
}

TEST(StreamOrderTest, ReadAfterWriteWaitsForTheWriter) {
  StreamOrder order(2);
  run(order, 0, {}, {7});
  run(order, 0, {}, {8});
  EXPECT_EQ(run(order, 1, {7}, {}), (Waits{{1, 0, 1}}));
  // The waiter now knows stream 0's first instruction.
  EXPECT_EQ(order.clock(1), (Clock{1, 1}));
  EXPECT_EQ(run(order, 1, {7}, {}), Waits{});
  EXPECT_EQ(run(order, 1, {8}, {}), (Waits{{1, 0, 2}}));
}

TEST(StreamOrderTest, WriteAfterReadWaitsForEveryReadSinceTheWrite) {
  StreamOrder order(3);
  run(order, 0, {}, {5});
  run(order, 1, {5}, {});
  run(order, 2, {5}, {});
  run(order, 2, {5}, {});
  // The writer on stream 0 must wait for the last read on each other stream.
  EXPECT_EQ(run(order, 0, {}, {5}), (Waits{{0, 1, 1}, {0, 2, 2}}));
  // Reads before that write no longer matter: the next writer waits for the last writer only.
  EXPECT_EQ(run(order, 1, {}, {5}), (Waits{{1, 0, 2}}));
}

TEST(StreamOrderTest, ReadsOnTheWritersStreamNeedNoWait) {
  StreamOrder order(2);
  run(order, 1, {}, {5});
  run(order, 1, {5}, {});
  EXPECT_EQ(run(order, 1, {}, {5}), Waits{});
}

TEST(StreamOrderTest, WriteAfterWriteWaitsForTheLastWriter) {
  StreamOrder order(2);
  run(order, 0, {}, {3});
  run(order, 0, {}, {4});
  EXPECT_EQ(run(order, 1, {}, {3}), (Waits{{1, 0, 1}}));
  // An in-place update (read and write) on stream 0 waits for stream 1's write.
  EXPECT_EQ(run(order, 0, {3}, {3}), (Waits{{0, 1, 1}}));
}

TEST(StreamOrderTest, WaitsAlreadyImpliedAreSkipped) {
  StreamOrder order(2);
  run(order, 0, {}, {1});
  run(order, 0, {}, {2});
  EXPECT_EQ(run(order, 1, {2}, {}), (Waits{{1, 0, 2}}));
  // Stream 0's first instruction came before its second: already waited for.
  EXPECT_EQ(run(order, 1, {1}, {}), Waits{});
  EXPECT_EQ(run(order, 1, {}, {1}), Waits{});
}

TEST(StreamOrderTest, TransitiveWaitsAreSkipped) {
  StreamOrder order(3);
  const int a = 0, b = 1, c = 2;
  run(order, a, {}, {10});                                   // a:1 writes 10
  run(order, a, {}, {11});                                   // a:2 writes 11
  EXPECT_EQ(run(order, b, {11}, {12}), (Waits{{b, a, 2}}));  // b:1
  EXPECT_EQ(run(order, c, {12}, {}), (Waits{{c, b, 1}}));
  // c is ordered after b:1, which came after a:2: a's earlier writes need no wait.
  EXPECT_EQ(order.clock(c), (Clock{2, 1, 1}));
  EXPECT_EQ(run(order, c, {10, 11}, {}), Waits{});
}

TEST(StreamOrderTest, OneInstructionWaitsOnlyForTheLatestOfImpliedSignals) {
  StreamOrder order(3);
  const int a = 0, b = 1, c = 2;
  run(order, a, {}, {10});
  run(order, b, {10}, {20});  // b:1 after a:1
  // Reading both: waiting for b:1 covers a:1, whatever order the reads come in.
  EXPECT_EQ(run(order, c, {10, 20}, {}), (Waits{{c, b, 1}}));
  StreamOrder reversed(3);
  run(reversed, a, {}, {10});
  run(reversed, b, {10}, {20});
  EXPECT_EQ(run(reversed, c, {20, 10}, {}), (Waits{{c, b, 1}}));
}

TEST(StreamOrderTest, IndependentSignalsAreAllWaitedFor) {
  StreamOrder order(3);
  run(order, 1, {}, {1});
  run(order, 2, {}, {2});
  EXPECT_EQ(run(order, 0, {1, 2}, {}), (Waits{{0, 1, 1}, {0, 2, 1}}));
}

TEST(StreamOrderTest, OrderAfterWaitsForEverythingIssued) {
  StreamOrder order(2);
  EXPECT_EQ(order.order_after(1, 0), Waits{});  // nothing issued yet
  order.issue(0, {}, {});
  order.issue(0, {}, {});
  EXPECT_EQ(order.order_after(1, 0), (Waits{{1, 0, 2}}));
  EXPECT_EQ(order.clock(1), (Clock{2, 0}));
  EXPECT_EQ(order.order_after(1, 0), Waits{});  // already ordered
  EXPECT_EQ(order.order_after(0, 0), Waits{});
  order.issue(1, {}, {});
  EXPECT_EQ(order.order_after(0, 1), (Waits{{0, 1, 1}}));
  EXPECT_EQ(order.clock(0), (Clock{2, 1}));
}

TEST(StreamOrderTest, OrderAfterMakesLaterAccessesWaitFree) {
  StreamOrder order(2);
  run(order, 0, {}, {1});
  order.order_after(1, 0);  // a fork
  EXPECT_EQ(run(order, 1, {1}, {2}), Waits{});
  order.order_after(0, 1);  // a join
  EXPECT_EQ(run(order, 0, {2}, {1}), Waits{});
}

TEST(StreamOrderTest, ForgetDropsTheHistoryOfAValue) {
  StreamOrder order(2);
  run(order, 0, {}, {9});
  run(order, 0, {9}, {});
  order.forget(9);
  EXPECT_EQ(run(order, 1, {}, {9}), Waits{});
  order.forget(12345);  // unknown values are fine
}

TEST(StreamOrderTest, BadStreamIndexIsAnError) {
  StreamOrder order(2);
  const Ids none;
  try {
    order.prepare(2, none, none);
    FAIL() << "accepted stream 2";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(error.message().find("stream index 2"), std::string::npos) << error.message();
  }
  EXPECT_ERROR_CONTAINS(order.prepare(-1, none, none), "stream index -1 out of range", "has 2 streams");
  EXPECT_ERROR_CONTAINS(order.issue(2, none, none), "stream index 2 out of range");
  EXPECT_ERROR_CONTAINS(order.order_after(0, 2), "stream index 2 out of range");
  EXPECT_ERROR_CONTAINS(order.order_after(-1, 0), "stream index -1 out of range");
  EXPECT_ERROR_CONTAINS(order.clock(5), "stream index 5 out of range");
  EXPECT_ERROR_CONTAINS(StreamOrder{0}, "StreamOrder needs at least one stream, got 0");
}

TEST(StreamOrderTest, NegativeValueIdIsAnError) {
  StreamOrder order(1);
  EXPECT_ERROR_CONTAINS(order.prepare(0, Ids{-1}, Ids{}), "value ids must be >= 0", "-1");
  EXPECT_ERROR_CONTAINS(order.issue(0, Ids{}, Ids{-3}), "value ids must be >= 0", "-3");
}

}  // namespace
}  // namespace stepgraph

// The default host run (./bazelw run //trainer -- --device host): its loss,
// as the mean of the last kFloorWindow steps, ends within kFloorMargin nats of
// the Markov source's entropy rate, the floor no model can beat.
#include <gtest/gtest.h>

#include <iostream>
#include <sstream>

#include "trainer/options.h"
#include "trainer/train_loop.h"

namespace stepgraph::trainer {
namespace {

TEST(TrainerDefaultRunTest, HostDefaultsReachTheEntropyRate) {
  TrainerOptions defaults;
  defaults.device = Device::kHost;
  const TrainerOptions o = resolve_defaults(defaults, Device::kHost);
  std::ostringstream log;
  const TrainResult result = train(o, Device::kHost, log);
  std::cout << log.str();
  ASSERT_TRUE(result.entropy_rate.has_value());
  EXPECT_LE(result.final_mean_loss, *result.entropy_rate + kFloorMargin) << log.str();
  EXPECT_TRUE(result.floor_step.has_value()) << log.str();
}

}  // namespace
}  // namespace stepgraph::trainer

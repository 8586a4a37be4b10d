// What the tests that train a model on every rank of a host thread world
// against one process share: each rank trains one copy eagerly and one
// captured, side by side, and compares them with each other and with one
// process's losses; and the absolute closeness check of the parameters
// after the steps (each test file says why its tolerance holds).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "engine/context.h"
#include "graphs/captured_step.h"

namespace stepgraph::testing {

// Captures `graphed`'s step (the pool report an error), then for each step s
// of `want_losses`: load(s) writes both rigs' inputs, `eager`'s step runs and
// the graph replays. Their losses must be equal bit for bit (a fatal
// failure: wrap the call in ASSERT_NO_FATAL_FAILURE) and within 1e-5
// relative of one process's want_losses[s]. Failures name `who`.
template <typename Rig, typename Load>
void expect_steps_match_one_process(Context& ctx, Rig& eager, Rig& graphed, const std::vector<float>& want_losses,
                                    const std::string& who, const Load& load) {
  auto graph = CapturedStep::capture(
      ctx, [&] { return graphed.step(ctx); },
      {.pool_report_policy = PoolReportPolicy::kError, .communicators = graphed.step.communicators()});
  for (int s = 0; s < static_cast<int>(want_losses.size()); ++s) {
    load(s);
    const float eager_loss = ctx.to_vector<float>(eager.step(ctx)[0]).at(0);
    graph->replay();
    const float graph_loss = ctx.to_vector<float>(graph->outputs()[0]).at(0);
    ASSERT_EQ(std::memcmp(&eager_loss, &graph_loss, 4), 0) << who << " step " << s << ": graph != eager";
    EXPECT_NEAR(graph_loss, want_losses[s], 1e-5 * std::abs(want_losses[s])) << who << " step " << s;
  }
}

// Every element of `got` within `tolerance` of `want` (one process's).
inline void expect_within(const std::vector<float>& got, const std::vector<float>& want, float tolerance,
                          const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  float worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(got[i] - want[i]));
  EXPECT_LE(worst, tolerance) << what << ": largest difference to one process " << worst;
}

}  // namespace stepgraph::testing

// For the trainer tests that train one set of options on a host thread
// world: every rank's losses, their bits, the largest relative difference
// to a reference, and the check that every rank and both modes agree.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "engine/host_world.h"
#include "trainer/options.h"
#include "trainer/train_loop.h"

namespace stepgraph::trainer::testing {

struct WorldLosses {
  std::vector<std::vector<float>> losses;  // per rank
  std::string log;                         // rank 0's
};

// Trains the resolved options `o` on a host thread world of `ranks`.
inline WorldLosses train_ranks(const TrainerOptions& o, int ranks) {
  WorldLosses out;
  out.losses.resize(static_cast<std::size_t>(ranks));
  std::mutex mutex;
  HostWorld::run(ranks, [&](Communicator& comm) {
    std::ostringstream log;
    std::vector<float> losses = train(o, Device::kHost, log, &comm).losses;
    std::lock_guard lock(mutex);
    out.losses[static_cast<std::size_t>(comm.rank())] = std::move(losses);
    if (comm.rank() == 0) out.log = log.str();
  });
  return out;
}

inline std::vector<std::uint32_t> bits(const std::vector<float>& values) {
  std::vector<std::uint32_t> out(values.size());
  std::memcpy(out.data(), values.data(), values.size() * sizeof(float));
  return out;
}

inline double worst_relative(const std::vector<float>& got, const std::vector<float>& want) {
  EXPECT_EQ(got.size(), want.size());
  double worst = 0;
  for (std::size_t s = 0; s < std::min(got.size(), want.size()); ++s) {
    worst = std::max(worst, std::abs(static_cast<double>(got[s]) - want[s]) / std::abs(static_cast<double>(want[s])));
  }
  return worst;
}

// Trains `o` graphed and eager on `ranks`: every rank reports rank 0's loss,
// eager equals graph bit for bit on every rank, each run logs `steps`
// losses; returns the graphed run.
inline WorldLosses expect_every_rank_and_mode_agree(TrainerOptions o, int ranks, int steps) {
  o.mode = StepMode::kGraph;
  const WorldLosses graph = train_ranks(o, ranks);
  o.mode = StepMode::kEager;
  const WorldLosses eager = train_ranks(o, ranks);
  for (int r = 0; r < ranks; ++r) {
    EXPECT_EQ(bits(graph.losses[r]), bits(graph.losses[0])) << "rank " << r << " reports another loss than rank 0";
    EXPECT_EQ(bits(eager.losses[r]), bits(graph.losses[r])) << "rank " << r << ": eager and graph differ";
  }
  EXPECT_EQ(graph.losses[0].size(), static_cast<std::size_t>(steps));
  return graph;
}

}  // namespace stepgraph::trainer::testing

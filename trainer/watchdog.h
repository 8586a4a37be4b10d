// Watchdog: ends a rank whose step does not finish in time.
//
// On cuda a step's collectives run inside the step's graph: when a peer dies
// or stalls, the kernels wait for it and the host waits for the step's loss
// forever. A thread polls the communicator's health (ncclCommGetAsyncError)
// and the time since the last finished step; past the timeout it aborts the
// communicator (ncclCommAbort, so no peer waits on this rank either), prints
// what it was waiting for, naming the rank and the step (or the capture), and ends the
// process with status 3.
//
// Note [A bounded abort]
// ncclCommAbort can itself wait on the dead peer (its proxy thread, kernels
// of the step's graph still spinning on the device): on two H200s the
// survivor of a killed rank sat in it until the launcher killed it. The
// abort runs on a thread of its own and gets kAbortGrace; the process ends
// with status 3 then whether or not it returned.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>

#include "engine/communicator.h"

namespace stepgraph::trainer {

class Watchdog {
 public:
  static constexpr int kExitStatus = 3;
  static constexpr std::chrono::milliseconds kAbortGrace{1500};

  // `what`: the collectives a step holds, for the message.
  Watchdog(Communicator& comm, std::chrono::milliseconds timeout, std::string what);
  ~Watchdog();  // stops the thread; never throws
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // A phase that waits on the peers starts now ("step 12", "the capture") /
  // has finished.
  void start(std::string phase);
  void finish();

 private:
  void watch();

  Communicator& comm_;
  std::chrono::milliseconds timeout_;
  std::string what_;
  std::mutex mutex_;
  std::condition_variable stop_signal_;
  bool stop_ = false;
  std::string phase_;
  bool in_phase_ = false;
  std::chrono::steady_clock::time_point phase_start_;
  std::thread thread_;
};

}  // namespace stepgraph::trainer

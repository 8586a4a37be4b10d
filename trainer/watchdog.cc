#include "trainer/watchdog.h"

#include <cstdio>
#include <cstdlib>

#include "engine/error.h"

namespace stepgraph::trainer {

Watchdog::Watchdog(Communicator& comm, std::chrono::milliseconds timeout, std::string what)
    : comm_(comm), timeout_(timeout), what_(std::move(what)), thread_([this] { watch(); }) {}

Watchdog::~Watchdog() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  stop_signal_.notify_all();
  thread_.join();
}

void Watchdog::start(std::string phase) {
  std::lock_guard lock(mutex_);
  phase_ = std::move(phase);
  in_phase_ = true;
  phase_start_ = std::chrono::steady_clock::now();
}

void Watchdog::finish() {
  std::lock_guard lock(mutex_);
  in_phase_ = false;
}

void Watchdog::watch() {
  std::unique_lock lock(mutex_);
  while (!stop_signal_.wait_for(lock, std::chrono::milliseconds(100), [this] { return stop_; })) {
    std::string failure;
    try {
      comm_.check_health();
    } catch (const Error& error) {
      failure = error.message();
    }
    if (failure.empty() && in_phase_ && std::chrono::steady_clock::now() - phase_start_ > timeout_) {
      failure = detail::concat(phase_, " did not finish within ", timeout_.count() / 1000.0,
                               " s: a peer rank died or stalled in the step's collectives (", what_, ")");
    }
    if (failure.empty()) continue;
    std::fprintf(stderr, "trainer: rank %d: %s; aborting %s\n", comm_.rank(), failure.c_str(),
                 comm_.describe().c_str());
    std::fflush(stderr);
    comm_.abort(failure);
    std::_Exit(kExitStatus);  // the main thread may be blocked in the device for good
  }
}

}  // namespace stepgraph::trainer

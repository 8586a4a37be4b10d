#include "trainer/watchdog.h"

#include <cstdio>
#include <cstdlib>
#include <memory>

#include "engine/error.h"

namespace stepgraph::trainer {
namespace {

// See Note [A bounded abort]. The thread is never joined: the process ends.
void abort_within_grace(Communicator& comm, const std::string& reason) {
  struct Done {
    std::mutex mutex;
    std::condition_variable signal;
    bool done = false;
  };
  auto done = std::make_shared<Done>();
  std::thread([&comm, reason, done] {
    comm.abort(reason);
    std::lock_guard lock(done->mutex);
    done->done = true;
    done->signal.notify_all();
  }).detach();
  std::unique_lock lock(done->mutex);
  if (!done->signal.wait_for(lock, Watchdog::kAbortGrace, [&] { return done->done; })) {
    std::fprintf(stderr, "trainer: rank %d: the communicator's abort did not return within %.1f s; exiting without it\n",
                 comm.rank(), Watchdog::kAbortGrace.count() / 1000.0);
    std::fflush(stderr);
  }
}

}  // namespace

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
    abort_within_grace(comm_, failure);
    std::_Exit(kExitStatus);  // the main thread may be blocked in the device for good
  }
}

}  // namespace stepgraph::trainer

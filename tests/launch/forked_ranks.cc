#include "tests/launch/forked_ranks.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <exception>
#include <string>
#include <thread>

namespace stepgraph::testing {

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  socklen_t length = sizeof(address);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    ADD_FAILURE() << "cannot pick a free port";
  }
  ::close(fd);
  return ntohs(address.sin_port);
}

LaunchInfo rank_info(int rank, int world_size, int port) {
  LaunchInfo info;
  info.rank = rank;
  info.world_size = world_size;
  info.local_rank = rank;
  info.local_world_size = world_size;
  info.master_addr = "127.0.0.1";
  info.master_port = port;
  info.launcher = "torchrun";
  return info;
}

std::vector<int> run_processes(int count, const std::function<int(int)>& body, milliseconds limit) {
  std::fflush(nullptr);
  std::vector<pid_t> pids;
  for (int i = 0; i < count; ++i) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      int code = kUncaught;
      try {
        code = body(i);
      } catch (const std::exception& error) {
        std::fprintf(stderr, "process %d raised: %s\n", i, error.what());
      }
      std::fflush(nullptr);
      ::_exit(code);
    }
    if (pid < 0) ADD_FAILURE() << "fork failed";
    pids.push_back(pid);
  }
  std::vector<int> codes(pids.size(), -1);
  const Clock::time_point deadline = Clock::now() + limit;
  std::size_t left = pids.size();
  while (left > 0) {
    for (std::size_t i = 0; i < pids.size(); ++i) {
      if (codes[i] != -1 || pids[i] <= 0) continue;
      int status = 0;
      if (::waitpid(pids[i], &status, WNOHANG) == pids[i]) {
        codes[i] = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        --left;
      }
    }
    if (left > 0 && Clock::now() > deadline) {
      for (std::size_t i = 0; i < pids.size(); ++i) {
        if (codes[i] != -1 || pids[i] <= 0) continue;
        ::kill(pids[i], SIGKILL);
        ::waitpid(pids[i], nullptr, 0);
        codes[i] = kTimedOut;
      }
      break;
    }
    std::this_thread::sleep_for(milliseconds(5));
  }
  return codes;
}

void expect_all_succeeded(const std::vector<int>& codes) {
  for (std::size_t i = 0; i < codes.size(); ++i) {
    EXPECT_EQ(codes[i], 0) << "process " << i << (codes[i] == kTimedOut ? " hung and was killed" : " failed");
  }
}

int expect_error(const std::function<void()>& call, ErrorCode code, std::initializer_list<std::string_view> words) {
  try {
    call();
  } catch (const Error& error) {
    bool ok = error.code() == code;
    for (const std::string_view word : words) ok = ok && error.message().find(word) != std::string::npos;
    if (ok) return 0;
    std::fprintf(stderr, "pid %d: unexpected error (wanted code %s): %s\n", ::getpid(),
                 std::string(error_code_name(code)).c_str(), error.what());
    return 1;
  }
  std::fprintf(stderr, "pid %d: raised nothing\n", ::getpid());
  return 1;
}

}  // namespace stepgraph::testing

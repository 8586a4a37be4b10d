#include "trainer/distributed.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <map>
#include <sstream>
#include <thread>

#include "engine/error.h"
#include "engine/printable_text.h"
#include "launch/join.h"
#include "launch/rendezvous_secret.h"

namespace stepgraph::trainer {
namespace {

// A port of 127.0.0.1 free now (the kernel's choice for port 0).
int free_local_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  SG_CHECK_CODE(fd >= 0, ErrorCode::kIo, "--nproc-per-node: socket() failed: ", std::strerror(errno));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0;
  ::close(fd);
  SG_CHECK_CODE(ok, ErrorCode::kIo, "--nproc-per-node: no free port on 127.0.0.1: ", std::strerror(errno));
  return ntohs(address.sin_port);
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("was killed by signal ") + ::strsignal(WTERMSIG(status));
  return "ended";
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

[[noreturn]] void exec_worker(int rank, int nproc, int port, const std::string& secret, int restart,
                              const std::vector<std::string>& args) {
  const std::string r = std::to_string(rank);
  const std::string n = std::to_string(nproc);
  for (const auto& [name, value] : std::map<std::string, std::string>{{"RANK", r},
                                                                      {"LOCAL_RANK", r},
                                                                      {"WORLD_SIZE", n},
                                                                      {"LOCAL_WORLD_SIZE", n},
                                                                      {"MASTER_ADDR", "127.0.0.1"},
                                                                      {"MASTER_PORT", std::to_string(port)},
                                                                      {kLocalWorkerVariable, "1"},
                                                                      {kRestartVariable, std::to_string(restart)}}) {
    ::setenv(name.c_str(), value.c_str(), 1);
  }
  // The run's secret reaches the ranks in their environment, never their
  // command line (which every user of the host can read in ps).
  ::setenv(kSecretVariable, secret.c_str(), 1);
  ::unsetenv(kSecretFileVariable);
  // NVLink multicast stays off in every process (shared hosts), unless the caller chose.
  ::setenv("NCCL_NVLS_ENABLE", "0", 0);
  ::setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1", 0);
  ::setenv("NVSHMEM_DISABLE_NVLS", "1", 0);
  std::vector<char*> argv;
  std::string self = "/proc/self/exe";
  argv.push_back(self.data());
  for (const std::string& arg : args) argv.push_back(const_cast<char*>(arg.c_str()));
  argv.push_back(nullptr);
  ::execv("/proc/self/exe", argv.data());
  std::fprintf(stderr, "trainer: rank %d: exec of /proc/self/exe failed: %s\n", rank, std::strerror(errno));
  std::_Exit(127);
}

// Beyond --comm-timeout: a survivor's watchdog poll and bounded abort.
constexpr std::chrono::milliseconds kWorkerExitGrace{5000};

// One start of every rank; the first failure's exit code, 0 when all succeeded.
int run_workers_once(int nproc, const std::vector<std::string>& args, std::chrono::milliseconds timeout, int restart,
                     std::ostream& err) {
  const int port = free_local_port();
  const std::string secret = make_rendezvous_secret();
  std::map<pid_t, int> running;  // pid -> rank
  for (int rank = 0; rank < nproc; ++rank) {
    const pid_t pid = ::fork();
    SG_CHECK_CODE(pid >= 0, ErrorCode::kIo, "--nproc-per-node: fork failed: ", std::strerror(errno));
    if (pid == 0) exec_worker(rank, nproc, port, secret, restart, args);
    running[pid] = rank;
  }
  int first_failure = 0;
  std::chrono::steady_clock::time_point deadline{};
  while (!running.empty()) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid > 0 && running.count(pid) > 0) {
      const int rank = running[pid];
      running.erase(pid);
      if (exit_code_of(status) != 0) {
        err << "trainer: rank " << rank << " " << describe_status(status) << "\n";
        if (first_failure == 0) {
          first_failure = exit_code_of(status);
          // The others' watchdogs end them within the timeout and their
          // abort's grace (Note [A bounded abort] in trainer/watchdog.h);
          // only a rank past that is killed.
          deadline = std::chrono::steady_clock::now() + timeout + kWorkerExitGrace;
        }
      }
      continue;
    }
    if (first_failure != 0 && std::chrono::steady_clock::now() > deadline) {
      for (const auto& [stuck, rank] : running) {
        err << "trainer: rank " << rank << " did not end within "
            << std::chrono::duration<double>(timeout + kWorkerExitGrace).count()
            << " s after another rank failed; killing it\n";
        ::kill(stuck, SIGKILL);
      }
      deadline = std::chrono::steady_clock::time_point::max();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return first_failure;
}

}  // namespace

int run_local_workers(int nproc, const std::vector<std::string>& args, std::chrono::milliseconds timeout,
                      int max_restarts, std::ostream& err) {
  SG_CHECK(nproc >= 1, "--nproc-per-node must be >= 1, got ", nproc);
  SG_CHECK(max_restarts >= 0, "--max-restarts must be >= 0, got ", max_restarts);
  SG_CHECK(launch_info_from_env().launcher == "none",
           "--nproc-per-node starts the ranks itself, but this process "
           "was started by a launcher (",
           describe(launch_info_from_env()), "); leave out --nproc-per-node");
  for (int restart = 0;; ++restart) {
    const int status = run_workers_once(nproc, args, timeout, restart, err);
    // A run that ended, or one refused for its flags (which a restart would refuse again).
    if (status == 0 || status == kInvalidArgumentExit || restart >= max_restarts) return status;
    err << "trainer: restarting every rank (restart " << restart + 1 << " of " << max_restarts
        << "): each resumes from the newest complete checkpoint\n";
  }
}

int restart_count_from_env() {
  for (const char* name : {kRestartVariable, "TORCHELASTIC_RESTART_COUNT"}) {
    const char* value = std::getenv(name);
    if (value == nullptr) continue;
    const std::string text(value);
    int count = 0;
    const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), count);
    SG_CHECK(error == std::errc{} && end == text.data() + text.size() && count >= 0 && !text.empty(), name, " is ",
             quoted(text, 40), ", not a restart count (a decimal >= 0)");
    return count;
  }
  return 0;
}

World join_world(Device device, std::chrono::milliseconds timeout) {
  JoinedWorld joined = stepgraph::join_world(device, "stepgraph-trainer", timeout);
  return {joined.launch, std::move(joined.comm)};
}

void check_same_flags(Communicator& comm, const std::map<std::string, std::string>& config) {
  std::ostringstream mine;
  for (const auto& [key, value] : config) mine << key << '\t' << value << '\n';
  const std::vector<std::string> all = comm.exchange(mine.str(), "trainer flags");
  using Config = std::map<std::string, std::string>;
  auto parse = [](const std::string& text) {
    Config parsed;
    std::istringstream in(text);
    std::string line;
    while (std::getline(in, line)) {
      const auto tab = line.find('\t');
      parsed[line.substr(0, tab)] = tab == std::string::npos ? "" : line.substr(tab + 1);
    }
    return parsed;
  };
  const Config reference = parse(all[0]);
  for (std::size_t r = 1; r < all.size(); ++r) {
    const Config other = parse(all[r]);
    for (const auto& [key, value] : reference) {
      const auto it = other.find(key);
      const std::string theirs = it == other.end() ? "(not set)" : it->second;
      if (theirs == value) continue;
      const std::string flag = key.rfind("config.", 0) == 0 ? "--" + key.substr(7) : key;
      SG_THROW(ErrorCode::kInvalidArgument, "the ranks were started with different flags: ", flag, " is ", value,
               " on rank 0 but ", theirs, " on rank ", r, "; start every rank with the same model and step flags");
    }
    SG_CHECK(other.size() == reference.size(), "the ranks were started with different flags: rank ", r, " has ",
             other.size(), " settings, rank 0 has ", reference.size());
  }
}

}  // namespace stepgraph::trainer

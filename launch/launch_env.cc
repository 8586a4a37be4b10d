#include "launch/launch_env.h"

#include <charconv>
#include <cstdlib>
#include <initializer_list>
#include <vector>

#include "engine/error.h"
#include "launch/rendezvous_secret.h"

namespace stepgraph {
namespace {

constexpr int kDefaultPort = 29500;

// One launcher's variable names: rank, world size, local rank, local world size.
struct Convention {
  const char* launcher;
  const char* rank;
  const char* world_size;
  const char* local_rank;
  const char* local_world_size;
  const char* how_to_launch;  // for the message when the set is partial
};

constexpr Convention kTorchrun{"torchrun",         "RANK",
                               "WORLD_SIZE",       "LOCAL_RANK",
                               "LOCAL_WORLD_SIZE", "torchrun sets all four; a hand-made launch must set them too"};
constexpr Convention kMpirun{"mpirun",
                             "OMPI_COMM_WORLD_RANK",
                             "OMPI_COMM_WORLD_SIZE",
                             "OMPI_COMM_WORLD_LOCAL_RANK",
                             "OMPI_COMM_WORLD_LOCAL_SIZE",
                             "Open MPI's mpirun sets all four"};

// "NAME=value" as every message names a variable.
std::string named(std::string_view name, std::string_view value) { return detail::concat(name, "='", value, "'"); }

std::string join(const std::vector<std::string>& parts) {
  std::string out;
  for (const std::string& part : parts) out += (out.empty() ? "" : ", ") + part;
  return out;
}

int parse_int(std::string_view name, std::string_view value) {
  int parsed = 0;
  const char* const end = value.data() + value.size();
  const auto [stop, status] = std::from_chars(value.data(), end, parsed);
  SG_CHECK(status == std::errc() && stop == end && !value.empty(), named(name, value),
           " is not an integer; fix or unset ", name);
  return parsed;
}

int read_int(const EnvLookup& env, const char* name) {
  const std::optional<std::string> value = env(name);
  SG_CHECK(value.has_value(), name, " is not set");  // callers check presence first
  return parse_int(name, *value);
}

// The launcher's variables must come together: all of `names` or none.
void check_complete(const EnvLookup& env, std::string_view launcher, std::initializer_list<const char*> names,
                    std::string_view how_to_launch) {
  std::vector<std::string> set;
  std::vector<std::string> missing;
  for (const char* name : names) {
    if (const std::optional<std::string> value = env(name)) {
      set.push_back(named(name, *value));
    } else {
      missing.push_back(name);
    }
  }
  SG_CHECK(missing.empty(), launcher, " variables are partly set: ", join(set), " ", (set.size() == 1 ? "is" : "are"),
           " set but ", join(missing), " ", (missing.size() == 1 ? "is" : "are"), " not; ", how_to_launch);
}

bool any_set(const EnvLookup& env, std::initializer_list<const char*> names) {
  for (const char* name : names) {
    if (env(name).has_value()) return true;
  }
  return false;
}

// SLURM_TASKS_PER_NODE: "2(x3),1" means 2 tasks on each of the first 3 nodes, then 1.
// Returns the count of node `node` (the first when `node` is nullopt).
int tasks_on_node(std::string_view name, std::string_view value, std::optional<int> node) {
  const auto number = [&](std::string_view digits) {
    int parsed = 0;
    const char* const end = digits.data() + digits.size();
    const auto [stop, status] = std::from_chars(digits.data(), end, parsed);
    SG_CHECK(status == std::errc() && stop == end && !digits.empty(), named(name, value),
             " is not a Slurm task count list like '2(x3),1'");
    return parsed;
  };
  int index = 0;
  std::string_view rest = value;
  while (true) {
    const std::size_t comma = rest.find(',');
    const std::string_view entry = rest.substr(0, comma);
    const std::size_t paren = entry.find('(');
    const int count = number(entry.substr(0, paren));
    int repeat = 1;
    if (paren != std::string_view::npos) {
      const std::string_view times = entry.substr(paren);
      SG_CHECK(times.size() > 3 && times.substr(0, 2) == "(x" && times.back() == ')', named(name, value),
               " is not a Slurm task count list like '2(x3),1'");
      repeat = number(times.substr(2, times.size() - 3));
    }
    SG_CHECK(count >= 1 && repeat >= 1, named(name, value), " has a count below 1");
    if (!node.has_value() || *node < index + repeat) return count;
    index += repeat;
    SG_CHECK(comma != std::string_view::npos, named(name, value), " has ", index, " nodes but SLURM_NODEID is ", *node);
    rest = rest.substr(comma + 1);
  }
}

// The first host of a Slurm node list when it is a plain hostname ("gpu07" or
// "gpu07,gpu09"); nullopt for a compressed range ("gpu[07-09]").
std::optional<std::string> first_plain_host(std::string_view list) {
  const std::string_view first = list.substr(0, list.find(','));
  if (first.empty() || first.find('[') != std::string_view::npos) return std::nullopt;
  return std::string(first);
}

LaunchInfo read_convention(const EnvLookup& env, const Convention& names) {
  check_complete(env, names.launcher, {names.rank, names.world_size, names.local_rank, names.local_world_size},
                 names.how_to_launch);
  LaunchInfo info;
  info.launcher = names.launcher;
  info.rank = read_int(env, names.rank);
  info.world_size = read_int(env, names.world_size);
  info.local_rank = read_int(env, names.local_rank);
  info.local_world_size = read_int(env, names.local_world_size);
  return info;
}

LaunchInfo read_slurm(const EnvLookup& env) {
  check_complete(env, "Slurm", {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"},
                 "start every rank with srun, which sets SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID");
  LaunchInfo info;
  info.launcher = "slurm";
  info.rank = read_int(env, "SLURM_PROCID");
  info.world_size = read_int(env, "SLURM_NTASKS");
  info.local_rank = read_int(env, "SLURM_LOCALID");
  if (env("SLURM_NTASKS_PER_NODE").has_value()) {
    info.local_world_size = read_int(env, "SLURM_NTASKS_PER_NODE");
  } else {
    const std::optional<std::string> per_node = env("SLURM_TASKS_PER_NODE");
    SG_CHECK(per_node.has_value(), "Slurm variables are partly set: SLURM_PROCID is set but neither ",
             "SLURM_NTASKS_PER_NODE nor SLURM_TASKS_PER_NODE is; start every rank with srun");
    // On a run whose nodes hold different task counts, this node's own count.
    std::optional<int> node;
    if (env("SLURM_NODEID").has_value()) node = read_int(env, "SLURM_NODEID");
    SG_CHECK(!node.has_value() || *node >= 0, "SLURM_NODEID='", *node, "' is negative");
    info.local_world_size = tasks_on_node("SLURM_TASKS_PER_NODE", *per_node, node);
  }
  return info;
}

// "RANK='4'" as the environment has it (for Slurm's task list, the whole list).
std::string shown(const EnvLookup& env, const char* name, int value) {
  const std::optional<std::string> raw = env(name);
  return raw.has_value() ? named(name, *raw) : detail::concat(name, " ", value);
}

void check_ranks(const LaunchInfo& info, const Convention& names, const EnvLookup& env) {
  const std::string world = shown(env, names.world_size, info.world_size);
  const std::string local_world = shown(env, names.local_world_size, info.local_world_size);
  SG_CHECK(info.world_size >= 1, world, " must be at least 1");
  SG_CHECK(info.rank >= 0 && info.rank < info.world_size, shown(env, names.rank, info.rank), " is outside [0, ",
           info.world_size, ") given ", world);
  SG_CHECK(info.local_world_size >= 1 && info.local_world_size <= info.world_size, local_world, " gives ",
           info.local_world_size, " processes on this host, outside [1, ", info.world_size, "] given ", world);
  SG_CHECK(info.local_rank >= 0 && info.local_rank < info.local_world_size,
           shown(env, names.local_rank, info.local_rank), " is outside [0, ", info.local_world_size, ") given ",
           local_world);
}

}  // namespace

EnvLookup process_env() {
  return [](std::string_view name) -> std::optional<std::string> {
    const char* value = std::getenv(std::string(name).c_str());
    if (value == nullptr) return std::nullopt;
    return std::string(value);
  };
}

LaunchInfo launch_info_from_env(const EnvLookup& env) {
  LaunchInfo info;
  Convention names{"none", "rank", "world size", "local rank", "local world size", ""};
  if (any_set(env, {kTorchrun.rank, kTorchrun.world_size, kTorchrun.local_rank, kTorchrun.local_world_size})) {
    info = read_convention(env, kTorchrun);
    names = kTorchrun;
  } else if (env("SLURM_PROCID").has_value()) {
    // srun sets SLURM_PROCID for each task; salloc and sbatch set SLURM_NTASKS
    // and the node lists too, so those alone are no multi-process launch.
    info = read_slurm(env);
    names = {"slurm",
             "SLURM_PROCID",
             "SLURM_NTASKS",
             "SLURM_LOCALID",
             env("SLURM_NTASKS_PER_NODE").has_value() ? "SLURM_NTASKS_PER_NODE" : "SLURM_TASKS_PER_NODE",
             ""};
  } else if (any_set(env, {kMpirun.rank, kMpirun.world_size, kMpirun.local_rank, kMpirun.local_world_size})) {
    info = read_convention(env, kMpirun);
    names = kMpirun;
  }
  check_ranks(info, names, env);

  if (const std::optional<std::string> port = env("MASTER_PORT")) {
    info.master_port = parse_int("MASTER_PORT", *port);
    SG_CHECK(info.master_port >= 1 && info.master_port <= 65535, named("MASTER_PORT", *port), " is outside [1, 65535]");
  } else {
    info.master_port = kDefaultPort;
  }
  // torchrun's agent keeps its own store listening on MASTER_PORT when it
  // shares it with the workers (TORCHELASTIC_USE_AGENT_STORE=True, its
  // default; seen on the H100 machines): our rendezvous then meets one port
  // up. STEPGRAPH_RENDEZVOUS_PORT chooses the port outright.
  const std::optional<std::string> agent_store = env("TORCHELASTIC_USE_AGENT_STORE");
  if (info.launcher == "torchrun" && agent_store.has_value() && *agent_store == "True") {
    info.master_port = info.master_port == 65535 ? info.master_port - 1 : info.master_port + 1;
  }
  if (const std::optional<std::string> port = env("STEPGRAPH_RENDEZVOUS_PORT")) {
    info.master_port = parse_int("STEPGRAPH_RENDEZVOUS_PORT", *port);
    SG_CHECK(info.master_port >= 1 && info.master_port <= 65535, named("STEPGRAPH_RENDEZVOUS_PORT", *port),
             " is outside [1, 65535]");
  }

  const bool one_host = info.world_size == info.local_world_size;
  if (const std::optional<std::string> addr = env("MASTER_ADDR")) {
    SG_CHECK(!addr->empty(), "MASTER_ADDR is set but empty; set it to the host of rank 0");
    info.master_addr = *addr;
  } else if (info.launcher == "slurm") {
    const char* list_name = env("SLURM_STEP_NODELIST").has_value() ? "SLURM_STEP_NODELIST" : "SLURM_NODELIST";
    const std::optional<std::string> list = env(list_name);
    const std::optional<std::string> host = list.has_value() ? first_plain_host(*list) : std::nullopt;
    SG_CHECK(host.has_value(), "MASTER_ADDR is not set and ",
             (list.has_value() ? named(list_name, *list) + " is no plain hostname"
                               : std::string("neither SLURM_STEP_NODELIST nor SLURM_NODELIST is set")),
             "; set MASTER_ADDR to the host of rank 0, e.g. "
             "MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)");
    info.master_addr = *host;
  } else {
    // One host: rank 0 is on this host. Several: there is no address to guess.
    SG_CHECK(one_host, "MASTER_ADDR is not set but the ", info.launcher, " run spans several hosts (world size ",
             info.world_size, ", ", info.local_world_size, " per host); set MASTER_ADDR to the host of rank 0");
  }
  // A world of one never meets anyone: its secret is not needed (nor checked).
  if (info.world_size > 1) info.secret = rendezvous_secret_from_env(env);
  return info;
}

std::string describe(const LaunchInfo& info) {
  if (info.launcher == "none" && info.world_size == 1) return "a single process (rank 0 of 1, no launcher)";
  return detail::concat("rank ", info.rank, " of ", info.world_size, " (local ", info.local_rank, " of ",
                        info.local_world_size, ") via ", info.launcher, ", rendezvous ", info.master_addr, ":",
                        info.master_port);
}

}  // namespace stepgraph

#include "train/expert_data_parallel_groups.h"

#include <sstream>
#include <string>
#include <vector>

#include "engine/error.h"

namespace stepgraph {

ExpertDataParallelGroups split_expert_data_parallel(Communicator& world, int expert_parallel) {
  const int w = world.rank();
  SG_CHECK(expert_parallel >= 1 && world.world_size() % expert_parallel == 0,
           "split_expert_data_parallel: the expert-parallel size (", expert_parallel, ") must be >= 1 and divide ",
           world.describe(), "'s ", world.world_size(), " ranks");
  ExpertDataParallelGroups out;
  out.expert_parallel = world.split(w / expert_parallel, w, "ep");
  out.expert_data_parallel = world.split(w % expert_parallel, w, "edp");
  return out;
}

namespace {

// This rank's place in its two groups, as exchanged over the world.
struct Place {
  int ep_rank = 0, ep_size = 0, edp_rank = 0, edp_size = 0;
};

std::string encode(const Place& p) {
  std::ostringstream out;
  out << p.ep_rank << ' ' << p.ep_size << ' ' << p.edp_rank << ' ' << p.edp_size;
  return out.str();
}

Place decode(const std::string& text) {
  Place p;
  std::istringstream in(text);
  in >> p.ep_rank >> p.ep_size >> p.edp_rank >> p.edp_size;
  return p;
}

// What is wrong with every rank's places (the same verdict on every rank,
// since every rank reads the same list), or "".
std::string check_places(const std::vector<Place>& places, const Communicator& world) {
  const int ranks = static_cast<int>(places.size());
  const int ep = places[0].ep_size;
  for (int w = 0; w < ranks; ++w) {
    const Place& p = places[w];
    if (p.ep_size != ep || p.ep_size * p.edp_size != ranks) {
      return detail::concat("data_parallel (", world.name(), ", ", ranks,
                            " ranks) must be the expert-parallel group times expert_data_parallel, EP x DP ranks; "
                            "its rank ", w, " has an expert-parallel group of ", p.ep_size,
                            " and an expert_data_parallel of ", p.edp_size, " (rank 0's expert-parallel group: ", ep,
                            "); split the world with split_expert_data_parallel");
    }
    if (p.ep_rank != w % ep || p.edp_rank != w / ep) {
      return detail::concat("data_parallel's rank ", w, " is rank ", p.ep_rank,
                            " of the model's expert-parallel group and rank ", p.edp_rank,
                            " of expert_data_parallel, but expert parallelism is innermost: world rank w is rank "
                            "w % EP of its replica's expert-parallel group and rank w / EP of its "
                            "expert_data_parallel, here ",
                            w % ep, " and ", w / ep, " (EP = ", ep, "); split the world with split_expert_data_parallel");
    }
  }
  return "";
}

// The world ranks of `group`'s members must be `want` in order, or "".
std::string check_members(Communicator& group, int world_rank, const std::vector<int>& want, std::string_view arg,
                          std::string_view holds) {
  const std::vector<std::string> got = group.exchange(std::to_string(world_rank), "expert x data-parallel members");
  std::vector<int> members;
  for (const std::string& text : got) members.push_back(std::stoi(text));
  if (members == want) return "";
  std::ostringstream out;
  out << arg << " (" << group.describe() << ") must hold " << holds << ", data_parallel ranks [";
  for (std::size_t i = 0; i < want.size(); ++i) out << (i > 0 ? ", " : "") << want[i];
  out << "], but holds [";
  for (std::size_t i = 0; i < members.size(); ++i) out << (i > 0 ? ", " : "") << members[i];
  out << "]; split the world with split_expert_data_parallel";
  return out.str();
}

}  // namespace

void check_expert_data_parallel_layout(Communicator& data_parallel, Communicator& expert_parallel,
                                       Communicator& expert_data_parallel, std::string_view who) {
  const int w = data_parallel.rank();
  const Place mine{expert_parallel.rank(), expert_parallel.world_size(), expert_data_parallel.rank(),
                   expert_data_parallel.world_size()};
  std::vector<Place> places;
  for (const std::string& text : data_parallel.exchange(encode(mine), "expert x data-parallel layout")) {
    places.push_back(decode(text));
  }
  const std::string wrong = check_places(places, data_parallel);
  SG_CHECK(wrong.empty(), who, ": ", wrong);
  // Every rank's place is right; the groups must also hold the right ranks
  // (a group of the right size and ranks may still mix replicas).
  const int ep = mine.ep_size;
  const int replicas = mine.edp_size;
  std::vector<int> replica, same_experts;
  for (int i = 0; i < ep; ++i) replica.push_back((w / ep) * ep + i);
  for (int d = 0; d < replicas; ++d) same_experts.push_back(w % ep + d * ep);
  std::string found = check_members(expert_parallel, w, replica, "the model's expert-parallel group",
                                    detail::concat("this rank's replica (", w / ep, ")"));
  const std::string edp = check_members(expert_data_parallel, w, same_experts, "expert_data_parallel",
                                        detail::concat("the ranks with this rank's experts (EP rank ", w % ep, ")"));
  if (found.empty()) found = edp;
  // Each group saw only its own members: share the verdicts, so that every
  // rank refuses with the same message.
  const std::vector<std::string> verdicts = data_parallel.exchange(found, "expert x data-parallel verdict");
  for (std::size_t r = 0; r < verdicts.size(); ++r) {
    SG_CHECK(verdicts[r].empty(), who, ": ", verdicts[r], " (found on data_parallel rank ", r, ")");
  }
}

}  // namespace stepgraph

#include "graphs/collective_check.h"

#include <algorithm>
#include <sstream>
#include <string>

#include "engine/error.h"

namespace stepgraph {
namespace {

// One collective of this rank's program, as the ranks exchange it: one line,
// "<peer>\t<description>\t<where>", where peer is -1 for a group collective.
struct Entry {
  int peer = -1;
  std::string op;           // "send", "recv", or another collective's name
  std::string description;  // what the other side must equal
  std::string where;        // instruction and value, for the message
};

std::string describe_metas(const Program& program, const std::vector<ValueId>& ids) {
  std::string text;
  for (ValueId id : ids) {
    const TensorMeta& meta = program.value(id).meta;
    text += detail::concat(text.empty() ? "" : ", ", meta.shape.to_string(), " ", dtype_name(meta.dtype));
  }
  return text;
}

std::vector<Entry> entries_for(const Program& program, std::uint64_t communicator) {
  std::vector<Entry> entries;
  const auto& instructions = program.instructions();
  for (std::size_t i = 0; i < instructions.size(); ++i) {
    const Instruction& instruction = instructions[i];
    if (instruction.op->collective == nullptr) continue;
    const CollectiveCall call = instruction.op->collective(instruction.params);
    if (call.communicator != communicator) continue;
    const ValueId named = !instruction.inputs.empty() ? instruction.inputs[0] : instruction.outputs.at(0);
    const std::string where = detail::concat("instruction ", i, ", value '", program.value(named).name, "'");
    if (!call.point_to_point()) {
      const std::string metas = describe_metas(program, instruction.inputs);
      entries.push_back({-1, std::string(instruction.op->name),
                         detail::concat(instruction.op->name, "(", metas, ") ", call.signature), where});
      continue;
    }
    // A send is matched with its receive: both are described by the bytes moved.
    if (call.send_to >= 0) {
      entries.push_back({call.send_to, "send",
                         detail::concat("[", describe_metas(program, instruction.inputs), "] ", call.signature),
                         where});
    }
    if (call.recv_from >= 0) {
      entries.push_back({call.recv_from, "recv",
                         detail::concat("[", describe_metas(program, instruction.outputs), "] ", call.signature),
                         where});
    }
  }
  return entries;
}

// Tabs and newlines separate fields and entries: none may appear inside one.
std::string field(std::string text) {
  std::replace_if(
      text.begin(), text.end(), [](char c) { return c == '\t' || c == '\n'; }, ' ');
  return text;
}

std::string encode(const std::vector<Entry>& entries) {
  std::string text;
  for (const Entry& e : entries) {
    text += detail::concat(e.peer, '\t', field(e.op), '\t', field(e.description), '\t', field(e.where), '\n');
  }
  return text;
}

std::vector<Entry> decode(const std::string& text) {
  std::vector<Entry> entries;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    Entry e;
    std::istringstream fields(line);
    std::string peer;
    std::getline(fields, peer, '\t');
    std::getline(fields, e.op, '\t');
    std::getline(fields, e.description, '\t');
    std::getline(fields, e.where, '\t');
    e.peer = std::stoi(peer);
    entries.push_back(std::move(e));
  }
  return entries;
}

std::vector<Entry> group_only(const std::vector<Entry>& entries) {
  std::vector<Entry> out;
  std::copy_if(entries.begin(), entries.end(), std::back_inserter(out), [](const Entry& e) { return e.peer < 0; });
  return out;
}

std::vector<Entry> p2p_of(const std::vector<Entry>& entries, std::string_view op, int peer) {
  std::vector<Entry> out;
  std::copy_if(entries.begin(), entries.end(), std::back_inserter(out),
               [&](const Entry& e) { return e.peer == peer && e.op == op; });
  return out;
}

std::string at(const std::vector<Entry>& entries, std::size_t k) {
  return k < entries.size() ? detail::concat(entries[k].description, " (", entries[k].where, ")")
                            : std::string("nothing (its list ends there)");
}

void compare(const Communicator& comm, const std::vector<std::vector<Entry>>& ranks) {
  const std::string intro = detail::concat("capture: the ranks of ", comm.describe(),
                                           " would record different "
                                           "collectives");
  const std::string advice =
      "; every rank must capture the same collectives in the same order (the same model, flags and step on every "
      "rank)";
  const std::vector<Entry> reference = group_only(ranks[0]);
  for (std::size_t r = 1; r < ranks.size(); ++r) {
    const std::vector<Entry> other = group_only(ranks[r]);
    const std::size_t n = std::max(reference.size(), other.size());
    for (std::size_t k = 0; k < n; ++k) {
      if (k < reference.size() && k < other.size() && reference[k].description == other[k].description) continue;
      SG_THROW(ErrorCode::kInvalidState, intro, ": collective #", k, " is ", at(reference, k), " on rank 0 but ",
               at(other, k), " on rank ", r, advice);
    }
  }
  for (std::size_t a = 0; a < ranks.size(); ++a) {
    for (std::size_t b = 0; b < ranks.size(); ++b) {
      if (a == b) continue;
      const std::vector<Entry> sends = p2p_of(ranks[a], "send", static_cast<int>(b));
      const std::vector<Entry> recvs = p2p_of(ranks[b], "recv", static_cast<int>(a));
      const std::size_t n = std::max(sends.size(), recvs.size());
      for (std::size_t k = 0; k < n; ++k) {
        if (k < sends.size() && k < recvs.size() && sends[k].description == recvs[k].description) continue;
        SG_THROW(ErrorCode::kInvalidState, intro, ": send #", k, " from rank ", a, " to rank ", b, " is ", at(sends, k),
                 " but the matching receive on rank ", b, " is ", at(recvs, k), advice);
      }
    }
  }
}

}  // namespace

std::vector<std::uint64_t> check_uniform_collectives(const Program& program,
                                                     const std::vector<Communicator*>& communicators) {
  std::vector<std::uint64_t> ids;
  for (const Communicator* comm : communicators) {
    SG_CHECK(comm != nullptr, "check_uniform_collectives: a null communicator");
    if (std::find(ids.begin(), ids.end(), comm->id()) == ids.end()) ids.push_back(comm->id());
  }
  for (const Instruction& instruction : program.instructions()) {
    if (instruction.op->collective == nullptr) continue;
    const std::uint64_t id = instruction.op->collective(instruction.params).communicator;
    if (std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(id);
  }
  std::vector<std::uint64_t> checked;
  for (std::uint64_t id : ids) {
    Communicator& comm = find_communicator(id);
    if (comm.world_size() == 1) continue;
    const std::vector<std::string> all = comm.exchange(encode(entries_for(program, id)), "capture uniformity");
    std::vector<std::vector<Entry>> ranks;
    for (const std::string& text : all) ranks.push_back(decode(text));
    compare(comm, ranks);
    checked.push_back(id);
  }
  return checked;
}

}  // namespace stepgraph

#include "checkpoint/checkpoint_set.h"

#include <fmt/format.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <system_error>

#include "engine/error.h"
#include "engine/logging.h"
#include "checkpoint/strict_decimal.h"

namespace stepgraph {
namespace {

constexpr std::string_view kChecksumPrefix = "fnv1a64:";
constexpr std::size_t kDigits = 16;
constexpr const char* kSetKey = "stepgraph.checkpoint_set";
constexpr const char* kSetVersion = "1";
constexpr const char* kStepKey = "stepgraph.step";
constexpr const char* kWorldKey = "stepgraph.world_size";

std::string rank_key(int rank) { return fmt::format("stepgraph.rank{}.checksum", rank); }

bool is_checksum(std::string_view text) {
  if (text.size() != kChecksumPrefix.size() + kDigits || text.substr(0, kChecksumPrefix.size()) != kChecksumPrefix) {
    return false;
  }
  for (const char c : text.substr(kChecksumPrefix.size())) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

[[noreturn]] void bad_manifest(const std::filesystem::path& path, const std::string& what) {
  SG_THROW(ErrorCode::kIo, "checkpoint ", path, " is not a valid manifest of per-rank checkpoint files: ", what);
}

// This rank's parts of steps up to `step` other than `keep`: the sets the
// committed manifest replaced (a later step's part may already be there).
void remove_older_parts(const std::filesystem::path& manifest, std::int64_t step, int rank, int ranks,
                        const std::filesystem::path& keep) {
  const std::filesystem::path directory =
      manifest.parent_path().empty() ? std::filesystem::path(".") : manifest.parent_path();
  const std::string prefix = manifest.filename().string() + ".step";
  const std::string suffix = fmt::format(".rank{}-of-{}.", rank, ranks);
  std::error_code error;
  std::filesystem::directory_iterator it(directory, error);
  for (; !error && it != std::filesystem::directory_iterator(); it.increment(error)) {
    const std::string name = it->path().filename().string();
    if (name.size() < prefix.size() + suffix.size() + kDigits + 1 || name.compare(0, prefix.size(), prefix) != 0 ||
        name == keep.filename().string()) {
      continue;
    }
    const std::size_t at = name.find(suffix, prefix.size());
    if (at == std::string::npos || name.size() != at + suffix.size() + kDigits) continue;
    const std::optional<std::uint64_t> saved =
        parse_decimal(std::string_view(name).substr(prefix.size(), at - prefix.size()),
                      static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()));
    if (!saved || static_cast<std::int64_t>(*saved) > step) continue;
    std::error_code removed;
    std::filesystem::remove(it->path(), removed);
    if (removed) logger().warn("cannot remove the old checkpoint part {}: {}", it->path().string(), removed.message());
  }
}

}  // namespace

std::filesystem::path checkpoint_set_part_path(const std::filesystem::path& manifest, std::int64_t step, int rank,
                                               int ranks, std::string_view checksum) {
  SG_CHECK_CODE(is_checksum(checksum), ErrorCode::kInternal, "checkpoint_set_part_path: ", printable(checksum),
                " is not a checksum");
  std::filesystem::path path = manifest;
  path += fmt::format(".step{}.rank{}-of-{}.{}", step, rank, ranks, checksum.substr(kChecksumPrefix.size()));
  return path;
}

void write_checkpoint_set(const std::filesystem::path& manifest, std::int64_t step, int rank, int ranks,
                          const Checkpoint& part, const ExchangeStrings& exchange, const SetWriteObserver& observer) {
  SG_CHECK(ranks >= 1 && rank >= 0 && rank < ranks && step >= 0, "write_checkpoint_set: rank ", rank, " of ", ranks,
           " at step ", step);
  // The part, named after its checksum once written.
  AtomicFile file(manifest, [&](WritePoint point) {
    if (observer) observer(SetFile::kPart, point);
  });
  const std::string checksum = write_checkpoint_to(file, part);
  const std::filesystem::path part_path = checkpoint_set_part_path(manifest, step, rank, ranks, checksum);
  file.commit_as(part_path);

  const std::vector<std::string> checksums = exchange ? exchange(checksum) : std::vector<std::string>{checksum};
  SG_CHECK_CODE(checksums.size() == static_cast<std::size_t>(ranks), ErrorCode::kInternal,
                "write_checkpoint_set: the exchange returned ", checksums.size(), " checksums for ", ranks, " ranks");
  Checkpoint index;
  index.metadata[kSetKey] = kSetVersion;
  index.metadata[kStepKey] = std::to_string(step);
  index.metadata[kWorldKey] = std::to_string(ranks);
  for (int r = 0; r < ranks; ++r) {
    SG_CHECK_CODE(is_checksum(checksums[static_cast<std::size_t>(r)]), ErrorCode::kIo, "rank ", r, " sent ",
                  printable(checksums[static_cast<std::size_t>(r)]), " as its checkpoint part's checksum");
    index.metadata[rank_key(r)] = checksums[static_cast<std::size_t>(r)];
  }
  write_checkpoint(manifest, index, [&](WritePoint point) {
    if (observer) observer(SetFile::kManifest, point);
  });
  remove_older_parts(manifest, step, rank, ranks, part_path);
}

CheckpointSetPart read_checkpoint_set_part(const std::filesystem::path& manifest, int rank, int ranks) {
  const Checkpoint index = read_checkpoint(manifest);
  if (index.metadata.count(kSetKey) == 0) {
    SG_THROW(ErrorCode::kIo, "checkpoint ", manifest,
             " is a single-file checkpoint, not the manifest of per-rank files (it was written by a run whose "
             "optimizer and model were not sharded: --dp-mode allreduce and --tp 1); resume with the flags that "
             "wrote it");
  }
  if (index.metadata.at(kSetKey) != kSetVersion) {
    bad_manifest(manifest, fmt::format("its format is {}, this StepGraph reads {}",
                                       printable(index.metadata.at(kSetKey)), kSetVersion));
  }
  if (!index.tensors.empty()) bad_manifest(manifest, fmt::format("it holds {} tensors", index.tensors.size()));
  const auto count = [&](const char* key, std::uint64_t max) {
    const auto it = index.metadata.find(key);
    if (it == index.metadata.end()) bad_manifest(manifest, fmt::format("it has no '{}'", key));
    const std::optional<std::uint64_t> value = parse_decimal(it->second, max);
    if (!value)
      bad_manifest(manifest, fmt::format("its '{}' is {}, not a count up to {}", key, printable(it->second), max));
    return *value;
  };
  const auto step =
      static_cast<std::int64_t>(count(kStepKey, static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())));
  const auto world = static_cast<int>(count(kWorldKey, static_cast<std::uint64_t>(std::numeric_limits<int>::max())));
  if (world < 1) bad_manifest(manifest, "its world size is 0");
  for (const auto& [key, value] : index.metadata) {
    if (key == kSetKey || key == kStepKey || key == kWorldKey) continue;
    bool known = false;
    for (int r = 0; r < world && !known; ++r) known = key == rank_key(r);
    if (!known) bad_manifest(manifest, fmt::format("it has an unknown entry {}", printable(key)));
    if (!is_checksum(value)) bad_manifest(manifest, fmt::format("{} is {}, not a checksum", key, printable(value)));
  }
  if (index.metadata.size() != static_cast<std::size_t>(world) + 3) {
    bad_manifest(manifest, fmt::format("it names {} checksums for {} ranks", index.metadata.size() - 3, world));
  }
  SG_CHECK_CODE(world == ranks, ErrorCode::kIo, "checkpoint ", manifest, " was written by ", world,
                " ranks, but this run has ", ranks, "; resume with ", world, " ranks");

  const std::string& checksum = index.metadata.at(rank_key(rank));
  CheckpointSetPart out;
  out.step = step;
  out.file = checkpoint_set_part_path(manifest, step, rank, ranks, checksum);
  std::error_code error;
  SG_CHECK_CODE(std::filesystem::exists(out.file, error), ErrorCode::kIo, "checkpoint ", manifest, " (step ", step,
                ") names ", out.file, " for rank ", rank,
                ", which does not exist (deleted, or on another host's disk)");
  out.checkpoint = read_checkpoint(out.file);
  SG_CHECK_CODE(out.checkpoint.checksum == checksum, ErrorCode::kIo, "checkpoint part ", out.file, " has checksum ",
                out.checkpoint.checksum, " but its manifest ", manifest, " names ", checksum,
                " (the part was replaced); resume from a complete set");
  return out;
}

}  // namespace stepgraph

// The C API's checkpoints (checkpoint/training_state.h): a language model's or
// residual stack's whole training state with its optimizer's, as one file or,
// where the ranks of a world hold different parts, as a per-rank set
// committed by a manifest (checkpoint/checkpoint_set.h).
#include <exception>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "capi/handles.h"
#include "capi/versioned_config.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/checkpoint_set.h"
#include "checkpoint/training_state.h"
#include "engine/printable_text.h"

namespace stepgraph::capi {
namespace {

// The size of each version of sg_checkpoint_config (index: version).
constexpr std::size_t kConfigSizes[] = {0, sizeof(sg_checkpoint_config)};
static_assert(std::size(kConfigSizes) - 1 == SG_CHECKPOINT_CONFIG_VERSION, "a new config version needs its size here");

// More entries than any script needs: a count past it is a wrong field.
constexpr std::size_t kMaxMetadataEntries = 65536;

sg_checkpoint_config default_config() { return SG_CHECKPOINT_CONFIG_INITIALIZER; }

sg_checkpoint_config read_config(const sg_checkpoint_config* config, const char* function) {
  require(config, function, "config");
  return read_versioned_config(*config, default_config(), kConfigSizes, SG_CHECKPOINT_CONFIG_MAGIC, function,
                               "sg_checkpoint_config",
                               "sg_checkpoint_config_default or SG_CHECKPOINT_CONFIG_INITIALIZER");
}

// What a checkpoint call saves or loads, from its handles.
struct Target {
  std::shared_ptr<sg_layer_s> layer;  // held for the call
  std::shared_ptr<OptimizerState> optimizer;
  std::shared_ptr<WorldState> world;  // null: this process alone
  ModelState model;
  bool per_rank = false;  // the ranks hold different parts: one file each and a manifest
  int rank = 0;
  int ranks = 1;
};

Target resolve(const char* function, sg_layer model, sg_optimizer optimizer, const char* path,
               const sg_checkpoint_config& config) {
  Target t;
  t.layer = handle_object(model, function, "model");
  t.optimizer = handle_object(optimizer, function, "optimizer")->state;
  require(path, function, "path");
  SG_CHECK(*path != '\0', function, ": path is empty; name the checkpoint's file");
  SG_CHECK(t.layer->ctx == t.optimizer->ctx, function, ": the model and the optimizer belong to different contexts");
  const ResidualStack* stack = nullptr;
  if (LanguageModel* language_model = language_model_of(*t.layer->layer)) {
    t.model = {language_model->parameters(), language_model->state()};
    stack = &language_model->stack();
  } else {
    SG_CHECK(t.layer->layer->kind() == "residual_stack", function, ": model is a ", t.layer->layer->kind(),
             " layer; checkpoints hold a language model's (sg_language_model_create) or a residual stack's "
             "(sg_residual_stack_create) state");
    ResidualStack& residual_stack = residual_stack_of(*t.layer);
    t.model = {residual_stack.parameters(), residual_stack.state()};
    stack = &residual_stack;
  }
  if (config.world != nullptr) t.world = handle_object(config.world, function, "config->world")->state;
  if (t.world != nullptr) {
    t.rank = t.world->launch.rank;
    t.ranks = t.world->launch.world_size;
  }
  // Ranks hold parts of their own where the optimizer or the model is sharded over them.
  const AdamW& adamw = *t.optimizer->adamw;
  const Communicator* sharding = adamw.sharding();
  const Communicator* tensor_parallel = stack->tensor_parallel();
  for (const Communicator* comm : {sharding, tensor_parallel}) {
    if (comm == nullptr || comm->world_size() == 1) continue;
    t.per_rank = true;
    const char* what = comm == sharding ? "the optimizer is sharded (ZeRO-1)" : "the model is tensor parallel";
    SG_CHECK(t.ranks % comm->world_size() == 0 && t.ranks > 1, function, ": ", what, " over ", comm->world_size(),
             " ranks, so each rank holds a part of the state, and config->world has ", t.ranks,
             " rank(s); pass the world of every rank that holds a part (the whole world: each rank writes and reads "
             "its own part)");
  }
  return t;
}

// The caller's metadata entries, checked.
std::map<std::string, std::string> read_metadata(const sg_checkpoint_config& config, const char* function) {
  std::map<std::string, std::string> metadata;
  if (config.metadata_count == 0) return metadata;
  SG_CHECK(config.metadata_count <= kMaxMetadataEntries, function, ": config->metadata_count is ",
           config.metadata_count, ", more than the ", kMaxMetadataEntries, " entries a checkpoint takes");
  require(config.metadata_keys, function, "config->metadata_keys");
  require(config.metadata_values, function, "config->metadata_values");
  for (std::size_t i = 0; i < config.metadata_count; ++i) {
    const std::string index = std::to_string(i);
    const char* key = config.metadata_keys[i];
    const char* value = config.metadata_values[i];
    require(key, function, ("config->metadata_keys[" + index + "]").c_str());
    require(value, function, ("config->metadata_values[" + index + "]").c_str());
    SG_CHECK(*key != '\0', function, ": config->metadata_keys[", i, "] is empty; give every entry a name");
    const std::string name(key);
    SG_CHECK(name != kCheckpointStepKey && name != kChecksumKey && name != kCheckpointSetKey, function,
             ": config->metadata_keys[", i, "] is ", quoted(name),
             ", an entry the library writes itself (the step, the checksum, a set's manifest); choose another key");
    SG_CHECK(metadata.emplace(name, value).second, function, ": config->metadata_keys[", i, "] ", quoted(name),
             " is given twice; give each key once");
  }
  return metadata;
}

void save(const char* function, const Target& t, const char* path, std::map<std::string, std::string> metadata) {
  Context& ctx = *t.optimizer->ctx;
  const AdamW& adamw = *t.optimizer->adamw;
  const std::int64_t step = steps_run(ctx, adamw);
  const Checkpoint state = save_training_state(ctx, t.model, adamw, std::move(metadata), step);
  if (t.ranks == 1) {
    write_checkpoint(path, state);
    return;
  }
  Communicator& comm = *t.world->comm;
  if (t.per_rank) {
    write_checkpoint_set(path, step, t.rank, t.ranks, state, [&comm](const std::string& checksum) {
      return comm.exchange(checksum, "checkpoint checksums");
    });
    return;
  }
  // Every rank holds the same state: rank 0 writes, and every rank returns
  // once the file is there (or with rank 0's error).
  std::exception_ptr failure;
  std::string word = "written";
  if (t.rank == 0) {
    try {
      write_checkpoint(path, state);
    } catch (const Error& error) {
      failure = std::current_exception();
      word = error.message();
    }
  }
  const std::vector<std::string> words = comm.exchange(word, "checkpoint written by rank 0");
  if (failure) std::rethrow_exception(failure);
  SG_CHECK_CODE(words.at(0) == "written", ErrorCode::kIo, function, ": rank 0 could not write the checkpoint: ",
                words.at(0));
}

Checkpoint read(const char* function, const Target& t, const char* path) {
  if (!t.per_rank) {
    Checkpoint checkpoint = read_checkpoint(path);
    // A set's manifest where this rank holds the whole state: most likely a ZeRO-1 run whose
    // optimizer is sharded only once its train step exists.
    SG_CHECK_CODE(checkpoint.metadata.count(kCheckpointSetKey) == 0, ErrorCode::kIo, function, ": ", path,
                  " is the manifest of per-rank parts (a ZeRO-1 optimizer's or a tensor-parallel model's), and this "
                  "rank's optimizer and model are not sharded: make the train step first (with zero1: it shards the "
                  "optimizer), or the model tensor parallel, then load with config->world");
    return checkpoint;
  }
  CheckpointSetPart part = read_checkpoint_set_part(path, t.rank, t.ranks);
  const std::int64_t step = checkpoint_step(part.checkpoint);
  SG_CHECK_CODE(step == part.step, ErrorCode::kIo, function, ": checkpoint part ", part.file, " is at step ", step,
                " but its manifest ", path, " is at step ", part.step);
  return std::move(part.checkpoint);
}

}  // namespace
}  // namespace stepgraph::capi

using namespace stepgraph;  // NOLINT(google-build-using-namespace): the C entry points below

extern "C" void sg_checkpoint_config_default(sg_checkpoint_config* config) {
  if (config != nullptr) *config = capi::default_config();
}

extern "C" sg_result sg_checkpoint_save(sg_layer model, sg_optimizer optimizer, const char* path,
                                        const sg_checkpoint_config* config) {
  return capi::run_guarded(__func__, [&, function = __func__] {
    const sg_checkpoint_config c = capi::read_config(config, function);
    const capi::Target target = capi::resolve(function, model, optimizer, path, c);
    capi::save(function, target, path, capi::read_metadata(c, function));
  });
}

extern "C" sg_result sg_checkpoint_load(sg_layer model, sg_optimizer optimizer, const char* path,
                                        const sg_checkpoint_config* config, sg_checkpoint_metadata* metadata) {
  return capi::run_guarded(__func__, [&, function = __func__] {
    if (metadata != nullptr) *metadata = nullptr;
    const sg_checkpoint_config c = capi::read_config(config, function);
    SG_CHECK(c.metadata_keys == nullptr && c.metadata_values == nullptr && c.metadata_count == 0, function,
             ": config->metadata_keys, metadata_values and metadata_count are what sg_checkpoint_save writes; a load "
             "hands the checkpoint's entries back through `metadata`: leave them NULL and 0");
    const capi::Target target = capi::resolve(function, model, optimizer, path, c);
    const Checkpoint saved = capi::read(function, target, path);
    load_training_state(*target.optimizer->ctx, target.model, *target.optimizer->adamw, saved);
    if (metadata == nullptr) return;
    auto entries = std::make_shared<sg_checkpoint_metadata_s>();
    entries->entries.assign(saved.metadata.begin(), saved.metadata.end());
    *metadata = capi::issue_handle(std::move(entries));
  });
}

extern "C" sg_result sg_checkpoint_metadata_count(sg_checkpoint_metadata metadata, size_t* out) {
  return capi::run_guarded(__func__, [&, function = __func__] {
    const auto entries = capi::handle_object(metadata, function, "metadata");
    capi::require(out, function, "out");
    *out = entries->entries.size();
  });
}

extern "C" sg_result sg_checkpoint_metadata_entry(sg_checkpoint_metadata metadata, size_t index, char* key,
                                                  size_t key_capacity, size_t* key_length, char* value,
                                                  size_t value_capacity, size_t* value_length) {
  return capi::run_guarded(__func__, [&, function = __func__] {
    const auto entries = capi::handle_object(metadata, function, "metadata");
    SG_CHECK(index < entries->entries.size(), function, ": index ", index, " is past the ", entries->entries.size(),
             " entries (sg_checkpoint_metadata_count)");
    const auto& [k, v] = entries->entries[index];
    capi::copy_string(k, key, key_capacity, key_length);
    capi::copy_string(v, value, value_capacity, value_length);
  });
}

extern "C" sg_result sg_checkpoint_metadata_destroy(sg_checkpoint_metadata metadata) {
  return capi::destroy_handle(metadata, __func__, "metadata");
}

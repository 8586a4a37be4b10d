// Reading a versioned config struct of the C API (sg_train_step_config,
// sg_optimizer_config, sg_language_model_config): NCCL's ncclConfig_t
// pattern. The struct starts with size, magic and version; fields are only
// ever appended, each version's size is known here, and a caller built
// against an older stepgraph.h passes a shorter struct, whose missing fields
// take the library's defaults. Internal to capi.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <ios>
#include <span>

#include "engine/error.h"

namespace stepgraph::capi {

// `config` as this library's Config: `defaults` overwritten by the fields of
// the caller's version. `sizes[v]` is the size of version v (sizes[0] unused).
// An Error, naming `function`, the struct and what to do, for a struct that
// was not initialised (magic), one from a newer stepgraph.h (version), or a
// size that disagrees with its version.
template <typename Config>
Config read_versioned_config(const Config& config, Config defaults, std::span<const std::size_t> sizes,
                             std::uint32_t magic, const char* function, const char* type, const char* initialiser) {
  const std::size_t newest = sizes.size() - 1;
  SG_CHECK(config.magic == magic, function, ": config (", type, ") was not initialised (magic 0x", std::hex,
           config.magic, ", expected 0x", magic, std::dec, "); start from ", initialiser);
  SG_CHECK(config.version >= 1, function, ": config (", type, ") version 0 is not a version; start from ",
           initialiser);
  SG_CHECK(config.version <= newest, function, ": config (", type, ") version ", config.version,
           " is newer than this library reads (1 to ", newest,
           "): the caller was built against a newer stepgraph.h than this libstepgraph_c.so; load the library "
           "that came with that header");
  const std::size_t size = sizes[config.version];
  SG_CHECK(config.size == size, function, ": config (", type, ") size ", config.size, " does not match version ",
           config.version, " (", size, " bytes): the caller was built against ",
           config.size > size ? "a newer" : "an older", " or modified stepgraph.h; start from ", initialiser,
           " and rebuild against the header of this library");
  std::memcpy(static_cast<void*>(&defaults), &config, size);
  defaults.size = sizeof(Config);
  defaults.version = static_cast<std::uint32_t>(newest);
  return defaults;
}

}  // namespace stepgraph::capi

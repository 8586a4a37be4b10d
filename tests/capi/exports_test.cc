// libstepgraph_c.so exports the C API and no C++ symbol of the engine (the
// version script capi/stepgraph.lds): loaded with dlopen as Python does.
#include <dlfcn.h>  // dlvsym: a GNU extension (g++ defines _GNU_SOURCE)
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

namespace {

void* open_library() {
  const char* path = std::getenv("STEPGRAPH_LIBRARY");
  EXPECT_NE(path, nullptr) << "the BUILD target sets STEPGRAPH_LIBRARY";
  void* library = path != nullptr ? dlopen(path, RTLD_NOW | RTLD_LOCAL) : nullptr;
  EXPECT_NE(library, nullptr) << dlerror();
  return library;
}

// `name` is exported, in the version node STEPGRAPH_C_<version> and not in the one before it.
void expect_added_in(void* library, const char* name, int version) {
  const std::string node = "STEPGRAPH_C_" + std::to_string(version);
  const std::string before = "STEPGRAPH_C_" + std::to_string(version - 1);
  EXPECT_NE(dlsym(library, name), nullptr) << name;
  EXPECT_NE(dlvsym(library, name, node.c_str()), nullptr) << name << " is not in " << node;
  EXPECT_EQ(dlvsym(library, name, before.c_str()), nullptr) << name << " is in " << before;
}

TEST(CapiExportsTest, CApiIsExportedAndWorks) {
  void* library = open_library();
  ASSERT_NE(library, nullptr);
  using Version = int (*)();
  auto version = reinterpret_cast<Version>(dlsym(library, "sg_api_version"));
  ASSERT_NE(version, nullptr);
  EXPECT_EQ(version(), 11);
  for (const char* name : {"sg_context_create", "sg_tensor_wrap", "sg_layer_forward", "sg_train_step_capture",
                           "sg_graph_replay", "sg_graph_cache_get_stats", "sg_last_error"}) {
    EXPECT_NE(dlsym(library, name), nullptr) << name;
    EXPECT_NE(dlvsym(library, name, "STEPGRAPH_C_2"), nullptr) << name << " left version STEPGRAPH_C_2";
  }
}

// API version 3's additions (capi/stepgraph.lds), in their own version node.
TEST(CapiExportsTest, Version3AdditionsAreExportedAsStepgraphC3) {
  void* library = open_library();
  ASSERT_NE(library, nullptr);
  for (const char* name : {"sg_world_init", "sg_world_destroy", "sg_world_rank", "sg_world_size", "sg_world_local_rank",
                           "sg_world_describe", "sg_train_step_config_default",
                           "sg_context_set_communication_stream", "sg_context_communication_stream"}) {
    expect_added_in(library, name, 3);
  }
}

// API version 5's additions (FP8 recipes), in their own version node.
TEST(CapiExportsTest, Version5AdditionsAreExportedAsStepgraphC5) {
  void* library = open_library();
  ASSERT_NE(library, nullptr);
  for (const char* name : {"sg_fp8_recipe_default"}) {
    expect_added_in(library, name, 5);
  }
}

TEST(CapiExportsTest, Version6AdditionsAreExportedAsStepgraphC6) {
  void* library = open_library();
  ASSERT_NE(library, nullptr);
  for (const char* name : {"sg_optimizer_set_lr", "sg_optimizer_lr"}) {
    expect_added_in(library, name, 6);
  }
}

TEST(CapiExportsTest, Version7AdditionsAreExportedAsStepgraphC7) {
  void* library = open_library();
  ASSERT_NE(library, nullptr);
  for (const char* name : {"sg_graphed_layers_capture", "sg_graphed_layers_destroy", "sg_graphed_layers_forward",
                           "sg_graphed_layers_backward", "sg_graphed_layers_input", "sg_graphed_layers_grad_output",
                           "sg_graphed_layers_gradient_count", "sg_graphed_layers_gradient",
                           "sg_graphed_layers_graph_count", "sg_graphed_layers_pool_bytes",
                           "sg_graphed_layers_next_graph"}) {
    expect_added_in(library, name, 7);
  }
}

TEST(CapiExportsTest, Version8AdditionIsExportedAsStepgraphC8) {
  void* library = open_library();
  ASSERT_NE(library, nullptr);
  expect_added_in(library, "sg_layer_check_errors", 8);
}

// API version 9's additions (language models, optimizer configs), in their own version node.
TEST(CapiExportsTest, Version9AdditionsAreExportedAsStepgraphC9) {
  void* library = open_library();
  ASSERT_NE(library, nullptr);
  for (const char* name : {"sg_language_model_config_default", "sg_language_model_create", "sg_optimizer_config_default",
                           "sg_optimizer_create", "sg_optimizer_loss_scale", "sg_optimizer_skipped_steps",
                           "sg_train_step_packing"}) {
    expect_added_in(library, name, 9);
  }
}

// API version 10: the functions whose arguments changed are in their own node (a binary built
// against an older header fails to load instead of passing old structs); the create variants
// that one versioned config per object replaced are gone.
TEST(CapiExportsTest, Version10ChangedFunctionsAreStepgraphC10AndVariantsAreGone) {
  void* library = open_library();
  ASSERT_NE(library, nullptr);
  for (const char* name : {"sg_context_set_gemm_algorithms", "sg_context_gemm_algorithms", "sg_graph_profile",
                           "sg_graph_last_profile", "sg_world_split", "sg_linear_create", "sg_norm_create", "sg_layernorm_linear_create",
                           "sg_layernorm_mlp_create", "sg_residual_stack_create", "sg_train_step_create",
                           "sg_linear_config_default", "sg_norm_config_default", "sg_layernorm_linear_config_default",
                           "sg_layernorm_mlp_config_default", "sg_residual_stack_config_default"}) {
    EXPECT_NE(dlvsym(library, name, "STEPGRAPH_C_10"), nullptr) << name << " is not in STEPGRAPH_C_10";
    EXPECT_EQ(dlvsym(library, name, "STEPGRAPH_C_2"), nullptr) << name << " is still in STEPGRAPH_C_2";
  }
  for (const char* name : {"sg_linear_create_fp8", "sg_layernorm_linear_create_fp8", "sg_layernorm_mlp_create_fp8",
                           "sg_residual_stack_create_tensor_parallel", "sg_train_step_create_with_config",
                           "sg_adamw_create", "sg_adamw_create_scheduled"}) {
    EXPECT_EQ(dlsym(library, name), nullptr) << name << " is still exported";
  }
}

TEST(CapiExportsTest, Version11AdditionsAreExportedAsStepgraphC11) {
  void* library = open_library();
  ASSERT_NE(library, nullptr);
  for (const char* name : {"sg_checkpoint_config_default", "sg_checkpoint_save", "sg_checkpoint_load",
                           "sg_checkpoint_metadata_count", "sg_checkpoint_metadata_entry",
                           "sg_checkpoint_metadata_destroy"}) {
    expect_added_in(library, name, 11);
  }
}

TEST(CapiExportsTest, EngineSymbolsStayHidden) {
  void* library = open_library();
  ASSERT_NE(library, nullptr);
  // Inside the library (local symbols), never exported.
  for (const char* name : {"_ZN9stepgraph7ContextC1ENS_6DeviceEi", "_ZN9stepgraph15error_code_nameENS_9ErrorCodeE"}) {
    EXPECT_EQ(dlsym(library, name), nullptr) << name << " is exported";
  }
}

}  // namespace

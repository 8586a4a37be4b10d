// libstepgraph_c.so exports the C API and no C++ symbol of the engine (the
// version script capi/stepgraph.lds): loaded with dlopen as Python does.
#include <dlfcn.h>
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

TEST(CapiExportsTest, CApiIsExportedAndWorks) {
  void* library = open_library();
  ASSERT_NE(library, nullptr);
  using Version = int (*)();
  auto version = reinterpret_cast<Version>(dlsym(library, "sg_api_version"));
  ASSERT_NE(version, nullptr);
  EXPECT_EQ(version(), 2);
  for (const char* name : {"sg_context_create", "sg_tensor_wrap", "sg_layer_forward", "sg_train_step_capture",
                           "sg_graph_replay", "sg_graph_cache_get_stats", "sg_last_error"}) {
    EXPECT_NE(dlsym(library, name), nullptr) << name;
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

// The op registry: every op defined in ops/ registers itself, once, and has a
// check, a CUDA launcher and a host reference.
#include "ops/registry.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>

#include "ops/op_registration.h"
#include "tests/support/expect_error.h"

namespace stepgraph {
namespace {

TEST(OpRegistryTest, EveryOpHasACheckAndBothImplementations) {
  ASSERT_FALSE(ops::all_ops().empty());
  for (const OpDef* op : ops::all_ops()) {
    EXPECT_NE(op->check, nullptr) << op->name;
    EXPECT_NE(op->launch_cuda, nullptr) << op->name;
    EXPECT_NE(op->run_host, nullptr) << op->name;
    EXPECT_EQ(&ops::find_op(op->name), op);
  }
  EXPECT_ERROR_CONTAINS(ops::find_op("conv3d"), "unknown op 'conv3d'", "known ops:", "adamw", "dropout");
}

TEST(OpRegistryTest, NamesAreSortedAndUnique) {
  const auto all = ops::all_ops();
  for (std::size_t i = 1; i < all.size(); ++i) EXPECT_LT(all[i - 1]->name, all[i]->name);
}

// The text of ops/*.cc (the test's data, //ops:op_sources) by file name.
std::map<std::string, std::string> op_sources() {
  std::map<std::string, std::string> sources;
  for (const auto& entry : std::filesystem::directory_iterator("ops")) {
    if (entry.path().extension() != ".cc") continue;
    std::ifstream in(entry.path());
    std::stringstream text;
    text << in.rdbuf();
    sources[entry.path().filename().string()] = text.str();
  }
  EXPECT_GE(sources.size(), 20u) << "the test's data (//ops:op_sources) is missing";
  return sources;
}

// Reads ops/*.cc: every `const OpDef& x_op() {` is followed by
// SG_REGISTER_OP(x_op), and the registry holds as many ops as ops/ defines,
// so an op added without registration, or a family left out of //ops:registry,
// fails here.
TEST(OpRegistryTest, HoldsEveryOpThatOpsDefines) {
  const std::regex definition(R"(\nconst OpDef& (\w+)\(\) \{)");
  const std::regex registration(R"(\nSG_REGISTER_OP\((\w+)\);)");
  const std::regex op_object(R"(\bstatic const OpDef \w+)");
  std::set<std::string> defined, registered;
  std::size_t objects = 0;
  for (const auto& [file, source] : op_sources()) {
    for (std::sregex_iterator m(source.begin(), source.end(), definition), end; m != end; ++m) {
      EXPECT_TRUE(defined.insert((*m)[1]).second) << (*m)[1] << " defined twice";
    }
    for (std::sregex_iterator m(source.begin(), source.end(), registration), end; m != end; ++m) {
      EXPECT_TRUE(registered.insert((*m)[1]).second) << (*m)[1] << " registered twice";
    }
    objects += static_cast<std::size_t>(
        std::distance(std::sregex_iterator(source.begin(), source.end(), op_object), std::sregex_iterator()));
  }
  EXPECT_EQ(defined, registered);
  EXPECT_EQ(objects, defined.size()) << "an OpDef outside `const OpDef& x_op() { static const OpDef op{...} }`";
  EXPECT_EQ(ops::all_ops().size(), defined.size());
  // The ops a hand-kept list once missed.
  for (const char* name :
       {"dropout", "rng_advance_", "loss_scale_update_", "flag_nonfinite_", "scale_by_loss_scale_"}) {
    EXPECT_NO_THROW(ops::find_op(name)) << name;
  }
}

// Operand structs (`template <typename F>\nstruct X`) have names unique
// across ops/ (see operands.h: GCC would let two files' same-named structs
// share one instantiation of bind_args and its kin).
TEST(OpRegistryTest, OperandStructNamesAreUniqueAcrossOpFiles) {
  const std::regex operand_struct(R"(\ntemplate <typename F>\nstruct (\w+))");
  std::map<std::string, std::string> file_of;
  for (const auto& [file, source] : op_sources()) {
    for (std::sregex_iterator m(source.begin(), source.end(), operand_struct), end; m != end; ++m) {
      const auto [at, fresh] = file_of.emplace((*m)[1], file);
      EXPECT_TRUE(fresh) << "operand struct " << (*m)[1] << " is defined in " << at->second << " and in " << file
                         << ": give one of them a name of its own";
    }
  }
  EXPECT_GE(file_of.size(), 20u) << "the pattern found too few operand structs";
}

OpDef named(std::string_view name) { return OpDef{.name = name}; }

TEST(OpRegistryTest, RefusesEmptyAndTakenNames) {
  ops::OpRegistry registry;
  const OpDef b = named("b"), a = named("a"), other_a = named("a"), nameless = named("");
  registry.add(b);
  registry.add(a);
  EXPECT_ERROR_CONTAINS(registry.add(other_a), "two ops are named 'a'", "unique");
  EXPECT_ERROR_CONTAINS(registry.add(nameless), "an op has no name");
  ASSERT_EQ(registry.ops().size(), 2u);
  EXPECT_EQ(registry.ops()[0], &a);
  EXPECT_EQ(registry.find("b"), &b);
  EXPECT_EQ(registry.find("c"), nullptr);
}

const OpDef& second_adamw() {
  static const OpDef op{.name = "adamw"};
  return op;
}

TEST(OpRegistryDeathTest, ATakenNameAbortsAtRegistration) {
  EXPECT_DEATH(ops::OpRegistrar{&second_adamw}, "two ops are named 'adamw'");
}

}  // namespace
}  // namespace stepgraph

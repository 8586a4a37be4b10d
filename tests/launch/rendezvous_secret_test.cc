// The rendezvous secret: made from the OS's random source, read from
// STEPGRAPH_RENDEZVOUS_SECRET or a file only its owner may read, and passed
// on by launch_info_from_env.
#include "launch/rendezvous_secret.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <string>

#include "engine/error.h"
#include "launch/launch_env.h"
#include "tests/support/expect_error.h"

namespace stepgraph {
namespace {

using Vars = std::map<std::string, std::string>;

EnvLookup lookup(Vars vars) {
  return [vars = std::move(vars)](std::string_view name) -> std::optional<std::string> {
    const auto it = vars.find(std::string(name));
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

// A file in the test's temporary directory with `text` and `mode`.
std::string secret_file(const std::string& name, const std::string& text, mode_t mode) {
  const char* dir = std::getenv("TEST_TMPDIR");
  const std::string path = std::string(dir != nullptr ? dir : "/tmp") + "/" + name;
  {
    std::ofstream out(path, std::ios::trunc);
    out << text;
  }
  ::chmod(path.c_str(), mode);
  return path;
}

const std::string kGood = "0123456789abcdef0123456789abcdef";

TEST(RendezvousSecretTest, MadeSecretsAre32RandomBytesInHex) {
  const std::string a = make_rendezvous_secret();
  const std::string b = make_rendezvous_secret();
  EXPECT_EQ(a.size(), 64u);
  EXPECT_EQ(a.find_first_not_of("0123456789abcdef"), std::string::npos) << a;
  EXPECT_NE(a, b);
}

TEST(RendezvousSecretTest, NoVariableIsNoSecret) { EXPECT_EQ(rendezvous_secret_from_env(lookup({})), ""); }

TEST(RendezvousSecretTest, TheVariableIsTheSecret) {
  EXPECT_EQ(rendezvous_secret_from_env(lookup({{"STEPGRAPH_RENDEZVOUS_SECRET", kGood}})), kGood);
}

TEST(RendezvousSecretTest, ShortSecretsAndBothVariablesAreErrors) {
  EXPECT_ERROR_CONTAINS((void)rendezvous_secret_from_env(lookup({{"STEPGRAPH_RENDEZVOUS_SECRET", "hunter2"}})),
                        "STEPGRAPH_RENDEZVOUS_SECRET gives a secret of 7 bytes", "openssl rand -hex 32");
  EXPECT_ERROR_CONTAINS((void)rendezvous_secret_from_env(lookup({{"STEPGRAPH_RENDEZVOUS_SECRET", ""}})), "0 bytes");
  EXPECT_ERROR_CONTAINS((void)rendezvous_secret_from_env(lookup(
                            {{"STEPGRAPH_RENDEZVOUS_SECRET", kGood}, {"STEPGRAPH_RENDEZVOUS_SECRET_FILE", "/x"}})),
                        "both STEPGRAPH_RENDEZVOUS_SECRET and STEPGRAPH_RENDEZVOUS_SECRET_FILE");
}

TEST(RendezvousSecretTest, AFileOnlyItsOwnerReadsGivesTheSecretWithoutItsNewline) {
  const std::string path = secret_file("secret_600", kGood + "\n", 0600);
  EXPECT_EQ(rendezvous_secret_from_env(lookup({{"STEPGRAPH_RENDEZVOUS_SECRET_FILE", path}})), kGood);
  const std::string read_only = secret_file("secret_400", kGood, 0400);
  EXPECT_EQ(rendezvous_secret_from_env(lookup({{"STEPGRAPH_RENDEZVOUS_SECRET_FILE", read_only}})), kGood);
}

TEST(RendezvousSecretTest, AFileOthersMayReadIsRefused) {
  for (const mode_t mode : {mode_t{0644}, mode_t{0640}, mode_t{0604}, mode_t{0660}}) {
    const std::string path = secret_file("secret_open", kGood, mode);
    EXPECT_ERROR_CONTAINS((void)rendezvous_secret_from_env(lookup({{"STEPGRAPH_RENDEZVOUS_SECRET_FILE", path}})),
                          "STEPGRAPH_RENDEZVOUS_SECRET_FILE", "group or others", "chmod 600");
  }
}

TEST(RendezvousSecretTest, AMissingFileOrADirectoryIsRefused) {
  EXPECT_ERROR_CONTAINS(
      (void)rendezvous_secret_from_env(lookup({{"STEPGRAPH_RENDEZVOUS_SECRET_FILE", "/no/such/secret"}})),
      "STEPGRAPH_RENDEZVOUS_SECRET_FILE='/no/such/secret' cannot be opened");
  const char* dir = std::getenv("TEST_TMPDIR");
  const std::string directory = std::string(dir != nullptr ? dir : "/tmp") + "/secret_dir";
  ::mkdir(directory.c_str(), 0700);
  EXPECT_ERROR_CONTAINS((void)rendezvous_secret_from_env(lookup({{"STEPGRAPH_RENDEZVOUS_SECRET_FILE", directory}})),
                        "no regular file");
}

TEST(RendezvousSecretTest, LaunchInfoCarriesTheSecretOfAWorldOfSeveral) {
  const Vars torchrun = {{"RANK", "1"},
                         {"WORLD_SIZE", "2"},
                         {"LOCAL_RANK", "1"},
                         {"LOCAL_WORLD_SIZE", "2"},
                         {"MASTER_ADDR", "127.0.0.1"},
                         {"MASTER_PORT", "29500"}};
  Vars with = torchrun;
  with["STEPGRAPH_RENDEZVOUS_SECRET"] = kGood;
  EXPECT_EQ(launch_info_from_env(lookup(with)).secret, kGood);
  EXPECT_EQ(launch_info_from_env(lookup(torchrun)).secret, "");
  // Never part of what is printed.
  EXPECT_EQ(describe(launch_info_from_env(lookup(with))).find(kGood), std::string::npos);
  // A world of one meets nobody: its secret is neither read nor checked.
  EXPECT_EQ(launch_info_from_env(lookup({{"STEPGRAPH_RENDEZVOUS_SECRET", "short"}})).secret, "");
  Vars bad = torchrun;
  bad["STEPGRAPH_RENDEZVOUS_SECRET"] = "short";
  EXPECT_ERROR_CONTAINS((void)launch_info_from_env(lookup(bad)), "STEPGRAPH_RENDEZVOUS_SECRET");
}

}  // namespace
}  // namespace stepgraph

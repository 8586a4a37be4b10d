// The rendezvous secret: what every rank of one run holds and no other
// process does, so that the rendezvous can tell the run's ranks from anyone
// else who reaches rank 0's port (Note [Rendezvous authentication]).
//
//   trainer --nproc-per-node N    makes one (make_rendezvous_secret) and
//                                 gives it to its ranks in their environment;
//   torchrun, srun, mpirun        the user passes one to every rank:
//     STEPGRAPH_RENDEZVOUS_SECRET=<text>       (at least 16 bytes), or
//     STEPGRAPH_RENDEZVOUS_SECRET_FILE=<path>  (a file nobody but its owner may
//                                               read: mode 0600 or 0400).
//
// Never on a command line (other users see argv in ps); never printed.
// Without one, a run on one host listens on loopback only, and a run over
// several hosts refuses to start (rendezvous.h).
#pragma once

#include <cstddef>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

namespace stepgraph {

inline constexpr const char* kSecretVariable = "STEPGRAPH_RENDEZVOUS_SECRET";
inline constexpr const char* kSecretFileVariable = "STEPGRAPH_RENDEZVOUS_SECRET_FILE";
inline constexpr std::size_t kMinSecretBytes = 16;
inline constexpr std::size_t kMaxSecretBytes = 4096;

// 32 bytes from the OS's random source (getrandom), as 64 hex digits.
std::string make_rendezvous_secret();

// The secret `env` passes (either variable; empty when neither is set). A
// secret shorter than kMinSecretBytes or longer than kMaxSecretBytes, both
// variables set, or a file that is missing, no regular file, or readable by
// its group or others, is an Error (kInvalidArgument) naming the variable.
// A file's one trailing newline is not part of the secret.
// `env` is launch_env.h's EnvLookup (launch_info_from_env reads the secret with it).
std::string rendezvous_secret_from_env(const std::function<std::optional<std::string>(std::string_view)>& env);

// How to pass a secret, for messages: "set STEPGRAPH_RENDEZVOUS_SECRET ... in every rank".
std::string how_to_pass_a_secret();

}  // namespace stepgraph

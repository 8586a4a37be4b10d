#include "launch/rendezvous_secret.h"

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <system_error>

#include "engine/error.h"

namespace stepgraph {
namespace {

std::string errno_text(int error) { return std::error_code(error, std::generic_category()).message(); }

// Reads the secret file at `path`: a regular file only its owner may read, at most kMaxSecretBytes.
std::string read_secret_file(const std::string& path) {
  SG_CHECK(!path.empty(), kSecretFileVariable, " is set but empty; set it to a file holding the secret, or unset it");
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY);
  SG_CHECK(fd >= 0, kSecretFileVariable, "='", path, "' cannot be opened: ", errno_text(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat status {};
  SG_CHECK(::fstat(fd, &status) == 0, kSecretFileVariable, "='", path, "': fstat failed: ", errno_text(errno));
  SG_CHECK(S_ISREG(status.st_mode), kSecretFileVariable, "='", path, "' is no regular file");
  if ((status.st_mode & (S_IRWXG | S_IRWXO)) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(status.st_mode & 07777));
    SG_THROW(ErrorCode::kInvalidArgument, kSecretFileVariable, "='", path, "' has mode ", mode,
             ": its group or others may read or change it, so it keeps no secret; run chmod 600 '", path, "'");
  }
  std::string secret;
  char buffer[1024];
  while (true) {
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    SG_CHECK(n >= 0, kSecretFileVariable, "='", path, "' cannot be read: ", errno_text(errno));
    if (n == 0) break;
    secret.append(buffer, static_cast<std::size_t>(n));
    SG_CHECK(secret.size() <= kMaxSecretBytes + 2, kSecretFileVariable, "='", path, "' holds more than ",
             kMaxSecretBytes, " bytes; a secret needs 32 random bytes (e.g. openssl rand -hex 32 > FILE)");
  }
  // One trailing newline (what `echo` and editors add) is not part of the secret.
  if (!secret.empty() && secret.back() == '\n') secret.pop_back();
  if (!secret.empty() && secret.back() == '\r') secret.pop_back();
  return secret;
}

}  // namespace

std::string make_rendezvous_secret() {
  unsigned char bytes[32];
  std::size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = ::getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n < 0 && errno == EINTR) continue;
    SG_CHECK_CODE(n > 0, ErrorCode::kInternal,
                  "cannot make a rendezvous secret: getrandom() failed: ", errno_text(errno));
    got += static_cast<std::size_t>(n);
  }
  constexpr char kHex[] = "0123456789abcdef";
  std::string secret;
  for (const unsigned char byte : bytes) {
    secret += kHex[byte >> 4];
    secret += kHex[byte & 0xf];
  }
  return secret;
}

std::string how_to_pass_a_secret() {
  return detail::concat("give every rank the same secret: export ", kSecretVariable,
                        "=$(openssl rand -hex 32) before torchrun, srun or mpirun (mpirun: also -x ", kSecretVariable,
                        "), or set ", kSecretFileVariable,
                        " to a file of mode 600 that holds one; trainer --nproc-per-node makes its own");
}

std::string rendezvous_secret_from_env(const std::function<std::optional<std::string>(std::string_view)>& env) {
  const std::optional<std::string> value = env(kSecretVariable);
  const std::optional<std::string> file = env(kSecretFileVariable);
  SG_CHECK(!(value.has_value() && file.has_value()), "both ", kSecretVariable, " and ", kSecretFileVariable,
           " are set; set one of them (the same secret in every rank)");
  std::string secret;
  std::string from;
  if (value.has_value()) {
    secret = *value;
    from = kSecretVariable;
  } else if (file.has_value()) {
    secret = read_secret_file(*file);
    from = detail::concat(kSecretFileVariable, "='", *file, "'");
  } else {
    return {};
  }
  SG_CHECK(secret.size() >= kMinSecretBytes, from, " gives a secret of ", secret.size(), " bytes, fewer than ",
           kMinSecretBytes, "; use a random one, e.g. $(openssl rand -hex 32)");
  SG_CHECK(secret.size() <= kMaxSecretBytes, from, " gives a secret of ", secret.size(), " bytes, more than ",
           kMaxSecretBytes);
  return secret;
}

}  // namespace stepgraph

#include "launch/rendezvous_auth.h"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>
#include <sys/random.h>

#include <cerrno>
#include <memory>
#include <system_error>

#include "engine/error.h"

// Note [Rendezvous authentication]
// Every rank of a run holds the same secret (rendezvous_secret.h: made by
// --nproc-per-node, or passed by the user to every rank). The handshake on
// each connection (rendezvous_handshake.cc) is a two-way challenge:
//   hello     (rank r -> 0): rank, world size, version, whether it has a secret, nonce_r;
//   challenge (0 -> rank r): version, whether it has a secret, nonce_0,
//                            proof_0 = HMAC(secret, "rank 0" || transcript);
//   response  (rank r -> 0): proof_r = HMAC(secret, "peer" || transcript),
// where the transcript is the hello and the challenge up to its proof. Each
// side checks the other's proof before it believes a byte the other sends,
// so a process without the secret can neither take a rank (rank 0 refuses
// it) nor pose as rank 0 (the peer refuses it); fresh nonces on both sides
// mean no recorded handshake can be replayed. Rank 0 proves first, so a peer
// that reached the wrong process gives nothing away but a MAC bound to
// nonces it chose itself.
//
// After the handshake every frame carries HMAC-SHA256 under a per-connection,
// per-direction key (HMAC(secret, direction || transcript)) over its
// sequence number, its length and its bytes. A process that relays or
// injects bytes between two genuine ranks (it can pass the handshake
// through, but cannot compute a key) is caught at its first frame.
//
// Why a MAC and not TLS: what the rendezvous must protect is who speaks and
// that their bytes arrive unchanged (NCCL's unique id, flag and capture
// hashes, a host run's gradients); none of it is confidential. TLS would
// need certificates or TLS 1.3 external PSKs, OpenSSL's non-blocking state
// machine under our poll() loops (SSL_ERROR_WANT_READ/WRITE in every send
// and receive, renegotiation and close_notify), and libssl on the GPU
// machines; a MAC is two calls on the frames we already have, with the same
// libcrypto. What it does not do: hide the bytes from someone on the path,
// or keep a network attacker from ending a run (closing connections).
// Without a secret (a single-host run that listens on loopback only) the
// same protocol runs with an empty key: it then checks integrity against
// accidents, not against other users of the host.

namespace stepgraph {
namespace {

constexpr std::string_view kProofLabel[] = {"stepgraph rendezvous proof: rank 0", "stepgraph rendezvous proof: peer"};
constexpr std::string_view kToRank0Label = "stepgraph rendezvous key: to rank 0";
constexpr std::string_view kFromRank0Label = "stepgraph rendezvous key: from rank 0";

// OpenSSL's HMAC implementation, fetched once (thread-safe static initialisation) and kept.
EVP_MAC* hmac_algorithm() {
  static EVP_MAC* const algorithm = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
  SG_CHECK_CODE(algorithm != nullptr, ErrorCode::kInternal,
                "OpenSSL's libcrypto offers no HMAC (EVP_MAC_fetch failed); the rendezvous cannot authenticate");
  return algorithm;
}

// One HMAC-SHA256 computation, fed a piece at a time.
class HmacStream {
 public:
  explicit HmacStream(std::string_view key) : context_(EVP_MAC_CTX_new(hmac_algorithm())) {
    SG_CHECK_CODE(context_ != nullptr, ErrorCode::kOutOfMemory, "OpenSSL could not make an HMAC context");
    char digest[] = "SHA256";
    const OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0),
                                 OSSL_PARAM_construct_end()};
    // An empty key is a valid HMAC key; OpenSSL wants a non-null pointer for it.
    static const unsigned char kNoKey = 0;
    const auto* bytes = key.empty() ? &kNoKey : reinterpret_cast<const unsigned char*>(key.data());
    ok_ = EVP_MAC_init(context_.get(), bytes, key.size(), params) == 1;
  }

  HmacStream& update(std::string_view bytes) {
    ok_ =
        ok_ && EVP_MAC_update(context_.get(), reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size()) == 1;
    return *this;
  }

  std::string finish() {
    std::string out(kMacBytes, '\0');
    std::size_t length = 0;
    ok_ = ok_ && EVP_MAC_final(context_.get(), reinterpret_cast<unsigned char*>(out.data()), &length, out.size()) == 1;
    SG_CHECK_CODE(ok_ && length == kMacBytes, ErrorCode::kInternal, "OpenSSL's HMAC-SHA256 failed");
    return out;
  }

 private:
  struct Free {
    void operator()(EVP_MAC_CTX* context) const { EVP_MAC_CTX_free(context); }
  };
  std::unique_ptr<EVP_MAC_CTX, Free> context_;
  bool ok_ = false;
};

std::string u64_bytes(std::uint64_t value) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[static_cast<std::size_t>(i)] = static_cast<char>((value >> (8 * i)) & 0xff);
  return out;
}

}  // namespace

Nonce make_nonce() {
  Nonce nonce{};
  std::size_t got = 0;
  while (got < nonce.size()) {
    const ssize_t n = ::getrandom(nonce.data() + got, nonce.size() - got, 0);
    if (n < 0 && errno == EINTR) continue;
    SG_CHECK_CODE(n > 0, ErrorCode::kInternal,
                  "getrandom() failed: ", std::error_code(errno, std::generic_category()).message());
    got += static_cast<std::size_t>(n);
  }
  return nonce;
}

std::string hmac_sha256(std::string_view key, std::initializer_list<std::string_view> parts) {
  HmacStream mac(key);
  for (const std::string_view part : parts) mac.update(part);
  return mac.finish();
}

std::string prove(std::string_view secret, ProofRole role, std::string_view transcript) {
  return hmac_sha256(secret, {kProofLabel[static_cast<std::size_t>(role)], transcript});
}

bool proof_matches(std::string_view got, std::string_view expected) {
  return got.size() == expected.size() && CRYPTO_memcmp(got.data(), expected.data(), got.size()) == 0;
}

FrameMac::FrameMac(std::string send_key, std::string receive_key)
    : send_key_(std::move(send_key)), receive_key_(std::move(receive_key)) {}

FrameMac FrameMac::for_rank0(std::string_view secret, std::string_view transcript) {
  return FrameMac(hmac_sha256(secret, {kFromRank0Label, transcript}), hmac_sha256(secret, {kToRank0Label, transcript}));
}

FrameMac FrameMac::for_peer(std::string_view secret, std::string_view transcript) {
  return FrameMac(hmac_sha256(secret, {kToRank0Label, transcript}), hmac_sha256(secret, {kFromRank0Label, transcript}));
}

std::string FrameMac::seal(std::initializer_list<std::string_view> parts) {
  SG_CHECK_CODE(!send_key_.empty(), ErrorCode::kInternal, "rendezvous: a frame sealed before its handshake");
  std::uint64_t length = 0;
  for (const std::string_view part : parts) length += part.size();
  HmacStream mac(send_key_);
  mac.update(u64_bytes(sent_++)).update(u64_bytes(length));
  for (const std::string_view part : parts) mac.update(part);
  return mac.finish();
}

bool FrameMac::open(std::string& frame) {
  SG_CHECK_CODE(!receive_key_.empty(), ErrorCode::kInternal, "rendezvous: a frame opened before its handshake");
  if (frame.size() < kMacBytes) return false;
  const std::size_t length = frame.size() - kMacBytes;
  const std::string_view body(frame.data(), length);
  const std::string expected =
      HmacStream(receive_key_).update(u64_bytes(received_)).update(u64_bytes(length)).update(body).finish();
  if (!proof_matches(std::string_view(frame).substr(length), expected)) return false;
  ++received_;
  frame.resize(length);
  return true;
}

}  // namespace stepgraph

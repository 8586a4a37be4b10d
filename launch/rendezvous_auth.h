// The rendezvous's cryptography: HMAC-SHA256 (OpenSSL's libcrypto) for the
// two-way challenge at hello and the MAC on every later frame, and nonces
// from the OS's random source. See Note [Rendezvous authentication] in
// rendezvous_auth.cc for the protocol and why it is a MAC and not TLS.
//
//   const Nonce mine = make_nonce();
//   const std::string proof = prove(secret, ProofRole::kRank0, transcript);
//   if (!proof_matches(theirs, prove(secret, ProofRole::kPeer, transcript))) ...refuse...
//   FrameMac mac = FrameMac::for_rank0(secret, transcript);   // the peer: FrameMac::for_peer
//   const std::string tag = mac.seal({head, payload});        // sent after the frame's bytes
//   if (!mac.open(frame)) ...refuse...                        // checks and strips the tag
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>

namespace stepgraph {

inline constexpr std::size_t kNonceBytes = 32;
inline constexpr std::size_t kMacBytes = 32;  // HMAC-SHA256

using Nonce = std::array<unsigned char, kNonceBytes>;

// kNonceBytes from getrandom(2); an Error (kInternal) if the OS has none to give.
Nonce make_nonce();

// HMAC-SHA256 of the concatenated `parts` under `key` (kMacBytes).
std::string hmac_sha256(std::string_view key, std::initializer_list<std::string_view> parts);

// Who proves: the two proofs of one handshake differ, so neither side can
// answer the other's challenge by echoing what it was sent.
enum class ProofRole : std::uint8_t { kRank0 = 0, kPeer = 1 };

// The proof that whoever computed it holds `secret`: a MAC over the
// handshake's transcript (both nonces among it).
std::string prove(std::string_view secret, ProofRole role, std::string_view transcript);

// Compares in constant time (a timing difference would tell how many leading bytes were right).
bool proof_matches(std::string_view got, std::string_view expected);

// The MAC of one connection's frames after its handshake: a key per
// direction, derived from the secret and the handshake's transcript, and a
// sequence number per direction that is in every tag and never sent, so a
// frame replayed, dropped, reordered or moved to another connection fails.
class FrameMac {
 public:
  FrameMac() = default;  // unusable: a connection has one once its handshake passed
  static FrameMac for_rank0(std::string_view secret, std::string_view transcript);
  static FrameMac for_peer(std::string_view secret, std::string_view transcript);

  // The tag of the next frame sent, whose body is `parts` back to back.
  std::string seal(std::initializer_list<std::string_view> parts);
  // Checks the tag at the end of the next frame received, and strips it;
  // false (and `frame` unchanged) when the frame is short or the tag is wrong.
  [[nodiscard]] bool open(std::string& frame);

 private:
  FrameMac(std::string send_key, std::string receive_key);

  std::string send_key_;
  std::string receive_key_;
  std::uint64_t sent_ = 0;
  std::uint64_t received_ = 0;
};

}  // namespace stepgraph

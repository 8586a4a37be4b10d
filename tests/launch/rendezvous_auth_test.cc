// The rendezvous's cryptography: HMAC-SHA256 against RFC 4231, proofs that
// depend on the secret, the role and the transcript, and frame MACs that
// refuse replayed, altered, reordered and misdirected frames.
#include "launch/rendezvous_auth.h"

#include <gtest/gtest.h>

#include <string>

namespace stepgraph {
namespace {

std::string hex(const std::string& bytes) {
  constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (const char c : bytes) {
    out += kHex[static_cast<unsigned char>(c) >> 4];
    out += kHex[static_cast<unsigned char>(c) & 0xf];
  }
  return out;
}

TEST(RendezvousAuthTest, HmacSha256MatchesRfc4231) {
  // RFC 4231, test case 2; the data given in two parts.
  EXPECT_EQ(hex(hmac_sha256("Jefe", {"what do ya want ", "for nothing?"})),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
}

TEST(RendezvousAuthTest, NoncesDiffer) { EXPECT_NE(make_nonce(), make_nonce()); }

TEST(RendezvousAuthTest, ProofsDependOnSecretRoleAndTranscript) {
  const std::string proof = prove("secret", ProofRole::kRank0, "transcript");
  EXPECT_TRUE(proof_matches(proof, prove("secret", ProofRole::kRank0, "transcript")));
  EXPECT_FALSE(proof_matches(proof, prove("other", ProofRole::kRank0, "transcript")));
  EXPECT_FALSE(proof_matches(proof, prove("secret", ProofRole::kPeer, "transcript")));  // no echoing a proof back
  EXPECT_FALSE(proof_matches(proof, prove("secret", ProofRole::kRank0, "transcripT")));
  EXPECT_FALSE(proof_matches(proof, proof.substr(1)));
}

TEST(RendezvousAuthTest, FramesPassInOrderEachWay) {
  FrameMac rank0 = FrameMac::for_rank0("secret", "t");
  FrameMac peer = FrameMac::for_peer("secret", "t");
  for (int i = 0; i < 3; ++i) {
    std::string up = "request " + std::to_string(i);
    up += peer.seal({"request ", std::to_string(i)});
    ASSERT_TRUE(rank0.open(up));
    EXPECT_EQ(up, "request " + std::to_string(i));
    std::string down = "answer" + rank0.seal({"answer"});
    ASSERT_TRUE(peer.open(down));
    EXPECT_EQ(down, "answer");
  }
}

TEST(RendezvousAuthTest, ReplayedAlteredReflectedOrForeignFramesFail) {
  FrameMac rank0 = FrameMac::for_rank0("secret", "t");
  FrameMac peer = FrameMac::for_peer("secret", "t");
  const std::string first = "one" + peer.seal({"one"});
  std::string copy = first;
  ASSERT_TRUE(rank0.open(copy));
  copy = first;
  EXPECT_FALSE(rank0.open(copy)) << "a replayed frame passed";
  EXPECT_EQ(copy, first);  // unchanged on failure

  std::string altered = "two" + peer.seal({"two"});
  altered[0] = 'T';
  EXPECT_FALSE(rank0.open(altered));

  // Rank 0's own frame sent back to it (the key of the other direction).
  FrameMac fresh0 = FrameMac::for_rank0("secret", "t");
  std::string reflected = "x" + fresh0.seal({"x"});
  FrameMac other0 = FrameMac::for_rank0("secret", "t");
  EXPECT_FALSE(other0.open(reflected));

  // Another connection (transcript) or another secret.
  FrameMac elsewhere = FrameMac::for_peer("secret", "u");
  std::string foreign = "y" + elsewhere.seal({"y"});
  FrameMac check = FrameMac::for_rank0("secret", "t");
  EXPECT_FALSE(check.open(foreign));
  FrameMac wrong = FrameMac::for_peer("secreT", "t");
  std::string forged = "z" + wrong.seal({"z"});
  FrameMac check2 = FrameMac::for_rank0("secret", "t");
  EXPECT_FALSE(check2.open(forged));

  std::string short_frame = "abc";
  EXPECT_FALSE(check2.open(short_frame));
}

}  // namespace
}  // namespace stepgraph

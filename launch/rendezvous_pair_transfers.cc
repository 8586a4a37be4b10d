#include "launch/rendezvous_pair_transfers.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

#include "launch/rendezvous_wire.h"

namespace stepgraph {
namespace {

constexpr std::uint8_t kSends = 1;
constexpr std::uint8_t kReceives = 2;

// What one rank still waits for in a meeting, as its blob gives it.
struct Halves {
  bool sends = false;
  std::int64_t send_bytes = 0;
  bool receives = false;
  std::int64_t recv_bytes = 0;
  std::string call;
  std::string_view first_part;  // the send's first part (a view into the meeting's blob)
};

// Bytes [part * part_bytes, ...) of a send of `bytes`: how many travel in that part.
std::int64_t part_size(std::int64_t bytes, std::int64_t part, std::int64_t part_bytes) {
  return std::clamp<std::int64_t>(bytes - part * part_bytes, 0, part_bytes);
}

std::int64_t parts_of(std::int64_t bytes, std::int64_t part_bytes) {
  return bytes == 0 ? 1 : (bytes + part_bytes - 1) / part_bytes;
}

std::string_view view_of(const std::byte* data, std::int64_t bytes) {
  return bytes == 0 ? std::string_view()
                    : std::string_view(reinterpret_cast<const char*>(data), static_cast<std::size_t>(bytes));
}

void copy_bytes(std::byte* to, std::string_view from) {
  if (!from.empty()) std::memcpy(to, from.data(), from.size());
}

// A meeting's blob: flags, the send's and the receive's sizes, the call's name, then the send's first part.
std::string encode(const PairTransfer& transfer, bool sends, bool receives, std::int64_t part_bytes) {
  std::string out;
  wire::put_u8(out, static_cast<std::uint8_t>((sends ? kSends : 0) | (receives ? kReceives : 0)));
  wire::put_u64(out, static_cast<std::uint64_t>(sends ? transfer.send_bytes : 0));
  wire::put_u64(out, static_cast<std::uint64_t>(receives ? transfer.recv_bytes : 0));
  wire::put_u32(out, static_cast<std::uint32_t>(transfer.call.size()));
  out += transfer.call;
  if (sends) out += view_of(transfer.send, part_size(transfer.send_bytes, 0, part_bytes));
  return out;
}

// Raises kIo where the blob is not one encode() made (another build on the peer).
Halves decode(std::string_view blob, int rank, std::int64_t part_bytes, const std::string& what) {
  wire::Reader reader(blob, detail::concat(what, " from rank ", rank));
  Halves halves;
  const std::uint8_t flags = reader.u8();
  halves.sends = (flags & kSends) != 0;
  halves.receives = (flags & kReceives) != 0;
  halves.send_bytes = static_cast<std::int64_t>(reader.u64());
  halves.recv_bytes = static_cast<std::int64_t>(reader.u64());
  halves.call = std::string(reader.take(reader.u32()));
  halves.first_part = reader.rest();
  const std::int64_t expected = halves.sends ? part_size(halves.send_bytes, 0, part_bytes) : 0;
  SG_CHECK_CODE(halves.send_bytes >= 0 && halves.recv_bytes >= 0 &&
                    static_cast<std::int64_t>(halves.first_part.size()) == expected,
                ErrorCode::kIo, what, ": rank ", rank, " gave ", halves.first_part.size(), " bytes of its send, not ",
                expected, " (a different StepGraph build on another rank?)");
  return halves;
}

std::string waiting_for(const Halves& halves) {
  if (halves.sends && halves.receives) return "its send and its receive wait";
  return halves.sends ? "its send waits for a receive" : "its receive waits for a send";
}

}  // namespace

std::optional<PairTransferFault> run_pair_transfer(int rank, const PairTransfer& transfer, std::int64_t part_bytes,
                                                   std::int64_t& meetings, const PairMeet& meet) {
  const int peer = 1 - rank;
  bool sending = transfer.send_bytes >= 0;
  bool receiving = transfer.recv_bytes >= 0;
  while (sending || receiving) {
    const std::string what = detail::concat("point to point #", ++meetings);
    const std::vector<std::string> blobs = meet(encode(transfer, sending, receiving, part_bytes), what);
    std::array<Halves, 2> halves;
    try {
      SG_CHECK_CODE(blobs.size() == 2, ErrorCode::kInternal, what, ": ", blobs.size(), " ranks met, not 2");
      for (int r = 0; r < 2; ++r) halves[r] = decode(blobs[static_cast<std::size_t>(r)], r, part_bytes, what);
    } catch (const Error& error) {
      return PairTransferFault{ErrorCode::kInternal, error.message()};
    }
    // moves[r]: rank r's send goes to the other rank in this meeting. Both ranks decide it from the same blobs.
    const std::array<bool, 2> moves = {halves[0].sends && halves[1].receives, halves[1].sends && halves[0].receives};
    for (int r = 0; r < 2; ++r) {
      const Halves& from = halves[r];
      const Halves& to = halves[1 - r];
      if (moves[r] && from.send_bytes != to.recv_bytes) {
        return PairTransferFault{
            ErrorCode::kInvalidState,
            detail::concat(what, ": rank ", r, " sends ", from.send_bytes, " bytes in ", from.call, " but rank ", 1 - r,
                           " receives ", to.recv_bytes, " bytes in ", to.call,
                           "; a send and the receive it pairs with must have the same count and dtype")};
      }
    }
    if (!moves[0] && !moves[1]) {
      return PairTransferFault{
          ErrorCode::kInvalidState,
          detail::concat(what, ": no transfer can move: rank 0 is in ", halves[0].call, " (", waiting_for(halves[0]),
                         ") and rank 1 is in ", halves[1].call, " (", waiting_for(halves[1]),
                         "); each waits for the other (on NCCL a hang). Issue a send together with the receive the "
                         "peer waits on first (send_recv), or let one rank receive before it sends")};
    }
    if (moves[peer]) copy_bytes(transfer.recv, halves[peer].first_part);
    std::int64_t parts = 1;
    for (int r = 0; r < 2; ++r) {
      if (moves[r]) parts = std::max(parts, parts_of(halves[r].send_bytes, part_bytes));
    }
    for (std::int64_t part = 1; part < parts; ++part) {
      const std::string part_what = detail::concat(what, ", part ", part + 1, " of ", parts);
      const std::string_view mine =
          moves[rank] ? view_of(transfer.send + part * part_bytes, part_size(transfer.send_bytes, part, part_bytes))
                      : std::string_view();
      const std::vector<std::string> part_blobs = meet(mine, part_what);
      for (int r = 0; r < 2; ++r) {
        const std::int64_t expected = moves[r] ? part_size(halves[r].send_bytes, part, part_bytes) : 0;
        const std::size_t got = part_blobs.size() == 2 ? part_blobs[static_cast<std::size_t>(r)].size() : 0;
        if (part_blobs.size() != 2 || static_cast<std::int64_t>(got) != expected) {
          return PairTransferFault{ErrorCode::kInternal,
                                   detail::concat(part_what, ": rank ", r, " gave ", got, " bytes, not ", expected,
                                                  " (a different StepGraph build on another rank?)")};
        }
      }
      if (moves[peer]) copy_bytes(transfer.recv + part * part_bytes, part_blobs[static_cast<std::size_t>(peer)]);
    }
    if (moves[rank]) sending = false;
    if (moves[peer]) receiving = false;
  }
  return std::nullopt;
}

}  // namespace stepgraph

// Where the trainer's tokens come from: a synthetic Markov chain with a known
// entropy rate (markov_source.h) or a text/token file (token_file.h).
//
// A source is a pure function of its position: next_batch() draws batch
// number position() and advances it by one, and each example is keyed by
// (seed, position, row), so seek(p) resumes a run exactly and the data never
// depends on how many steps ran before.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace stepgraph::trainer {

struct Batch {
  std::vector<std::int32_t> windows;  // [batch, context], row-major
  std::vector<std::int32_t> labels;   // [batch]: the token after each window
};

class DataSource {
 public:
  virtual ~DataSource() = default;

  // Tokens are in [0, vocab()).
  virtual std::int64_t vocab() const = 0;
  // One line for the log.
  virtual std::string describe() const = 0;
  // Nats per token, exact where known (the Markov source); the loss floor.
  virtual std::optional<double> entropy_rate() const = 0;
  // Fills `out` (resized) with `batch` windows of `context` tokens and their
  // labels, then advances position() by one. Throws Error(kInvalidArgument)
  // for batch or context < 1 or a context the data cannot supply.
  virtual void next_batch(std::int64_t batch, std::int64_t context, Batch& out) = 0;
  // Batches drawn so far; store it in a checkpoint.
  virtual std::uint64_t position() const = 0;
  // Continue as if `position` batches had been drawn.
  virtual void seek(std::uint64_t position) = 0;
};

}  // namespace stepgraph::trainer

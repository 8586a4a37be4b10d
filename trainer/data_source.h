// Where the trainer's tokens come from: a synthetic Markov chain with a known
// entropy rate (markov_source.h) or a text/token file (token_file.h).
//
// A source is a pure function of its position: next_batch() draws batch
// number position() and advances it by one, and each example is keyed by
// (seed, position, row), so seek(p) resumes a run exactly and the data never
// depends on how many steps ran before.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace stepgraph::trainer {

struct Batch {
  std::vector<std::int32_t> windows;  // [batch, context], row-major
  std::vector<std::int32_t> labels;   // [batch]: the token after each window
};

// The sequence model's labels of `rows` windows from row `first`: each
// token's next one. Token i of a window is labelled by token i + 1, the last
// by the window's label.
inline void next_token_labels(const Batch& batch, std::size_t first, std::size_t rows, std::size_t length,
                              std::vector<std::int32_t>& out) {
  out.resize(rows * length);
  for (std::size_t r = 0; r < rows; ++r) {
    const std::int32_t* window = batch.windows.data() + (first + r) * length;
    std::copy(window + 1, window + length, out.begin() + static_cast<std::ptrdiff_t>(r * length));
    out[r * length + length - 1] = batch.labels[first + r];
  }
}

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

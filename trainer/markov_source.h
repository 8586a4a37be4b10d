// The default training data: a Markov chain of a fixed order over a small
// vocabulary, generated from the seed, whose entropy rate is computed exactly
// so the loss has a known floor.
//
// Note [Markov source]
// A state is the last `order` tokens, a base-V number with the newest token
// least significant; P(x | state) is one row of the transition table. Each row
// is Dirichlet-like with concentration alpha (few likely tokens, so the
// entropy rate is well below log V), mixed with `smoothing` of the uniform
// distribution, so every transition is possible and the chain is irreducible
// and aperiodic: its stationary distribution pi is unique and power iteration
// finds it. Entropy rate H = -sum_s pi(s) sum_x P(x|s) log P(x|s) nats/token.
// Every example starts in a state drawn from pi, so examples are stationary
// samples and the best possible mean loss is exactly H (for context >= order).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "trainer/data_source.h"

namespace stepgraph::trainer {

struct MarkovConfig {
  std::int64_t vocab = 16;     // V, 2..65536
  std::int64_t order = 2;      // o >= 1; V^o states, V^(o+1) <= 2^24 table entries
  std::uint64_t seed = 0;      // the table and the samples
  double concentration = 0.3;  // alpha > 0 of each row: smaller, peakier rows, lower entropy rate
  double smoothing = 0.01;     // in (0, 1]: the uniform share of each row
  std::int64_t context = 0;    // the window the model sees, only for describe(); 0: not known
};

class MarkovSource final : public DataSource {
 public:
  // Throws Error(kInvalidArgument) for a config out of range.
  explicit MarkovSource(const MarkovConfig& config);

  std::int64_t vocab() const override { return config_.vocab; }
  std::string describe() const override;
  std::optional<double> entropy_rate() const override { return entropy_rate_; }
  void next_batch(std::int64_t batch, std::int64_t context, Batch& out) override;
  std::uint64_t position() const override { return position_; }
  void seek(std::uint64_t position) override { position_ = position; }

  const MarkovConfig& config() const { return config_; }
  std::int64_t states() const { return states_; }
  // P(token | state).
  double probability(std::int64_t state, std::int32_t token) const {
    return table_[static_cast<std::size_t>(state * config_.vocab + token)];
  }
  // The state after `state` emits `token`.
  std::int64_t next_state(std::int64_t state, std::int32_t token) const {
    return (state * config_.vocab + token) % states_;
  }
  const std::vector<double>& stationary() const { return stationary_; }
  // The best mean loss a model seeing only the last `context` tokens can
  // reach: H(next | last context tokens) under pi. Equals entropy_rate() for
  // context >= order; larger below it.
  double conditional_entropy(std::int64_t context) const;

 private:
  std::int32_t sample_token(std::int64_t state, double u) const;

  MarkovConfig config_;
  std::int64_t states_ = 0;
  std::vector<double> table_;           // [states, vocab] probabilities
  std::vector<double> cumulative_;      // [states, vocab] running sums, for sampling
  std::vector<double> stationary_;      // [states]
  std::vector<double> stationary_cdf_;  // [states]
  double entropy_rate_ = 0;
  std::uint64_t position_ = 0;
  bool warned_short_context_ = false;
};

std::unique_ptr<DataSource> make_markov_source(const MarkovConfig& config);

}  // namespace stepgraph::trainer

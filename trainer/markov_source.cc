#include "trainer/markov_source.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "engine/error.h"
#include "engine/logging.h"
#include "trainer/counter_rng.h"

namespace stepgraph::trainer {
namespace {

// Streams of one seed, so the table and the samples are independent.
constexpr std::uint64_t kTableStream = 1;
constexpr std::uint64_t kSampleStream = 2;

constexpr std::int64_t kMaxTableEntries = std::int64_t{1} << 24;
// Note [Stationary error bound]
// Near convergence the L1 step of power iteration shrinks geometrically with
// the chain's mixing ratio r, so the error left is at most about
// step * r / (1 - r). r is measured over the last quarter of the steps (at
// least kRatioSpan; single steps can oscillate). Steps below kRoundOff are
// round-off noise and measure nothing: there the bound is what r allows, about
// 1e-14 for the default configs, and a chain that mixes so slowly that it
// passes kAcceptableError is an error.
constexpr std::size_t kMaxPowerIterations = 2'000'000;
constexpr double kStationaryTolerance = 1e-13;
constexpr double kAcceptableError = 1e-10;
constexpr double kRoundOff = 1e-14;
constexpr std::size_t kRatioSpan = 10;

// V^n, or -1 once it passes `limit`.
std::int64_t power_up_to(std::int64_t base, std::int64_t n, std::int64_t limit) {
  std::int64_t result = 1;
  for (std::int64_t i = 0; i < n; ++i) {
    if (result > limit / base) return -1;
    result *= base;
  }
  return result;
}

void check_config(const MarkovConfig& config) {
  SG_CHECK(config.vocab >= 2 && config.vocab <= 65536, "Markov source: vocab must be in [2, 65536], got ",
           config.vocab);
  SG_CHECK(config.order >= 1, "Markov source: order must be >= 1, got ", config.order);
  SG_CHECK(power_up_to(config.vocab, config.order + 1, kMaxTableEntries) > 0,
           "Markov source: --vocab ^ (--order + 1) = ", config.vocab, "^", config.order + 1,
           " passes the table limit of 2^24 entries; use a smaller --vocab or --order");
  SG_CHECK(std::isfinite(config.concentration) && config.concentration > 0,
           "Markov source: concentration must be > 0, got ", config.concentration);
  SG_CHECK(config.smoothing > 0 && config.smoothing <= 1, "Markov source: smoothing must be in (0, 1], got ",
           config.smoothing);
  SG_CHECK(config.context >= 0, "Markov source: context must be >= 0 (0: not known), got ", config.context);
}

// Index of the first running sum above u * total in [first, first + n).
std::int64_t sample_cdf(const double* cumulative, std::int64_t n, double u) {
  const double target = u * cumulative[n - 1];
  const double* found = std::upper_bound(cumulative, cumulative + n, target);
  return std::min<std::int64_t>(found - cumulative, n - 1);
}

void running_sums(const double* values, std::int64_t n, double* sums) {
  double total = 0;
  for (std::int64_t i = 0; i < n; ++i) sums[i] = (total += values[i]);
}

// The transition table [states, vocab]. See Note [Markov source].
std::vector<double> generate_table(const MarkovConfig& config, std::int64_t states) {
  const std::int64_t v = config.vocab;
  // Rows: Dirichlet-like weights G * U^(1/alpha) (G ~ Exp(1), U uniform),
  // the Gamma(alpha) construction with Exp(1) in place of Gamma(alpha + 1),
  // then the uniform share.
  std::vector<double> table(static_cast<std::size_t>(states * v));
  for (std::int64_t s = 0; s < states; ++s) {
    CounterRng rng(config.seed, kTableStream, static_cast<std::uint64_t>(s), 0);
    double* row = &table[static_cast<std::size_t>(s * v)];
    double sum = 0;
    for (std::int64_t x = 0; x < v; ++x) {
      const double exponential = -std::log1p(-rng.next_double());
      row[x] = exponential * std::pow(1.0 - rng.next_double(), 1.0 / config.concentration);
      sum += row[x];
    }
    const double peaked = sum > 0 ? (1.0 - config.smoothing) / sum : 0.0;
    const double uniform = sum > 0 ? config.smoothing / static_cast<double>(v) : 1.0 / static_cast<double>(v);
    for (std::int64_t x = 0; x < v; ++x) row[x] = row[x] * peaked + uniform;
  }
  return table;
}

// pi with pi P = pi by power iteration. See Note [Stationary error bound].
std::vector<double> stationary_distribution(const std::vector<double>& table, const MarkovConfig& config,
                                            std::int64_t states) {
  const std::int64_t v = config.vocab;
  std::vector<double> pi(static_cast<std::size_t>(states), 1.0 / static_cast<double>(states));
  std::vector<double> next(pi.size());
  std::vector<double> steps;
  double ratio = 0;
  double error_bound = std::numeric_limits<double>::infinity();
  while (error_bound > kStationaryTolerance && steps.size() < kMaxPowerIterations) {
    std::fill(next.begin(), next.end(), 0.0);
    for (std::int64_t s = 0; s < states; ++s) {
      const double mass = pi[static_cast<std::size_t>(s)];
      const std::int64_t base = (s * v) % states;
      const double* row = &table[static_cast<std::size_t>(s * v)];
      for (std::int64_t x = 0; x < v; ++x) next[static_cast<std::size_t>(base + x)] += mass * row[x];
    }
    double total = 0;
    for (double p : next) total += p;
    double step = 0;
    for (std::size_t i = 0; i < next.size(); ++i) {
      next[i] /= total;
      step += std::abs(next[i] - pi[i]);
    }
    pi.swap(next);
    steps.push_back(step);
    const std::size_t span = std::max(kRatioSpan, steps.size() / 4);
    if (step <= kRoundOff) {
      // Further steps are noise: the bound stays at what the rate allows.
      error_bound = ratio < 1 && ratio > 0 ? kRoundOff * ratio / (1 - ratio) : step;
      break;
    }
    if (steps.size() > span) {
      ratio = std::pow(step / steps[steps.size() - 1 - span], 1.0 / static_cast<double>(span));
      if (ratio < 1) error_bound = step * ratio / (1 - ratio);
    }
  }
  SG_CHECK_CODE(error_bound <= kAcceptableError, ErrorCode::kInternal,
                "Markov source: the stationary distribution did not converge (L1 error bound ", error_bound, " after ",
                steps.size(), " power iterations; vocab ", v, ", order ", config.order, ", concentration ",
                config.concentration, ", smoothing ", config.smoothing,
                "): the chain mixes too slowly, raise the smoothing or the concentration");
  logger().debug("Markov source: stationary distribution after {} power iterations, L1 error <= {:.2g}", steps.size(),
                 error_bound);
  return pi;
}

}  // namespace

MarkovSource::MarkovSource(const MarkovConfig& config) : config_(config) {
  check_config(config_);
  const std::int64_t v = config_.vocab;
  states_ = power_up_to(v, config_.order, kMaxTableEntries);
  table_ = generate_table(config_, states_);
  cumulative_.resize(table_.size());
  for (std::int64_t s = 0; s < states_; ++s) {
    running_sums(&table_[static_cast<std::size_t>(s * v)], v, &cumulative_[static_cast<std::size_t>(s * v)]);
  }
  stationary_ = stationary_distribution(table_, config_, states_);
  stationary_cdf_.resize(stationary_.size());
  running_sums(stationary_.data(), states_, stationary_cdf_.data());
  entropy_rate_ = conditional_entropy(config_.order);
}

double MarkovSource::conditional_entropy(std::int64_t context) const {
  SG_CHECK(context >= 0, "conditional_entropy: context must be >= 0, got ", context);
  const std::int64_t v = config_.vocab;
  // The window's states: the last min(context, order) tokens.
  const std::int64_t windows = power_up_to(v, std::min(context, config_.order), states_);
  std::vector<double> joint(static_cast<std::size_t>(windows * v), 0.0);  // p(window, next)
  for (std::int64_t s = 0; s < states_; ++s) {
    const double mass = stationary_[static_cast<std::size_t>(s)];
    double* out = &joint[static_cast<std::size_t>((s % windows) * v)];
    for (std::int64_t x = 0; x < v; ++x) out[x] += mass * probability(s, static_cast<std::int32_t>(x));
  }
  double entropy = 0;
  for (std::int64_t w = 0; w < windows; ++w) {
    const double* row = &joint[static_cast<std::size_t>(w * v)];
    double marginal = 0;
    for (std::int64_t x = 0; x < v; ++x) marginal += row[x];
    for (std::int64_t x = 0; x < v; ++x) {
      if (row[x] > 0) entropy -= row[x] * std::log(row[x] / marginal);
    }
  }
  return entropy;
}

std::string MarkovSource::describe() const {
  std::string text = fmt::format(
      "Markov source: order {} over {} tokens, seed {}, concentration {}, smoothing {}; entropy rate {:.6f} "
      "nats/token (log vocab {:.4f})",
      config_.order, config_.vocab, config_.seed, config_.concentration, config_.smoothing, entropy_rate_,
      std::log(static_cast<double>(config_.vocab)));
  if (config_.context > 0 && config_.context < config_.order) {
    text += fmt::format(
        "; context {} < order {}: the entropy rate is not reachable, the best loss with this window is {:.6f}",
        config_.context, config_.order, conditional_entropy(config_.context));
  }
  return text;
}

std::int32_t MarkovSource::sample_token(std::int64_t state, double u) const {
  return static_cast<std::int32_t>(
      sample_cdf(&cumulative_[static_cast<std::size_t>(state * config_.vocab)], config_.vocab, u));
}

void MarkovSource::next_batch(std::int64_t batch, std::int64_t context, Batch& out) {
  SG_CHECK(batch >= 1, "next_batch: batch must be >= 1, got ", batch);
  SG_CHECK(context >= 1, "next_batch: context must be >= 1, got ", context);
  const std::int64_t order = config_.order;
  const std::int64_t v = config_.vocab;
  if (context < order && !warned_short_context_) {
    logger().warn(
        "Markov source: context {} < order {}: the entropy rate {:.6f} is not reachable, the best loss with this "
        "window is {:.6f} nats/token",
        context, order, entropy_rate_, conditional_entropy(context));
    warned_short_context_ = true;
  }
  // The start state's tokens, then enough steps to fill the window and label.
  const std::int64_t length = std::max(order, context) + 1;
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(length));
  out.windows.resize(static_cast<std::size_t>(batch * context));
  out.labels.resize(static_cast<std::size_t>(batch));
  for (std::int64_t r = 0; r < batch; ++r) {
    CounterRng rng(config_.seed, kSampleStream, position_, static_cast<std::uint64_t>(r));
    std::int64_t state = sample_cdf(stationary_cdf_.data(), states_, rng.next_double());
    for (std::int64_t i = order - 1, rest = state; i >= 0; --i, rest /= v) {
      tokens[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(rest % v);
    }
    for (std::int64_t i = order; i < length; ++i) {
      const std::int32_t token = sample_token(state, rng.next_double());
      tokens[static_cast<std::size_t>(i)] = token;
      state = next_state(state, token);
    }
    std::copy(tokens.end() - 1 - context, tokens.end() - 1, out.windows.begin() + r * context);
    out.labels[static_cast<std::size_t>(r)] = tokens.back();
  }
  ++position_;
}

std::unique_ptr<DataSource> make_markov_source(const MarkovConfig& config) {
  return std::make_unique<MarkovSource>(config);
}

}  // namespace stepgraph::trainer

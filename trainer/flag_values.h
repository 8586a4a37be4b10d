// CLI11 validators for the trainer's numeric flags. They read the flag's text
// before CLI11 converts it, so every value that is not plainly a number of the
// right kind and range is refused naming the flag ("--steps: '2.5' is not a
// whole number ..."), never rounded, wrapped, or left to CLI11's generic
// messages ("At Most 1 required but received 2" for "2.5").
//
//   app.add_option("--steps", o.steps)->check(whole_number(1, kMaxSteps));
//   app.add_option("--lr", o.lr)->check(real_number(0, 1e6, Bound::kExclusive));
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>

namespace stepgraph::trainer {

// Steps and step counts (--steps, --warmup-steps, --log-every, ...): a run of
// more is not a run anyone waits for, and the schedule's float arithmetic
// keeps whole steps exact below 2^40 in double.
inline constexpr std::int64_t kMaxSteps = std::int64_t{1} << 40;
// Sizes (--hidden, --batch, --seq-len, ...): tensor dimensions, token counts
// and kernel arguments are 32-bit integers downstream.
inline constexpr std::int64_t kMaxSize = (std::int64_t{1} << 31) - 1;

// A decimal integer in [min, max]: no sign but '-', no fraction, exponent,
// hex, spaces or trailing characters.
CLI::Validator whole_number(std::int64_t min, std::int64_t max);

// The same for unsigned values (--seed).
CLI::Validator unsigned_number(std::uint64_t max);

enum class Bound { kInclusive, kExclusive };

// A finite decimal number in [min, max] ((min, max] with kExclusive): NaN and
// infinities are refused.
CLI::Validator real_number(double min, double max, Bound lower = Bound::kInclusive);

// A value that is not empty: `--data ""` would otherwise mean "no file" and
// train on the Markov source without a word.
CLI::Validator non_empty();

}  // namespace stepgraph::trainer

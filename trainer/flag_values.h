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
#include <string>
#include <utility>
#include <vector>

#include "engine/error.h"

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

// A flag whose value is one of `choices` by name: --help lists the names,
// another value is refused naming the flag ("--dtype: fp64 not in
// {bf16,fp16,fp32}"), and the chosen value is stored in `target` once, here.
//   add_choice(app, "--dtype", o.dtype, {{"bf16", DType::kBFloat16}, ...}, "model dtype");
template <typename T>
CLI::Option* add_choice(CLI::App& app, const std::string& flag, T& target,
                        std::vector<std::pair<std::string, T>> choices, const std::string& help) {
  std::vector<std::string> names;
  for (const auto& choice : choices) names.push_back(choice.first);
  return app
      .add_option_function<std::string>(
          flag,
          [&target, choices](const std::string& name) {
            for (const auto& [choice_name, value] : choices) {
              if (choice_name == name) target = value;
            }
          },
          help)
      ->check(CLI::IsMember(names));
}

// A flag whose text `parse` turns into `target` (MLPOverlap::parse,
// BucketSpec::parse): its stepgraph::Error becomes a usage error naming the
// flag ("--overlap: unknown overlap mode 'fast' ...").
template <typename T, typename Parse>
CLI::Option* add_parsed(CLI::App& app, const std::string& flag, T& target, Parse parse, const std::string& help) {
  return app.add_option_function<std::string>(
      flag,
      [&target, flag, parse](const std::string& text) {
        try {
          target = parse(text);
        } catch (const Error& error) {
          const std::string& message = error.message();
          if (message.starts_with(flag + ":")) throw CLI::ValidationError(message);  // it names the flag already
          throw CLI::ValidationError(flag, message);
        }
      },
      help);
}

}  // namespace stepgraph::trainer

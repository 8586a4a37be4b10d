// The C++ trainer's side of python_trainer_parity_test.py: runs train() (the
// trainer's own loop) on the host with the given trainer flags and writes, as
// JSON, its losses at full precision and, for every step and rank, the very
// inputs the loop copies into its step: token ids, labels, and with buckets
// the packing and the bucket. The Python side loads the same inputs into a
// model built from the same options and must reach the same losses bit for
// bit.
//
//   trainer_reference OUT.json [--ranks N] TRAINER_FLAGS...
//
// --ranks N runs N ranks on a host thread world (data parallelism), as the
// trainer's own tests do.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "engine/device.h"
#include "engine/error.h"
#include "engine/host_world.h"
#include "train/context_parallel_batch.h"
#include "trainer/buckets.h"
#include "trainer/data_source.h"
#include "trainer/markov_source.h"
#include "trainer/options.h"
#include "trainer/token_file.h"
#include "trainer/train_loop.h"

namespace stepgraph::trainer {
namespace {

std::string json_list(const std::vector<std::int32_t>& values) { return fmt::format("[{}]", fmt::join(values, ",")); }

// Rows [first, first + rows) of the batch's windows, `width` tokens each.
std::vector<std::int32_t> window_tokens(const Batch& batch, std::size_t first, std::size_t rows, std::size_t width) {
  return std::vector<std::int32_t>(batch.windows.begin() + static_cast<std::ptrdiff_t>(first * width),
                                   batch.windows.begin() + static_cast<std::ptrdiff_t>((first + rows) * width));
}

// Each token's next one; the last of a window is the batch's label of its row
// (`tokens` are window_tokens from row `first`).
std::vector<std::int32_t> next_token_labels(const Batch& batch, const std::vector<std::int32_t>& tokens,
                                            std::size_t first, std::size_t width) {
  std::vector<std::int32_t> labels(tokens.size());
  for (std::size_t r = 0; r < tokens.size() / width; ++r) {
    for (std::size_t i = 0; i + 1 < width; ++i) labels[r * width + i] = tokens[r * width + i + 1];
    labels[r * width + width - 1] = batch.labels[first + r];
  }
  return labels;
}

// The inputs train_loop.cc copies into rank `rank`'s step at step `s` (1-based).
std::string step_inputs(const TrainerOptions& o, const Batch& batch, std::int64_t s, int rank, int ranks) {
  const std::int64_t local_batch = o.batch / ranks;
  const auto first = static_cast<std::size_t>(rank * local_batch);
  const auto rows = static_cast<std::size_t>(local_batch);
  const auto width = static_cast<std::size_t>(o.context);
  if (!o.buckets.empty()) {
    const std::vector<std::int64_t> buckets =
        parse_buckets(o.buckets, local_batch * o.min_seq_len, local_batch * o.seq_len);
    const std::vector<std::int64_t> lengths =
        sequence_lengths(static_cast<std::uint64_t>(o.seed), s, local_batch, o.min_seq_len, o.seq_len);
    std::int64_t total = 0;
    for (std::int64_t length : lengths) total += length;
    const std::int64_t bucket = buckets[bucket_for(buckets, total)];
    const std::int64_t sequences = padded_sequences(local_batch, bucket, o.seq_len);
    PackedBatch packed;
    pack_into_bucket(batch, first, width, lengths, bucket, sequences, packed);
    return fmt::format(R"({{"tokens":{},"labels":{},"packing":{},"bucket":{},"sequences":{}}})",
                       json_list(packed.tokens), json_list(packed.labels), json_list(packed.cu_seqlens), bucket,
                       sequences);
  }
  if (o.cp > 1) {
    // Context-parallel: the rank's zig-zag chunks of its TP x CP group's tokens
    // and next-token labels, and the TP rank's rows of those, as train_loop.cc
    // copies them.
    const auto tp = static_cast<int>(o.tp);
    const auto cp = static_cast<int>(o.cp);
    const int dp = ranks / (tp * cp);
    const int tp_rank = rank % tp;
    const int cp_rank = (rank / tp) % cp;
    const int dp_rank = rank / (tp * cp);
    const auto group_rows = static_cast<std::size_t>(o.batch / dp);
    const std::vector<std::int32_t> group_tokens = window_tokens(batch, dp_rank * group_rows, group_rows, width);
    const std::vector<std::int32_t> group_labels = next_token_labels(batch, group_tokens, dp_rank * group_rows, width);
    const std::size_t n = rows * width;
    const auto mine = [&](const std::vector<std::int32_t>& all) {
      const std::vector<std::int32_t> chunks = context_parallel_rows<std::int32_t>(all, 1, cp, cp_rank);
      return std::vector<std::int32_t>(chunks.begin() + static_cast<std::ptrdiff_t>(tp_rank * n),
                                       chunks.begin() + static_cast<std::ptrdiff_t>((tp_rank + 1) * n));
    };
    // The group's whole batch too, from which Python's sg.context_parallel_rows must cut the same share.
    return fmt::format(R"({{"tokens":{},"labels":{},"group_tokens":{},"group_labels":{}}})",
                       json_list(mine(group_tokens)), json_list(mine(group_labels)), json_list(group_tokens),
                       json_list(group_labels));
  }
  const std::vector<std::int32_t> tokens = window_tokens(batch, first, rows, width);
  std::vector<std::int32_t> labels;
  if (o.heads > 0) {
    labels = next_token_labels(batch, tokens, first, width);
  } else {
    labels.assign(batch.labels.begin() + static_cast<std::ptrdiff_t>(first),
                  batch.labels.begin() + static_cast<std::ptrdiff_t>(first + rows));
  }
  return fmt::format(R"({{"tokens":{},"labels":{}}})", json_list(tokens), json_list(labels));
}

int run(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: trainer_reference OUT.json [--ranks N] TRAINER_FLAGS...\n";
    return 2;
  }
  const std::string out_path = argv[1];
  std::vector<std::string> args(argv + 2, argv + argc);
  int ranks = 1;
  if (args.size() >= 2 && args[0] == "--ranks") {
    ranks = std::stoi(args[1]);
    args.erase(args.begin(), args.begin() + 2);
  }
  const ParsedCommandLine parsed = parse_command_line(args);
  if (!parsed.options) {
    std::cerr << parsed.message;
    return parsed.exit_code;
  }
  const TrainerOptions o = resolve_defaults(*parsed.options, Device::kHost);

  std::vector<float> losses;
  std::ostringstream log;
  if (ranks == 1) {
    losses = train(o, Device::kHost, log).losses;
  } else {
    HostWorld::run(ranks, [&](Communicator& comm) {
      std::ostringstream rank_log;
      std::vector<float> mine = train(o, Device::kHost, rank_log, &comm).losses;
      if (comm.rank() == 0) {
        losses = std::move(mine);
        log << rank_log.str();
      }
    });
  }

  // The same data source as train_loop.cc's open_data.
  std::unique_ptr<DataSource> data =
      o.data.empty() ? make_markov_source(MarkovConfig{.vocab = o.vocab, .order = o.order, .seed = o.seed,
                                                       .context = o.context})
                     : open_token_data(o.data, o.seed);
  std::ofstream out(out_path);
  out << fmt::format(R"({{"vocab":{},"losses":[)", data->vocab());
  for (std::size_t i = 0; i < losses.size(); ++i) out << (i > 0 ? "," : "") << fmt::format("{:.9g}", losses[i]);
  out << R"(],"steps":[)";
  Batch batch;
  for (std::int64_t s = 1; s <= o.steps; ++s) {
    data->next_batch(o.batch, o.context, batch);
    out << (s > 1 ? "," : "") << "[";
    for (int r = 0; r < ranks; ++r) out << (r > 0 ? "," : "") << step_inputs(o, batch, s, r, ranks);
    out << "]";
  }
  out << "]}\n";
  std::cerr << log.str();  // the trainer's log, for a failing test's output
  SG_CHECK_CODE(out.good(), ErrorCode::kIo, "trainer_reference: writing ", out_path, " failed");
  return 0;
}

}  // namespace
}  // namespace stepgraph::trainer

int main(int argc, char** argv) {
  try {
    return stepgraph::trainer::run(argc, argv);
  } catch (const std::exception& error) {
    std::cerr << "trainer_reference: " << error.what() << "\n";
    return 1;
  }
}

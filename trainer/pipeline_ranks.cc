#include "trainer/pipeline_ranks.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <string>
#include <vector>

#include "engine/error.h"

namespace stepgraph::trainer {

PipelineRanks pipeline_ranks(const TrainerOptions& o, int rank, int ranks) {
  PipelineRanks p;
  p.tp = static_cast<int>(o.tp);
  p.pp = static_cast<int>(o.pp);
  SG_CHECK(ranks % (p.tp * p.pp) == 0, "--tp ", o.tp, " x --pp ", o.pp, " must divide the world of ", ranks,
           " ranks (the world is tp x pp x dp: start a multiple of ", p.tp * p.pp, " ranks)");
  p.dp = ranks / (p.tp * p.pp);
  SG_CHECK(o.dp == 0 || o.dp == p.dp, "--dp ", o.dp, " needs a world of ", o.dp * o.tp * o.pp,
           " ranks, but this run has ", ranks,
           " (the world is --dp x --tp x --pp ranks: start that many, or leave --dp out)");
  // See Note [Pipeline ranks in the trainer].
  p.tp_rank = rank % p.tp;
  p.stage = (rank / p.tp) % p.pp;
  p.dp_rank = rank / (p.tp * p.pp);
  p.microbatches = o.microbatches;
  SG_CHECK(o.batch % (p.dp * o.microbatches) == 0, "--batch ", o.batch,
           " is the global batch: it must split evenly over the ", p.dp,
           " data-parallel replicas and then into --microbatches ", o.microbatches, " (a multiple of ",
           p.dp * o.microbatches, ")");
  p.microbatch_rows = o.batch / (p.dp * o.microbatches);
  const std::int64_t tokens = p.microbatch_rows * (o.heads > 0 ? o.context : 1);
  SG_CHECK(
      tokens % p.tp == 0, "--pp ", o.pp, " with --tp ", o.tp, ": a microbatch's ", tokens,
      o.heads > 0 ? " tokens (--batch / dp / --microbatches x --seq-len)" : " examples (--batch / dp / --microbatches)",
      " must split evenly over the ", o.tp, " tensor-parallel ranks; change --batch or --microbatches");
  return p;
}

PipelineGroups::PipelineGroups(Communicator& world, const PipelineRanks& p) {
  const int rank = world.rank();
  pipeline_ = &world;
  if (p.pp < world.world_size()) {
    pipeline_group_ = world.split(p.tp_rank + p.tp * p.dp_rank, p.stage, "pp");
    pipeline_ = pipeline_group_.get();
  }
  if (p.dp > 1) {
    data_parallel_group_ = world.split(p.tp_rank + p.tp * p.stage, rank, "dp");
    data_parallel_ = data_parallel_group_.get();
  }
}

void load_microbatches(Context& ctx, const LanguageModelStages& stages, const Batch& batch, const PipelineRanks& p,
                       bool sequences, std::int64_t width) {
  if (!stages.is_first() && !stages.is_last()) return;
  const auto w = static_cast<std::size_t>(width);
  const auto rows = static_cast<std::size_t>(p.microbatch_rows);
  // A TP rank's 1/tp of a microbatch's tokens (sequence model) or examples (window model).
  const std::size_t tokens = sequences ? rows * w : rows;
  const std::size_t mine = tokens / static_cast<std::size_t>(p.tp);
  const std::size_t offset = mine * static_cast<std::size_t>(p.tp_rank);
  std::vector<std::int32_t> labels;
  for (std::int64_t m = 0; m < p.microbatches; ++m) {
    const std::size_t first =
        (static_cast<std::size_t>(p.dp_rank) * static_cast<std::size_t>(p.microbatches) + static_cast<std::size_t>(m)) *
        rows;
    if (stages.is_first()) {
      // Sequence model: a token a row; window model: a row of `width` tokens an example.
      const std::size_t at = sequences ? first * w + offset : (first + offset) * w;
      const std::size_t count = sequences ? mine : mine * w;
      ctx.copy_from_host(stages.tokens(m), batch.windows.data() + at, count * sizeof(std::int32_t));
    }
    if (stages.is_last()) {
      const std::int32_t* source = nullptr;
      if (sequences) {
        next_token_labels(batch, first, rows, w, labels);
        source = labels.data() + offset;
      } else {
        source = batch.labels.data() + first + offset;
      }
      ctx.copy_from_host(stages.labels(m), source, mine * sizeof(std::int32_t));
    }
  }
}

namespace {

std::string blocks(std::int64_t first, std::int64_t last) { return fmt::format("[{}, {})", first, last); }

// What stage `stage` holds: its blocks chunk by chunk, the embedding and the head where it has them.
std::string held(int stage, int stages, int chunks, std::int64_t layers) {
  const std::int64_t per_chunk = layers / (static_cast<std::int64_t>(stages) * chunks);
  std::vector<std::string> parts;
  for (int c = 0; c < chunks; ++c) {
    const std::int64_t first = (static_cast<std::int64_t>(c) * stages + stage) * per_chunk;
    parts.push_back(blocks(first, first + per_chunk));
  }
  std::string out = fmt::format("block{} {}", per_chunk * chunks == 1 ? "" : "s", fmt::join(parts, " and "));
  if (stage == 0) out += ", the embedding";
  if (stage + 1 == stages) out += ", the final norm and the head";
  return out;
}

}  // namespace

std::string pipeline_setup_line(const LanguageModelStages& stages, const PipelineRanks& p, std::int64_t layers,
                                bool sequences, const Communicator* data_parallel) {
  const int chunks = stages.virtual_stages();
  std::string line = fmt::format(
      "pipeline parallel: {} stages ({}), {} chunk{} a rank, {} microbatches of {} {}, {}; this rank (stage {}) "
      "holds {}",
      p.pp, stages.communicators().front()->describe(), chunks, chunks == 1 ? "" : "s", p.microbatches,
      p.microbatch_rows, sequences ? "sequences" : "examples", chunks == 1 ? "1F1B" : "interleaved 1F1B", p.stage,
      held(p.stage, p.pp, chunks, layers));
  if (p.stage + 1 != p.pp) line += fmt::format("; the last stage holds {}", held(p.pp - 1, p.pp, chunks, layers));
  line += fmt::format("; {} passes a step on this stage", stages.passes().size());
  if (data_parallel != nullptr) {
    line += fmt::format("; each stage's gradients summed over its {} replicas ({})", p.dp, data_parallel->describe());
  }
  return line + "\n";
}

}  // namespace stepgraph::trainer

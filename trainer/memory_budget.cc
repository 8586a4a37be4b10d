#include "trainer/memory_budget.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <string>

#include "engine/error.h"
#include "trainer/token_file.h"

namespace stepgraph::trainer {
namespace {

// A cgroup's memory limit (v2, then v1), or 0 where there is none.
double cgroup_limit() {
  for (const char* path : {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::ifstream in(path);
    std::string value;
    if (in >> value && !value.empty() && std::all_of(value.begin(), value.end(), ::isdigit)) {
      return std::stod(value);
    }
  }
  return 0;
}

}  // namespace

std::string format_bytes(double bytes) {
  if (bytes >= 1024.0 * 1024 * 1024 * 1024) return fmt::format("{:.3g} TiB", bytes / (1024.0 * 1024 * 1024 * 1024));
  if (bytes >= 1024.0 * 1024 * 1024) return fmt::format("{:.1f} GiB", bytes / (1024.0 * 1024 * 1024));
  return fmt::format("{:.1f} MiB", bytes / (1024.0 * 1024));
}

MemoryNeed estimate_memory(const TrainerOptions& o, std::int64_t vocab, std::int64_t dp) {
  const double b = static_cast<double>(dtype_size(o.dtype.value_or(DType::kBFloat16)));
  // A parameter element: its value (b bytes), its gradient (b at least) and
  // AdamW's fp32 master and two moments; an fp32 value is its own master.
  const double per_parameter = b == 4 ? 16 : 2 * b + 12;
  // Tensor-parallel ranks hold 1/tp of every weight (the embedding table
  // and the head are vocabulary-parallel); context-parallel ranks 1/cp of
  // every sequence's tokens.
  const double tp = static_cast<double>(std::max<std::int64_t>(o.tp, 1));
  const double cp = static_cast<double>(std::max<std::int64_t>(o.cp, 1));
  const double hidden = static_cast<double>(o.hidden);
  const double ffn = static_cast<double>(o.ffn);
  const double layers = static_cast<double>(o.layers);
  const bool sequences = o.heads > 0;
  // The head's width is the vocabulary rounded up to 8 (train_loop.cc's model_vocab), at least.
  const double v = static_cast<double>((vocab + 7) / 8 * 8);
  const double embedding_dim = sequences ? hidden : hidden / static_cast<double>(o.context);
  const double rows = static_cast<double>(o.batch) / static_cast<double>(std::max<std::int64_t>(dp, 1));
  const double tokens = rows * (sequences ? static_cast<double>(o.context) : 1.0) / cp;

  MemoryNeed need;
  // Pipeline stages (--pp): the embedding is the first stage's, the head and
  // its logits (a microbatch's) the last one's; the rank that holds more of
  // them needs at least that.
  const double pp = static_cast<double>(std::max<std::int64_t>(o.pp, 1));
  const double microbatch_tokens = o.pp > 1 ? tokens / static_cast<double>(std::max<std::int64_t>(o.microbatches, 1))
                                            : tokens;
  const double embedding = v * embedding_dim / tp * per_parameter;
  const double head = hidden * v / tp * per_parameter + microbatch_tokens * (v / tp) * b;
  need.vocab_bytes = o.pp > 1 ? std::max(embedding, head) : embedding + head;

  // Every second block is an MoE block when there are experts (ResidualStack's moe_every).
  const double moe_blocks = o.experts > 0 ? static_cast<double>(o.layers / 2) : 0;
  const double mlp = 2 * hidden * ffn / tp;
  // Expert-parallel ranks hold experts / ep whole experts of every MoE block.
  const double ep = static_cast<double>(std::max<std::int64_t>(o.ep, 1));
  double block_parameters = (layers - moe_blocks) * mlp + moe_blocks * static_cast<double>(o.experts) / ep * mlp;
  if (sequences) {
    const double head_dim = hidden / static_cast<double>(o.heads);
    const double kv = static_cast<double>(o.kv_heads > 0 ? o.kv_heads : o.heads) * head_dim;
    // q and the projection; k and v (split by heads: at least 1/tp of them)
    block_parameters += layers * (2 * hidden * hidden + 2 * hidden * kv) / tp;
  }
  // A stage holds 1/pp of the blocks and at least one microbatch's activations of them.
  block_parameters /= pp;
  double activations = microbatch_tokens * hidden * layers / pp * b;
  // Expert-parallel, an MoE block's experts receive and keep ep x (tokens x topk) rows, the bound no
  // routing exceeds (Note [Expert-parallel MoE] in layers/moe_mlp.h).
  if (o.ep > 1) activations += moe_blocks * ep * tokens * static_cast<double>(o.topk) * hidden * b;
  const double batches =
      2 * static_cast<double>(o.batch) * (static_cast<double>(o.context) + 1) * 4;  // this and the next
  need.other_bytes = block_parameters * per_parameter + activations + batches;
  return need;
}

MemoryLimit machine_memory(Device device, int local_rank) {
  if (device == Device::kCuda) {
    const DeviceProperties properties = device_properties(local_rank);
    const auto bytes = static_cast<double>(properties.total_memory_bytes);
    return {bytes, fmt::format("the memory of GPU {} ({})", local_rank, format_bytes(bytes))};
  }
  double bytes = static_cast<double>(::sysconf(_SC_PHYS_PAGES)) * static_cast<double>(::sysconf(_SC_PAGE_SIZE));
  std::string what = "host memory";
  if (const double limit = cgroup_limit(); limit > 0 && limit < bytes) {
    bytes = limit;
    what = "this container's memory limit";
  }
  return {bytes, fmt::format("{} ({})", what, format_bytes(bytes))};
}

void check_memory(const MemoryNeed& need, const TrainerOptions& o, std::int64_t vocab, const MemoryLimit& limit) {
  if (need.total() <= limit.bytes) return;
  if (!o.data.empty() && need.vocab_bytes > limit.bytes) {
    SG_THROW(ErrorCode::kOutOfMemory, "data file ", o.data, " has a vocabulary of ", vocab, " tokens: its embedding, ",
             "LM head, logits and their optimizer state need at least ", format_bytes(need.vocab_bytes),
             " with --hidden ", o.hidden, " and --batch ", o.batch, ", more than ", limit.what,
             "; use a file with a smaller vocabulary, or a smaller --hidden or --batch");
  }
  SG_THROW(ErrorCode::kOutOfMemory, "the model and batch of these flags need at least ", format_bytes(need.total()),
           " (vocabulary ", vocab, ": ", format_bytes(need.vocab_bytes), "; the ", o.layers,
           " blocks and activations: ", format_bytes(need.other_bytes), "), more than ", limit.what,
           "; lower --layers, --hidden, --ffn, --experts, ", "--batch or ", o.heads > 0 ? "--seq-len" : "--context");
}

void check_run_memory(const TrainerOptions& o, Device device, int world_size, int local_rank) {
  const std::int64_t vocab = o.data.empty() ? o.vocab : inspect_data_file(o.data).vocab;
  const std::int64_t model_ranks =
      std::max<std::int64_t>(o.tp, 1) * std::max<std::int64_t>(o.cp, 1) * std::max<std::int64_t>(o.pp, 1);
  // --ep's ranks split the batch as replicas do, --dp's replicas of them too (Note [Expert parallelism in the
  // trainer]): ep x dp rows a step.
  const std::int64_t dp =
      o.dp > 0 ? o.dp * std::max<std::int64_t>(o.ep, 1) : std::max<std::int64_t>(world_size / model_ranks, 1);
  check_memory(estimate_memory(o, vocab, dp), o, vocab, machine_memory(device, local_rank));
}

}  // namespace stepgraph::trainer

// The memory a run needs at least, from its flags and its data's vocabulary,
// checked against the machine before anything is allocated: a token file that
// claims a vocabulary of 100 M, or flags that describe a model larger than the
// device, end in an error naming the file or the flags, not in the kernel's
// out-of-memory killer.
//
//   check_run_memory(options, device, world_size, local_rank);  // in main, before train()
//
// The estimate is a lower bound (each parameter's value, fp32 master, Adam
// moments and gradient; the logits; one activation per block and token), so
// it never refuses a run that fits; a run it passes can still run out of
// memory, with the allocator's error.
#pragma once

#include <cstdint>
#include <string>

#include "engine/device.h"
#include "trainer/options.h"

namespace stepgraph::trainer {

struct MemoryNeed {
  // Bytes, as doubles: the products of huge flags must not overflow.
  double vocab_bytes = 0;  // embedding, LM head (with their optimizer state) and logits
  double other_bytes = 0;  // the blocks' parameters and optimizer state, activations, batches
  double total() const { return vocab_bytes + other_bytes; }
};

// `options` resolved (resolve_defaults); `vocab` the data's; `dp` the
// data-parallel ranks the global --batch is split among (each rank's share).
// With --pp, the most a stage holds: 1/pp of the blocks, the embedding or
// the head, one microbatch's activations. With --ep, a rank's experts / ep
// experts of every MoE block and the rows its experts receive (ep x its
// tokens x --topk a block).
MemoryNeed estimate_memory(const TrainerOptions& options, std::int64_t vocab, std::int64_t dp);

struct MemoryLimit {
  double bytes = 0;
  std::string what;  // "host memory (23.4 GiB)", for the message
};

// Host: the physical memory, or the cgroup's limit where lower. cuda: the
// device's memory.
MemoryLimit machine_memory(Device device, int local_rank);

// Error(kOutOfMemory) when `need` exceeds `limit`: naming the data file (`data`,
// empty for the Markov source) and its vocabulary when the vocabulary's part
// alone does not fit, else the flags that size the model and batch.
void check_memory(const MemoryNeed& need, const TrainerOptions& options, std::int64_t vocab, const MemoryLimit& limit);

// All of the above for one rank of a run: the vocabulary from the data file's
// header (inspect_data_file, which reads nothing else) or the Markov source's.
void check_run_memory(const TrainerOptions& options, Device device, int world_size, int local_rank);

// "1.5 GiB"
std::string format_bytes(double bytes);

}  // namespace stepgraph::trainer

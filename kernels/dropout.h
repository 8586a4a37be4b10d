// Dropout from a counter-based generator (kernels/philox.h) whose state is
// on the device: y = x * keep / (1 - p), keep drawn for each element from
// (seed, counter + offset + element / 4), with {seed, counter} an int64 [2]
// the launch reads, so a captured launch draws new numbers when the counter
// moves between replays, and a call with the same state and offset (the
// backward of a forward) draws the same ones: dropout's backward is this
// launch applied to dy. Element i is kept where word i % 4 of its draw is
// >= p * 2^32.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "engine/dtype.h"

namespace stepgraph::kernels {

struct DropoutDesc {
  std::int64_t count = 0;    // elements
  float p = 0.0f;            // the probability of dropping, in [0, 1)
  DType dtype = DType::kBFloat16;  // x and y: fp32, bf16 or fp16
  std::int64_t offset = 0;   // added to the counter: this call's draws (count / 4 rounded up of them)
};

// Throws Error naming what is wrong.
void check_dropout(const DropoutDesc& desc);
// The smallest 32-bit draw that keeps an element: round(p * 2^32).
std::uint32_t dropout_threshold(float p);
// Draws (4-element groups) a call of `count` elements takes.
inline std::int64_t dropout_draws(std::int64_t count) { return (count + 3) / 4; }

// `state`: device int64 [2], {seed, counter}.
void launch_dropout(const DropoutDesc& desc, const void* x, void* y, const std::int64_t* state, cudaStream_t stream);
// state[1] += draws (one thread): the next step's numbers.
void launch_rng_advance(std::int64_t* state, std::int64_t draws, cudaStream_t stream);

namespace host {
void dropout(const DropoutDesc& desc, const void* x, void* y, const std::int64_t* state);
void rng_advance(std::int64_t* state, std::int64_t draws);
}  // namespace host

}  // namespace stepgraph::kernels

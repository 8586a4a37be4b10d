// Writes a small checkpoint with known values to argv[1], for
// checkpoint_read_test.py, which reads it with plain Python.
#include <cstdint>
#include <cstring>
#include <iostream>
#include <vector>

#include "engine/error.h"
#include "checkpoint/checkpoint.h"

namespace {

using stepgraph::DType;
using stepgraph::CheckpointTensor;

template <typename T>
CheckpointTensor tensor(const char* name, DType dtype, std::vector<std::int64_t> shape, const std::vector<T>& values) {
  CheckpointTensor out{name, dtype, std::move(shape), std::vector<std::byte>(values.size() * sizeof(T))};
  std::memcpy(out.bytes.data(), values.data(), out.bytes.size());
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: checkpoint_writer PATH\n";
    return 2;
  }
  stepgraph::Checkpoint checkpoint;
  checkpoint.metadata = {{"step", "42"}, {"model", "read-check"}};
  std::vector<float> weight(6);
  for (int i = 0; i < 6; ++i) weight[i] = 0.5f * static_cast<float>(i) - 1.0f;
  checkpoint.tensors = {
      tensor("weight", DType::kFloat32, {2, 3}, weight),
      // bf16 1.0, -2.0, 0.5 and fp16 1.0, -0.5, as bit patterns.
      tensor("bias", DType::kBFloat16, {3}, std::vector<std::uint16_t>{0x3f80, 0xc000, 0x3f00}),
      tensor("half", DType::kFloat16, {2}, std::vector<std::uint16_t>{0x3c00, 0xb800}),
      tensor("ids", DType::kInt32, {4}, std::vector<std::int32_t>{1, 2, 3, -4}),
      tensor("step", DType::kInt64, {}, std::vector<std::int64_t>{42}),
  };
  try {
    stepgraph::write_checkpoint(argv[1], checkpoint);
  } catch (const stepgraph::Error& error) {
    std::cerr << "checkpoint_writer: " << error.message() << "\n";
    return 1;
  }
  return 0;
}

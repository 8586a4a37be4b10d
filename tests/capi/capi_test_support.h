// What the C API's tests share: the OK assertion that prints the last error,
// the small residual stack several of them train, and a train step's inputs
// written and one step run.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "capi/stepgraph.h"

#define ASSERT_SG_OK(call) ASSERT_EQ((call), SG_OK) << sg_last_error()

// A one-block fp32 stack of hidden 8, ffn 16, vocab 16.
inline sg_residual_stack_config small_fp32_stack_config() {
  sg_residual_stack_config stack;
  sg_residual_stack_config_default(&stack);
  stack.hidden = 8;
  stack.ffn = 16;
  stack.layers = 1;
  stack.vocab = 16;
  stack.dtype = SG_DTYPE_FLOAT32;
  return stack;
}

// Copies `tokens` and `labels` into a train step's inputs x and y.
inline void copy_step_inputs(sg_tensor x, sg_tensor y, const std::vector<int32_t>& tokens,
                             const std::vector<int32_t>& labels) {
  EXPECT_EQ(sg_tensor_copy_from_host(x, tokens.data(), tokens.size() * sizeof(int32_t)), SG_OK) << sg_last_error();
  EXPECT_EQ(sg_tensor_copy_from_host(y, labels.data(), labels.size() * sizeof(int32_t)), SG_OK) << sg_last_error();
}

// Runs one step; its loss (NaN, beside the failure, where the step fails).
inline float run_step_loss(sg_train_step step) {
  sg_tensor loss = nullptr;
  EXPECT_EQ(sg_train_step_run(step, &loss), SG_OK) << sg_last_error();
  float value = NAN;
  EXPECT_EQ(sg_tensor_copy_to_host(loss, &value, sizeof(value)), SG_OK);
  EXPECT_EQ(sg_tensor_destroy(loss), SG_OK);
  return value;
}

// What the C API's tests share: the OK assertion that prints the last error,
// and the small residual stack several of them train.
#pragma once

#include <gtest/gtest.h>

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

// For GPU tests: skip, saying why, where this machine has no CUDA device.
//
//   TEST(StreamTest, ForkJoin) {
//     SG_SKIP_WITHOUT_GPU();
//     ...
//   }
#pragma once

#include <gtest/gtest.h>

#include "engine/device.h"

#define SG_SKIP_WITHOUT_GPU()                                                    \
  do {                                                                           \
    const ::stepgraph::DeviceCount sg_found_ = ::stepgraph::cuda_device_count(); \
    if (sg_found_.count == 0) GTEST_SKIP() << sg_found_.no_device_reason;        \
  } while (false)

// Check for NCCL calls: a failure becomes a stepgraph::Error(kNccl) naming the
// call, NCCL's error text and the place.
//
//   SG_NCCL_CHECK(ncclAllReduce(...));
#pragma once

#include <nccl.h>

#include "engine/error.h"

namespace stepgraph::detail {

[[noreturn]] void raise_nccl(ncclResult_t status, const char* expression, SourcePlace place);

}  // namespace stepgraph::detail

#define SG_NCCL_CHECK(expr)                                             \
  do {                                                                  \
    const ncclResult_t sg_nccl_status_ = (expr);                        \
    if (sg_nccl_status_ != ncclSuccess) [[unlikely]] {                  \
      ::stepgraph::detail::raise_nccl(sg_nccl_status_, #expr, SG_HERE); \
    }                                                                   \
  } while (false)

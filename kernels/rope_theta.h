// The rotary frequency of pair f of `rotated` features, theta_f =
// base^(-2 f / rotated), shared by the kernels and the host reference.
//
// Computed in double and rounded once to float, so both sides get the same
// float: fp32 exp2f on the device and powf on the host differ in the last
// bit, and an angle p * theta_f of thousands of radians magnifies that into
// a rotation that differs in the fifth digit (a 8192-token sequence failed
// the fp32 tolerance of 2e-6 at 8.3e-6, seed 4087723480).
#pragma once

#include <cmath>

#include "kernels/host_device.h"

namespace stepgraph::kernels {

SG_HOST_DEVICE float rope_theta(int pair, int rotated, double log2_base) {
  return static_cast<float>(exp2(-2.0 * static_cast<double>(pair) / static_cast<double>(rotated) * log2_base));
}

}  // namespace stepgraph::kernels

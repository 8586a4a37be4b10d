// Host references of the LayerNorm/RMSNorm kernels: fp32 arithmetic per
// element, double accumulations over a row (statistics) and over rows
// (dgamma/dbeta), outputs rounded to the dtype (nearest even) like the
// device's conversions.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "engine/error.h"
#include "engine/half_precision.h"
#include "kernels/norm.h"

namespace stepgraph::kernels::host {
namespace {

void check_host_pointer(const char* op, const char* name, const void* pointer) {
  SG_CHECK(pointer != nullptr, op, ": ", name, " is null; pass a host array");
}

}  // namespace

void norm_forward(const NormDesc& desc, const void* x, const void* gamma, const void* beta, void* y, float* mean,
                  float* rstd) {
  check_norm(desc);
  const bool layer_norm = desc.kind == NormKind::kLayerNorm;
  const char* op = "host norm_forward";
  check_host_pointer(op, "x", x);
  check_host_pointer(op, "gamma", gamma);
  if (layer_norm) check_host_pointer(op, "beta", beta);
  check_host_pointer(op, "y", y);
  if (layer_norm) check_host_pointer(op, "mean", mean);
  check_host_pointer(op, "rstd", rstd);

  const std::int64_t hidden = desc.hidden;
  for (std::int64_t r = 0; r < desc.rows; ++r) {
    const std::int64_t start = r * hidden;
    float row_mean = 0.0f;
    if (layer_norm) {
      double sum = 0.0;
      for (std::int64_t j = 0; j < hidden; ++j) sum += load_as_float(desc.dtype, x, start + j);
      row_mean = static_cast<float>(sum / static_cast<double>(hidden));
    }
    double squares = 0.0;
    for (std::int64_t j = 0; j < hidden; ++j) {
      const double centered = static_cast<double>(load_as_float(desc.dtype, x, start + j)) - row_mean;
      squares += centered * centered;
    }
    const auto row_rstd =
        static_cast<float>(1.0 / std::sqrt(squares / static_cast<double>(hidden) + static_cast<double>(desc.eps)));
    for (std::int64_t j = 0; j < hidden; ++j) {
      const float xhat = (load_as_float(desc.dtype, x, start + j) - row_mean) * row_rstd;
      float out = xhat * load_as_float(desc.dtype, gamma, j);
      if (layer_norm) out += load_as_float(desc.dtype, beta, j);
      store_from_float(desc.dtype, y, start + j, out);
    }
    if (layer_norm) mean[r] = row_mean;
    rstd[r] = row_rstd;
  }
}

void norm_backward(const NormDesc& desc, const void* dy, const void* x, const float* mean, const float* rstd,
                   const void* gamma, void* dx, float* dgamma, float* dbeta, const void* dx_residual) {
  check_norm(desc);
  const bool layer_norm = desc.kind == NormKind::kLayerNorm;
  const char* op = "host norm_backward";
  check_host_pointer(op, "dy", dy);
  check_host_pointer(op, "x", x);
  if (layer_norm) check_host_pointer(op, "mean", mean);
  check_host_pointer(op, "rstd", rstd);
  check_host_pointer(op, "gamma", gamma);
  check_host_pointer(op, "dx", dx);
  check_host_pointer(op, "dgamma", dgamma);
  if (layer_norm) check_host_pointer(op, "dbeta", dbeta);

  const std::int64_t hidden = desc.hidden;
  std::vector<double> sum_gamma(static_cast<std::size_t>(hidden), 0.0);
  std::vector<double> sum_beta(static_cast<std::size_t>(hidden), 0.0);
  std::vector<float> xhat(static_cast<std::size_t>(hidden));
  std::vector<float> gdy(static_cast<std::size_t>(hidden));
  for (std::int64_t r = 0; r < desc.rows; ++r) {
    const std::int64_t start = r * hidden;
    const float row_mean = layer_norm ? mean[r] : 0.0f;
    const float row_rstd = rstd[r];
    double sum_gdy = 0.0;
    double sum_gdy_xhat = 0.0;
    for (std::int64_t j = 0; j < hidden; ++j) {
      const float d = load_as_float(desc.dtype, dy, start + j);
      xhat[j] = (load_as_float(desc.dtype, x, start + j) - row_mean) * row_rstd;
      gdy[j] = load_as_float(desc.dtype, gamma, j) * d;
      sum_gdy += gdy[j];
      sum_gdy_xhat += static_cast<double>(gdy[j]) * xhat[j];
      sum_gamma[j] += static_cast<double>(d) * xhat[j];
      sum_beta[j] += d;
    }
    const float mean_gdy = layer_norm ? static_cast<float>(sum_gdy / static_cast<double>(hidden)) : 0.0f;
    const auto mean_gdy_xhat = static_cast<float>(sum_gdy_xhat / static_cast<double>(hidden));
    for (std::int64_t j = 0; j < hidden; ++j) {
      const float residual = dx_residual != nullptr ? load_as_float(desc.dtype, dx_residual, start + j) : 0.0f;
      store_from_float(desc.dtype, dx, start + j,
                       row_rstd * (gdy[j] - mean_gdy - xhat[j] * mean_gdy_xhat) + residual);
    }
  }
  for (std::int64_t j = 0; j < hidden; ++j) {
    dgamma[j] = static_cast<float>(sum_gamma[j]);
    if (layer_norm) dbeta[j] = static_cast<float>(sum_beta[j]);
  }
}

}  // namespace stepgraph::kernels::host

// Values for the tensor-parallel tests: normal draws, a rank's rows or
// columns of a one-rank matrix (and a Slice saying which), and the closeness
// check they share (the split sums of N ranks differ from one rank's only in
// the order of fp32 additions; each test file says why its tolerance holds).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace stepgraph::testing {

inline std::vector<float> normal_values(std::uint32_t seed, std::int64_t n) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> out(static_cast<std::size_t>(n));
  for (float& v : out) v = normal(rng);
  return out;
}

// Rows [first, first + count) of a row-major matrix of `cols` columns.
template <typename T>
std::vector<T> rows(const std::vector<T>& m, std::int64_t cols, std::int64_t first, std::int64_t count) {
  return {m.begin() + first * cols, m.begin() + (first + count) * cols};
}

// Columns [first, first + count) of a row-major [row_count, cols] matrix.
inline std::vector<float> columns(const std::vector<float>& m, std::int64_t row_count, std::int64_t cols,
                                  std::int64_t first, std::int64_t count) {
  std::vector<float> out;
  for (std::int64_t r = 0; r < row_count; ++r) {
    out.insert(out.end(), m.begin() + r * cols + first, m.begin() + r * cols + first + count);
  }
  return out;
}

// Every element within `relative` of the largest reference value (at least
// `floor`, so that an all-small reference is not held to a vanishing bound).
inline void expect_close(const std::vector<float>& got, const std::vector<float>& want, const std::string& what,
                         float relative = 1e-5f, float floor = 1.0f) {
  ASSERT_EQ(got.size(), want.size()) << what;
  float scale = 0, worst = 0;
  for (float v : want) scale = std::max(scale, std::abs(v));
  for (std::size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(got[i] - want[i]));
  EXPECT_LE(worst, relative * std::max(scale, floor)) << what << ": largest difference " << worst << " of " << scale;
}

// How one rank's [rows, cols] tensor relates to one rank's whole one, and
// whether it must equal it bit for bit or only within the tolerance of a
// sum across ranks.
struct Slice {
  enum Kind { kWhole, kRows, kColumns } kind;
  std::int64_t rows;
  std::int64_t cols;
  bool summed = false;

  std::int64_t local_rows(int n) const { return kind == kRows ? rows / n : rows; }
  std::int64_t local_cols(int n) const { return kind == kColumns ? cols / n : cols; }
  // Rank r's part of `whole` in a world of n.
  std::vector<float> of(const std::vector<float>& whole, int r, int n) const {
    if (kind == kRows) return testing::rows(whole, cols, r * rows / n, rows / n);
    if (kind == kColumns) return testing::columns(whole, rows, cols, r * cols / n, cols / n);
    return whole;
  }
  Slice sum() const { return {kind, rows, cols, true}; }
};
inline Slice whole(std::int64_t rows, std::int64_t cols) { return {Slice::kWhole, rows, cols}; }
inline Slice by_rows(std::int64_t rows, std::int64_t cols) { return {Slice::kRows, rows, cols}; }
inline Slice by_columns(std::int64_t rows, std::int64_t cols) { return {Slice::kColumns, rows, cols}; }

}  // namespace stepgraph::testing

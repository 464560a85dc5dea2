// Few-row GEMMs on CPU, y = x w^T with x [m, K] and w [N, K] fp32, for decode steps (shared by moe_gemm_cpu.cpp, the
// routed experts, and linear_cpu.cpp, the dense layers): a decode step reads every weight to touch a handful of
// rows, so that read is the cost, where a GEMM library's packing and blocking are made for many rows (MKL's fp32
// GEMM read k3-small's dense weights at 10 GB/s for one row, this at 25: bench/linear_gemm.py). Each weight row is
// streamed from memory once and multiplied by all of the token rows while it is in registers, and the read is kept
// going while a block is multiplied: each block asks for the weight rows kPrefetchBytes ahead of it (into L2, not
// L1, where the token rows stay), else the cores wait on memory and then on arithmetic in turn (k3-small, 128 rows
// over 16 experts: 7 layers' GEMMs about 12 -> 7.3 ms, 14.5 -> 24 GB/s). cpu_extension.py rebuilds an op when
// this header changes.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_vec.h"

namespace radixk3_gemm {

using radixk3_vec::hsum;
using radixk3_vec::load;
using radixk3_vec::v16;

constexpr int64_t kPrefetchBytes = 64 << 10;

// y[i * ldy + r] = dot(w[r], x[i]) for weight rows r < RB and token rows i < NB (each row K floats). Every output
// is summed in the same order (16 lanes over K, then the lanes, then the tail), whatever RB and NB. `ahead`:
// RB rows to prefetch alongside, or null.
template <int RB, int NB>
void block(const float* w, int64_t K, const float* x, float* y, int64_t ldy, const float* ahead) {
  v16 acc[RB][NB] = {};
  int64_t d = 0;
  for (; d + 16 <= K; d += 16) {
    if (ahead != nullptr)
      for (int r = 0; r < RB; ++r) __builtin_prefetch(ahead + r * K + d, 0, 1);
    v16 xv[NB];
    for (int i = 0; i < NB; ++i) xv[i] = load(x + i * K + d);
    for (int r = 0; r < RB; ++r) {
      const v16 wv = load(w + r * K + d);
      for (int i = 0; i < NB; ++i) acc[r][i] += wv * xv[i];
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < NB; ++i) {
      float s = hsum(acc[r][i]);
      for (int64_t t = d; t < K; ++t) s += w[r * K + t] * x[i * K + t];
      y[i * ldy + r] = s;
    }
}

// RB weight rows times m token rows, four token rows at a time; the first pass also prefetches `ahead`.
template <int RB>
void rows(const float* w, int64_t K, const float* x, int64_t m, float* y, int64_t ldy, const float* ahead) {
  for (int64_t i = 0; i < m; i += 4) {
    const float* a = i == 0 ? ahead : nullptr;
    switch (std::min<int64_t>(4, m - i)) {
      case 1: block<RB, 1>(w, K, x + i * K, y + i * ldy, ldy, a); break;
      case 2: block<RB, 2>(w, K, x + i * K, y + i * ldy, ldy, a); break;
      case 3: block<RB, 3>(w, K, x + i * K, y + i * ldy, ldy, a); break;
      default: block<RB, 4>(w, K, x + i * K, y + i * ldy, ldy, a); break;
    }
  }
}

// Rows r0..r1 of weight w [N, K] (w and y at the weight's row 0 and its first output column): blocks of 4, 2, 1
// rows, each prefetching `ahead(r, rows in the block)`.
template <class Ahead>
void weight_rows(const float* w, int64_t r0, int64_t r1, int64_t K, const float* x, int64_t m, float* y, int64_t ldy,
                 Ahead ahead) {
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) rows<4>(w + r * K, K, x, m, y + r, ldy, ahead(r, 4));
  for (; r + 2 <= r1; r += 2) rows<2>(w + r * K, K, x, m, y + r, ldy, ahead(r, 2));
  for (; r < r1; ++r) rows<1>(w + r * K, K, x, m, y + r, ldy, ahead(r, 1));
}

constexpr int64_t kRowsPerTask = 32;  // weight rows per task: small enough to share an expert between threads

// x: [P, K] token rows grouped by expert (counts[e] rows of expert e, expert after expert); w: [E, N, K];
// y: [P, N] with y[p] = w[e(p)] x[p]. All fp32, row-major, contiguous. A dense layer is one expert.
inline void grouped_gemm(const float* x, const int64_t* counts, int64_t E, const float* w, int64_t N, int64_t K,
                         float* y) {
  std::vector<int64_t> start(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) start[e + 1] = start[e] + counts[e];
  std::vector<int64_t> task_expert, task_row;
  for (int64_t e = 0; e < E; ++e)
    if (counts[e] > 0)
      for (int64_t r = 0; r < N; r += kRowsPerTask) {
        task_expert.push_back(e);
        task_row.push_back(r);
      }
  const int64_t tasks = static_cast<int64_t>(task_expert.size());
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t e = task_expert[t], r0 = task_row[t], r1 = std::min(N, r0 + kRowsPerTask);
    const float* xe = x + start[e] * K;
    float* ye = y + start[e] * N;
    const int64_t m = counts[e];
    // the rows kPrefetchBytes further on (this expert's or the next one's: tasks run in order on a thread)
    const int64_t reach = std::max<int64_t>(4, kPrefetchBytes / (K * static_cast<int64_t>(sizeof(float))));
    auto ahead = [&](int64_t r, int64_t rb) -> const float* {
      const int64_t at = e * N + r + reach;
      return at + rb <= E * N ? w + at * K : nullptr;
    };
    weight_rows(w + e * N * K, r0, r1, K, xe, m, ye, N, ahead);
  }
}

// Several weights of one input: ws[i] [Ns[i], K] (each contiguous), y [m, sum Ns] with weight i's outputs at
// columns from cols[i] = Ns[0] + ... + Ns[i-1]: one parallel pass over all their rows, as one call each would do them
// (the same blocks, so the same bits), the prefetch running on from one weight into the next.
inline void multi_gemm(const float* x, int64_t m, const float* const* ws, const int64_t* Ns, int64_t count, int64_t K,
                       float* y) {
  std::vector<int64_t> cols(count + 1, 0);
  for (int64_t i = 0; i < count; ++i) cols[i + 1] = cols[i] + Ns[i];
  const int64_t ldy = cols[count];
  std::vector<int64_t> task_weight, task_row;
  for (int64_t i = 0; i < count; ++i)
    for (int64_t r = 0; r < Ns[i]; r += kRowsPerTask) {
      task_weight.push_back(i);
      task_row.push_back(r);
    }
  const int64_t tasks = static_cast<int64_t>(task_weight.size());
  const int64_t reach = std::max<int64_t>(4, kPrefetchBytes / (K * static_cast<int64_t>(sizeof(float))));
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t i = task_weight[t], r0 = task_row[t], r1 = std::min(Ns[i], r0 + kRowsPerTask);
    const float* w = ws[i];
    auto ahead = [&](int64_t r, int64_t rb) -> const float* {  // `reach` rows on: this weight's, or the next one's
      const int64_t at = r + reach;
      if (at + rb <= Ns[i]) return w + at * K;
      const int64_t next = at - Ns[i];
      return i + 1 < count && next + rb <= Ns[i + 1] ? ws[i + 1] + next * K : nullptr;
    };
    weight_rows(w, r0, r1, K, x, m, y + cols[i], ldy, ahead);
  }
}

}  // namespace radixk3_gemm

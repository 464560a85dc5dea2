// The routed experts' GEMMs for a decode step on CPU (see moe_gemm_cpu.py): each chosen expert's few rows through
// skinny_gemm.h's kernel, the pairs grouped by expert and summed back per token around it.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "skinny_gemm.h"

// x: [P, K] token rows grouped by expert (counts[e] rows of expert e, expert after expert); w: [E, N, K];
// y: [P, N] with y[p] = w[e(p)] x[p]. All fp32, row-major, contiguous.
extern "C" void radixk3_grouped_gemm(const float* x, const int64_t* counts, int64_t E, const float* w, int64_t N,
                                    int64_t K, float* y) {
  radixk3_gemm::grouped_gemm(x, counts, E, w, N, K, y);
}

namespace {

// Scratch rows kept between calls (a decode step's few hundred KB: no allocation, no page faults per call).
thread_local std::vector<float> scratch;

float* scratch_rows(int64_t floats) {
  if (static_cast<int64_t>(scratch.size()) < floats) scratch.resize(floats);
  return scratch.data();
}

}  // namespace

// The routed experts' first half for T tokens of k experts each (experts [T, k] int64): the T*k (token, slot) pairs
// grouped by expert, stably (order[p] = the pair at grouped position p, pair = t * k + j; counts [E]), as
// torch.argsort(experts.flatten(), stable=True) and bincount give them. Returns the most rows of one expert; if
// that exceeds max_rows nothing else is done, else gu [T*k, N] = each pair's token row times its expert's w [E, N, D].
extern "C" int64_t radixk3_moe_up(const float* x, int64_t T, int64_t D, const int64_t* experts, int64_t k, int64_t E,
                                  const float* w, int64_t N, int64_t max_rows, int64_t* order, int64_t* counts,
                                  float* gu) {
  const int64_t P = T * k;
  std::fill(counts, counts + E, 0);
  for (int64_t p = 0; p < P; ++p) ++counts[experts[p]];
  int64_t most = 0;
  std::vector<int64_t> next(E, 0);
  for (int64_t e = 0; e < E; ++e) {
    most = std::max(most, counts[e]);
    if (e + 1 < E) next[e + 1] = next[e] + counts[e];
  }
  if (most > max_rows) return most;
  for (int64_t p = 0; p < P; ++p) order[next[experts[p]]++] = p;
  float* xs = scratch_rows(P * D);
  for (int64_t p = 0; p < P; ++p) std::memcpy(xs + p * D, x + (order[p] / k) * D, D * sizeof(float));
  radixk3_grouped_gemm(xs, counts, E, w, N, D, gu);
  return most;
}

// The second half: ys = each grouped row of h [T*k, I] times its expert's w [E, D, I], then out [T, D] = for each
// token, the sum of weights[pair] * ys over its pairs in grouped order (expert order), as the torch path's
// index_add_ sums them. weights [T, k] fp32.
extern "C" void radixk3_moe_down(const float* h, const int64_t* order, const int64_t* counts, int64_t T, int64_t k,
                                 int64_t E, const float* w, int64_t D, int64_t I, const float* weights, float* out) {
  const int64_t P = T * k;
  float* ys = scratch_rows(P * D);
  radixk3_grouped_gemm(h, counts, E, w, D, I, ys);
  std::fill(out, out + T * D, 0.0f);
  // Grouped order, as index_add_ walks it; the threads split the columns, so each sum keeps that order.
#pragma omp parallel for schedule(static)
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    const int64_t d1 = std::min(D, d0 + 64);
    for (int64_t p = 0; p < P; ++p) {
      const float wt = weights[order[p]];
      const float* y = ys + p * D;
      float* o = out + (order[p] / k) * D;
      for (int64_t d = d0; d < d1; ++d) o[d] += wt * y[d];
    }
  }
}

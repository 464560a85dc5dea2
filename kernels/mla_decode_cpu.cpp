// The middle of MLA's absorbed decode on CPU (see mla_decode_cpu.py): per query row and head, scores against the
// row's cached latents read in place from the pool (no gathered copy), a softmax over its own length only (no
// padding), and the probability-weighted sum of the latents' first R channels.
//
// fp32 throughout. Sums run in vectors of 16 partial sums, added as a tree, so the result differs from torch's
// batched matmuls in the last bits only: the torch path is the oracle within a stated
// tolerance (tests/kernels/test_mla_decode_cpu.py).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_vec.h"

namespace {

using radixk3_vec::hsum;
using radixk3_vec::load;
using radixk3_vec::v16;

// Two interleaved vector sums (independent chains), then the tail.
inline float dot(const float* a, const float* b, int64_t n) {
  v16 even = {}, odd = {};
  int64_t d = 0;
  for (; d + 32 <= n; d += 32) {
    even += load(a + d) * load(b + d);
    odd += load(a + d + 16) * load(b + d + 16);
  }
  if (d + 16 <= n) {
    even += load(a + d) * load(b + d);
    d += 16;
  }
  float acc = hsum(even + odd);
  for (; d < n; ++d) acc += a[d] * b[d];
  return acc;
}

// One query row, all its heads (qi [H, E], oi [H, R]): each cached latent is read twice (scores, then the weighted
// sum) for every head at once, where one head at a time reads them twice per head. p: H * len floats of scratch.
void row_all_heads(const float* qi, const float* latent, int64_t row_stride, const int64_t* own, int64_t len,
                   int64_t h, int64_t e, int64_t r, float scale, float* p, float* oi) {
  std::fill(oi, oi + h * r, 0.f);
  if (len <= 0) return;
  for (int64_t t = 0; t < len; ++t) {
    const float* row = latent + own[t] * row_stride;
    for (int64_t hh = 0; hh < h; ++hh) p[hh * len + t] = dot(qi + hh * e, row, e) * scale;
  }
  for (int64_t hh = 0; hh < h; ++hh) {
    float* ph = p + hh * len;
    float top = -INFINITY;
    for (int64_t t = 0; t < len; ++t) top = std::max(top, ph[t]);
#pragma omp simd
    for (int64_t t = 0; t < len; ++t) ph[t] = std::exp(ph[t] - top);  // glibc's vector expf (-fno-math-errno)
    float total = 0.f;
    for (int64_t t = 0; t < len; ++t) total += ph[t];
    const float inv = 1.f / total;
    for (int64_t t = 0; t < len; ++t) ph[t] *= inv;
  }
  // The weighted sum in blocks of kKeys keys (their rows stay in L1) and 128 output channels (8 vector sums held
  // in registers across the block): the outputs are loaded and stored once per block, not once per key.
  constexpr int64_t kKeys = 16, kCols = 128;
  const int64_t whole = r / kCols * kCols;
  for (int64_t t0 = 0; t0 < len; t0 += kKeys) {
    const int64_t t1 = std::min(len, t0 + kKeys);
    for (int64_t hh = 0; hh < h; ++hh) {
      const float* ph = p + hh * len;
      float* o = oi + hh * r;
      for (int64_t c0 = 0; c0 < whole; c0 += kCols) {
        v16 acc[kCols / 16];
        for (int64_t v = 0; v < kCols / 16; ++v) acc[v] = load(o + c0 + 16 * v);
        for (int64_t t = t0; t < t1; ++t) {
          const float* row = latent + own[t] * row_stride + c0;
          const float w = ph[t];
          for (int64_t v = 0; v < kCols / 16; ++v) acc[v] += w * load(row + 16 * v);
        }
        for (int64_t v = 0; v < kCols / 16; ++v) std::memcpy(o + c0 + 16 * v, &acc[v], sizeof acc[v]);
      }
      for (int64_t t = t0; t < t1; ++t) {
        const float* row = latent + own[t] * row_stride;
        const float w = ph[t];
        for (int64_t d = whole; d < r; ++d) o[d] += w * row[d];
      }
    }
  }
}

// One head of one query row (the split when there are fewer rows than threads).
void one_head(const float* qh, const float* latent, int64_t row_stride, const int64_t* own, int64_t len, int64_t e,
              int64_t r, float scale, float* o) {
  std::fill(o, o + r, 0.f);
  if (len <= 0) return;
  std::vector<float> p(len);
  float top = -INFINITY;
  for (int64_t t = 0; t < len; ++t) {
    p[t] = dot(qh, latent + own[t] * row_stride, e) * scale;
    top = std::max(top, p[t]);
  }
#pragma omp simd
  for (int64_t t = 0; t < len; ++t) p[t] = std::exp(p[t] - top);  // as row_all_heads, so the same bits
  float total = 0.f;
  for (int64_t t = 0; t < len; ++t) total += p[t];
  const float inv = 1.f / total;
  for (int64_t t = 0; t < len; ++t) {
    const float w = p[t] * inv;
    const float* row = latent + own[t] * row_stride;
    for (int64_t d = 0; d < r; ++d) o[d] += w * row[d];
  }
}

}  // namespace

// q [N, H, E] contiguous; latent row k of the pool at latent + k * row_stride (E floats); rows [N, S] (the first
// lens[i] entries of row i name its cached rows); out [N, H, R] contiguous. Both splits compute every head's
// products and sums in the same order, so the result does not depend on the split.
extern "C" void radixk3_mla_decode(const float* q, const float* latent, int64_t row_stride, const int64_t* rows,
                                   const int64_t* lens, int64_t n, int64_t h, int64_t e, int64_t r, int64_t s,
                                   float scale, float* out) {
  int64_t longest = 0;
  for (int64_t i = 0; i < n; ++i) longest = std::max(longest, std::min(lens[i], s));
  const bool parallel = n * h > 1 && longest * e * n * h > 32768;
  if (n >= omp_get_max_threads()) {
#pragma omp parallel if (parallel)
    {
      std::vector<float> p(h * longest);
#pragma omp for schedule(static)
      for (int64_t i = 0; i < n; ++i)
        row_all_heads(q + i * h * e, latent, row_stride, rows + i * s, std::min(lens[i], s), h, e, r, scale,
                      p.data(), out + i * h * r);
    }
    return;
  }
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t task = 0; task < n * h; ++task) {
    const int64_t i = task / h;
    one_head(q + task * e, latent, row_stride, rows + i * s, std::min(lens[i], s), e, r, scale, out + task * r);
  }
}

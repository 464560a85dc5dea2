// The middle of MLA's absorbed decode on CPU (see mla_decode_cpu.py): per query row and head, scores against the
// row's cached latents read in place from the pool (no gathered copy), a softmax over its own length only (no
// padding), and the probability-weighted sum of the latents' first R channels.
//
// fp32 throughout. Sums run in 16 interleaved partial sums (vectorisable without reassociation flags), so the
// result differs from torch's batched matmuls in the last bits only: the torch path is the oracle within a stated
// tolerance (tests/kernels/test_mla_decode_cpu.py).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;

inline float dot(const float* a, const float* b, int64_t n) {
  float part[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) part[l] += a[d + l] * b[d + l];
  for (int64_t l = 0; d < n; ++d, ++l) part[l] += a[d] * b[d];
  float acc = 0.f;
  for (int64_t l = 0; l < kLanes; ++l) acc += part[l];
  return acc;
}

}  // namespace

// q [N, H, E] contiguous; latent row k of the pool at latent + k * row_stride (E floats); rows [N, S] (the first
// lens[i] entries of row i name its cached rows); out [N, H, R] contiguous.
extern "C" void radixk3_mla_decode(const float* q, const float* latent, int64_t row_stride, const int64_t* rows,
                                   const int64_t* lens, int64_t n, int64_t h, int64_t e, int64_t r, int64_t s,
                                   float scale, float* out) {
  const int64_t work = n * h;
  int64_t longest = 0;
  for (int64_t i = 0; i < n; ++i) longest = std::max(longest, lens[i]);
#pragma omp parallel for schedule(static) if (work > 1 && longest * e * work > 32768)
  for (int64_t task = 0; task < work; ++task) {
    const int64_t i = task / h;
    const int64_t len = std::min(lens[i], s);
    const float* qh = q + task * e;
    const int64_t* own = rows + i * s;
    float* o = out + task * r;
    std::fill(o, o + r, 0.f);
    if (len <= 0) continue;
    std::vector<float> p(len);
    float top = -INFINITY;
    for (int64_t t = 0; t < len; ++t) {
      p[t] = dot(qh, latent + own[t] * row_stride, e) * scale;
      top = std::max(top, p[t]);
    }
    float total = 0.f;
    for (int64_t t = 0; t < len; ++t) {
      p[t] = std::exp(p[t] - top);
      total += p[t];
    }
    const float inv = 1.f / total;
    for (int64_t t = 0; t < len; ++t) {
      const float w = p[t] * inv;
      const float* row = latent + own[t] * row_stride;
      for (int64_t d = 0; d < r; ++d) o[d] += w * row[d];
    }
  }
}

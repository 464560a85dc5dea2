// The KDA decode step fused in place on CPU (see kda_decode_cpu.py): each sequence's [K, V] state per head is
// read from the pool once, decayed, updated and read from in cache, and written back once.
//
// Bit for bit the torch path of kda_pool.kda_decode: built with -ffp-contract=off so every product and sum
// rounds where torch's does; the update is one fused multiply-add, as torch's addcmul_; the two sums over the
// key channel add in the order of ATen's CPU sum over a non-innermost dim (SumKernel.cpp, vectorized_outer_sum):
// columns in whole groups of 4 vectors of `lanes` floats take the cascade (multi_row_sum), the rest 4
// interleaved partial sums (row_sum).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

int64_t ceil_log2(int64_t x) {
  int64_t r = 0;
  while ((int64_t(1) << r) < x) ++r;
  return r;
}

// multi_row_sum for one column: size rows `stride` apart, added in blocks of 16 (or more) cascaded over 4 levels.
inline float cascade_sum(const float* first, int64_t stride, int64_t size) {
  constexpr int64_t levels = 4;
  const int64_t power = std::max<int64_t>(4, ceil_log2(size) / levels);
  const int64_t step = int64_t(1) << power;
  const int64_t mask = step - 1;
  float acc[levels] = {0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
  while (i + step <= size) {
    for (int64_t j = 0; j < step; ++j, ++i) acc[0] += first[i * stride];
    for (int64_t j = 1; j < levels; ++j) {
      acc[j] += acc[j - 1];
      acc[j - 1] = 0.f;
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < size; ++i) acc[0] += first[i * stride];
  for (int64_t j = 1; j < levels; ++j) acc[0] += acc[j];
  return acc[0];
}

// row_sum for one column: 4 interleaved partial sums (each a cascade), the leftover rows into the first.
inline float interleaved_sum(const float* first, int64_t stride, int64_t size) {
  const int64_t groups = size / 4;
  float part[4];
  for (int64_t r = 0; r < 4; ++r) part[r] = cascade_sum(first + r * stride, 4 * stride, groups);
  for (int64_t i = groups * 4; i < size; ++i) part[0] += first[i * stride];
  for (int64_t r = 1; r < 4; ++r) part[0] += part[r];
  return part[0];
}

// multi_row_sum for the columns [0, C) of p (row-major [K, V]) at once: cascade_sum's additions, column by column in
// the same order, written as loops over columns so that the compiler vectorises them (acc: 4 * C floats of scratch).
void cascade_columns(const float* p, int64_t K, int64_t V, int64_t C, float* acc, float* out) {
  constexpr int64_t levels = 4;
  const int64_t power = std::max<int64_t>(4, ceil_log2(K) / levels);
  const int64_t step = int64_t(1) << power;
  const int64_t mask = step - 1;
  std::fill(acc, acc + levels * C, 0.f);
  int64_t i = 0;
  while (i + step <= K) {
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int64_t v = 0; v < C; ++v) acc[v] += p[i * V + v];
    for (int64_t l = 1; l < levels; ++l) {
      float* lower = acc + (l - 1) * C;
      float* upper = acc + l * C;
      for (int64_t v = 0; v < C; ++v) {
        upper[v] += lower[v];
        lower[v] = 0.f;
      }
      if ((i & (mask << (l * power))) != 0) break;
    }
  }
  for (; i < K; ++i)
    for (int64_t v = 0; v < C; ++v) acc[v] += p[i * V + v];
  for (int64_t l = 1; l < levels; ++l)
    for (int64_t v = 0; v < C; ++v) acc[v] += acc[l * C + v];
  std::copy(acc, acc + C, out);
}

// out[v] = sum over k of p[k * V + v] (p row-major [K, V]), in torch's order (acc: 4 * V floats of scratch).
void column_sums(const float* p, int64_t K, int64_t V, int64_t lanes, float* acc, float* out) {
  const int64_t cascaded = V / (4 * lanes) * (4 * lanes);
  cascade_columns(p, K, V, cascaded, acc, out);
  for (int64_t v = cascaded; v < V; ++v) out[v] = interleaved_sum(p + v, V, K);
}

// One head of one sequence: decay and update the [K, V] state s in place.
void update(float* s, int64_t K, int64_t V, const float* e, const float* k, const float* bk, const float* v,
            int64_t lanes, float* prod, float* sums, float* acc) {
  // S = diag(exp g) S, and the products of S^T k
  for (int64_t i = 0; i < K; ++i)
    for (int64_t j = 0; j < V; ++j) {
      s[i * V + j] *= e[i];
      prod[i * V + j] = k[i] * s[i * V + j];
    }
  column_sums(prod, K, V, lanes, acc, sums);
  for (int64_t j = 0; j < V; ++j) sums[j] = v[j] - sums[j];
  // S += (beta k) (v - S^T k)^T
  for (int64_t i = 0; i < K; ++i)
    for (int64_t j = 0; j < V; ++j) s[i * V + j] = std::fma(bk[i], sums[j], s[i * V + j]);
}

// `update`, then write S^T (q scale) to o.
void step(float* s, int64_t K, int64_t V, const float* e, const float* k, const float* bk, const float* v,
          const float* qs, float* o, int64_t lanes, float* prod, float* sums, float* acc) {
  update(s, K, V, e, k, bk, v, lanes, prod, sums, acc);
  for (int64_t i = 0; i < K; ++i)
    for (int64_t j = 0; j < V; ++j) prod[i * V + j] = qs[i] * s[i * V + j];
  column_sums(prod, K, V, lanes, acc, o);
}

}  // namespace

// pool: the first state of slot 0, slots `slot_stride` floats apart, each [H, K, V] contiguous.
// decay (exp g), k, beta_k (beta * k), q_scaled (q * scale): [N, H, K]; v and out: [N, H, V]; all fp32 contiguous.
// A slot named by several rows (the decode graph's padding rows share one scratch slot) is updated by its first
// row only; the later ones start from that result and write nothing back (no two threads write one state).
extern "C" void radixk3_kda_decode(float* pool, int64_t slot_stride, const int64_t* slots, int64_t N, int64_t H,
                                   int64_t K, int64_t V, const float* decay, const float* k, const float* beta_k,
                                   const float* v, const float* q_scaled, float* out, int64_t lanes) {
  std::vector<char> repeated(N, 0);
  for (int64_t n = 1; n < N; ++n)
    for (int64_t m = 0; m < n && !repeated[n]; ++m) repeated[n] = slots[m] == slots[n];
#pragma omp parallel
  {
    std::vector<float> prod(K * V), sums(V), copy(K * V), acc(4 * V);
    for (int pass = 0; pass < 2; ++pass) {  // the first rows of their slots, then the repeats (after a barrier)
#pragma omp for schedule(static)
      for (int64_t row = 0; row < N * H; ++row) {
        const int64_t n = row / H, h = row % H;
        if (repeated[n] != pass) continue;
        float* s = pool + slots[n] * slot_stride + h * K * V;
        if (pass == 1) s = std::copy(s, s + K * V, copy.data()) - K * V;
        step(s, K, V, decay + row * K, k + row * K, beta_k + row * K, v + row * V, q_scaled + row * K,
             out + row * V, lanes, prod.data(), sums.data(), acc.data());
      }
    }
  }
}

// A verify window (kda_pool.kda_verify_padded): each sequence's W tokens run from a copy of its state, which is
// not written back; the state after position t also goes to snap (when given) at row snap_rows[n], position t.
// decay, k, beta_k, q_scaled: [N, W, H, K]; v and out: [N, W, H, V]; snap: rows snap_row_stride floats apart,
// positions snap_pos_stride apart, each [H, K, V] contiguous.
extern "C" void radixk3_kda_verify(const float* pool, int64_t slot_stride, const int64_t* slots, int64_t N, int64_t W,
                                   int64_t H, int64_t K, int64_t V, const float* decay, const float* k,
                                   const float* beta_k, const float* v, const float* q_scaled, float* out,
                                   float* snap, int64_t snap_row_stride, int64_t snap_pos_stride,
                                   const int64_t* snap_rows, int64_t lanes) {
#pragma omp parallel
  {
    std::vector<float> prod(K * V), sums(V), s(K * V), acc(4 * V);
#pragma omp for schedule(static)
    for (int64_t nh = 0; nh < N * H; ++nh) {
      const int64_t n = nh / H, h = nh % H;
      const float* live = pool + slots[n] * slot_stride + h * K * V;
      std::copy(live, live + K * V, s.data());
      for (int64_t t = 0; t < W; ++t) {
        const int64_t row = (n * W + t) * H + h;
        step(s.data(), K, V, decay + row * K, k + row * K, beta_k + row * K, v + row * V, q_scaled + row * K,
             out + row * V, lanes, prod.data(), sums.data(), acc.data());
        if (snap != nullptr)
          std::copy(s.begin(), s.end(), snap + snap_rows[n] * snap_row_stride + t * snap_pos_stride + h * K * V);
      }
    }
  }
}

// ReplaySSM's commit (kda_pool.kda_replay): each sequence's state advanced in place over the first num_tokens[n]
// of its W saved tokens, the update of `step` without its read. decay, k, beta_k: [N, W, H, K]; v: [N, W, H, V].
extern "C" void radixk3_kda_replay(float* pool, int64_t slot_stride, const int64_t* slots, int64_t N, int64_t W,
                                   int64_t H, int64_t K, int64_t V, const float* decay, const float* k,
                                   const float* beta_k, const float* v, const int64_t* num_tokens, int64_t lanes) {
#pragma omp parallel
  {
    std::vector<float> prod(K * V), sums(V), acc(4 * V);
#pragma omp for schedule(static)
    for (int64_t nh = 0; nh < N * H; ++nh) {
      const int64_t n = nh / H, h = nh % H;
      float* s = pool + slots[n] * slot_stride + h * K * V;
      for (int64_t t = 0; t < num_tokens[n]; ++t) {
        const int64_t row = (n * W + t) * H + h;
        update(s, K, V, decay + row * K, k + row * K, beta_k + row * K, v + row * V, lanes, prod.data(),
               sums.data(), acc.data());
      }
    }
  }
}

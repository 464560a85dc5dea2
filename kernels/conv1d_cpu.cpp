// The KDA short conv on CPU (see conv1d_cpu.py): decode (each channel's W-1 saved inputs read once from the pool,
// convolved with the new input, and shifted by it in place), verify windows and prefill.
//
// Bit for bit the torch paths before their activation: built with -ffp-contract=off so each tap's product rounds
// before it is added, and the taps add from zero, oldest first, as conv1d.conv_window and conv_from_history.
#include <cstdint>
#include <vector>

namespace {

// One sequence's C channels; KEEP the saved inputs per channel (W - 1), fixed at compile time where it is known.
template <int64_t KEEP>
void conv_row(float* s, int64_t C, int64_t keep_runtime, const float* w, const float* x, float* y, bool shift) {
  const int64_t keep = KEEP > 0 ? KEEP : keep_runtime;
  const int64_t W = keep + 1;
  for (int64_t c = 0; c < C; ++c) {
    float* sc = s + c * keep;
    const float* wc = w + c * W;
    float acc = 0.f;
    for (int64_t j = 0; j < keep; ++j) acc += wc[j] * sc[j];
    acc += wc[keep] * x[c];
    y[c] = acc;
    if (shift) {
      for (int64_t j = 0; j + 1 < keep; ++j) sc[j] = sc[j + 1];
      if (keep > 0) sc[keep - 1] = x[c];
    }
  }
}

}  // namespace

// pool: slot s's [C, W-1] states (oldest first, contiguous) at pool + s * slot_stride. x, y: [N, C]; w: [C, W].
// y is the pre-activation output. A slot named by several rows (the decode graph's padding rows share one scratch
// slot) is shifted by its first row only; the later ones read that result and write nothing back, after a barrier
// (no two threads touch one state at once). Rows are split between threads, a row's channels run in order.
extern "C" void radixk3_conv_decode(float* pool, int64_t slot_stride, const int64_t* slots, int64_t N, int64_t C,
                                   int64_t W, const float* x, const float* w, float* y) {
  std::vector<char> repeated(N, 0);
  for (int64_t n = 1; n < N; ++n)
    for (int64_t m = 0; m < n && !repeated[n]; ++m) repeated[n] = slots[m] == slots[n];
  const int64_t keep = W - 1;
#pragma omp parallel if (N > 1)
  for (int pass = 0; pass < 2; ++pass) {
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      if (repeated[n] != pass) continue;
      float* s = pool + slots[n] * slot_stride;
      if (keep == 3)
        conv_row<3>(s, C, keep, w, x + n * C, y + n * C, pass == 0);
      else
        conv_row<0>(s, C, keep, w, x + n * C, y + n * C, pass == 0);
    }
  }
}

// A speculative window (conv1d_pool.conv1d_verify_padded): x, y [N, L, C]; position t of sequence n convolves
// its slot's saved inputs and the window's inputs up to t, as decode would have, and nothing is written back.
extern "C" void radixk3_conv_verify(const float* pool, int64_t slot_stride, const int64_t* slots, int64_t N,
                                   int64_t L, int64_t C, int64_t W, const float* x, const float* w, float* y) {
  const int64_t keep = W - 1;
#pragma omp parallel for schedule(static) if (N * L > 1)
  for (int64_t nt = 0; nt < N * L; ++nt) {
    const int64_t n = nt / L, t = nt % L;
    const float* s = pool + slots[n] * slot_stride;
    const float* xn = x + n * L * C;
    float* yt = y + nt * C;
    for (int64_t c = 0; c < C; ++c) {
      const float* wc = w + c * W;
      float acc = 0.f;
      // tap j reads full[t + j] of the history (saved inputs, then the window's): saved while t + j < keep
      for (int64_t j = 0; j < W; ++j) {
        const int64_t p = t + j;
        acc += wc[j] * (p < keep ? s[c * keep + p] : xn[(p - keep) * C + c]);
      }
      yt[c] = acc;
    }
  }
}

// A prefill (conv1d.conv_from_history): hist [R, C] holds each sequence's W-1 state rows, then its tokens; token
// t's window is rows row[t] - (W-1) .. row[t]. y [T, C] before the activation; rows split between threads.
extern "C" void radixk3_conv_prefill(const float* hist, const int64_t* row, int64_t T, int64_t C, int64_t W,
                                    const float* w, float* y) {
#pragma omp parallel for schedule(static) if (T * C >= 16384)
  for (int64_t t = 0; t < T; ++t) {
    const float* first = hist + (row[t] - (W - 1)) * C;
    float* yt = y + t * C;
    for (int64_t c = 0; c < C; ++c) {
      const float* wc = w + c * W;
      float acc = 0.f;
      for (int64_t j = 0; j < W; ++j) acc += wc[j] * first[j * C + c];
      yt[c] = acc;
    }
  }
}

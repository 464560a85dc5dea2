// The captured decode step's pool ops on CPU as torch ops (see pool_ops_cpu.py), and ReplaySSM's commit: each reaches its pool through a
// registry by cache key and calls the C++ kernel of conv1d_cpu.cpp, kda_decode_cpu.cpp or mla_decode_cpu.cpp (the
// very functions their ctypes paths call, handed over as addresses), with the small tensor work around it done by
// the same ATen ops the Python bodies call, in the same order, so the bits are theirs.
#include <ATen/core/Tensor.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/einsum.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/index_copy.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

using ConvDecode = void (*)(float*, int64_t, const int64_t*, int64_t, int64_t, int64_t, const float*, const float*,
                            float*);
using KdaDecode = void (*)(float*, int64_t, const int64_t*, int64_t, int64_t, int64_t, int64_t, const float*,
                           const float*, const float*, const float*, const float*, float*, int64_t);
using MlaDecode = void (*)(const float*, const float*, int64_t, const int64_t*, const int64_t*, int64_t, int64_t,
                           int64_t, int64_t, int64_t, float, float*);
using ConvVerify = void (*)(const float*, int64_t, const int64_t*, int64_t, int64_t, int64_t, int64_t, const float*,
                            const float*, float*);
using KdaVerify = void (*)(const float*, int64_t, const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                           const float*, const float*, const float*, const float*, const float*, float*, float*,
                           int64_t, int64_t, const int64_t*, int64_t);
using KdaReplay = void (*)(float*, int64_t, const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                           const float*, const float*, const float*, const float*, const int64_t*, int64_t);

struct Kernels {
  ConvDecode conv = nullptr;
  KdaDecode kda = nullptr;
  MlaDecode mla = nullptr;
  ConvVerify conv_verify = nullptr;
  KdaVerify kda_verify = nullptr;
  KdaReplay kda_replay = nullptr;
};

Kernels kernels;

// torch's CPU sum kernel's float lanes on x86 (kda_decode_cpu.py's _SUM_LANES).
constexpr int64_t kSumLanes = 8;

struct Pools {
  std::vector<at::Tensor> conv, recurrent, latent;
  // The draft window's per-token input rings (spec_window.SpecWindow, replay mode), per KDA layer; empty without.
  std::vector<at::Tensor> ring_x, ring_k, ring_v, ring_g, ring_beta;
};

// Written when a cache's steps are built and when they are collected (a finalizer, in whichever thread the
// garbage collector runs), read by every op call of a step: every find, insert and erase holds registry_mutex (an
// uncontended lock, ~100 a batch-1 step); the entry found stays put while its key's steps live (an unordered_map
// never moves its elements), so the op reads its pools after the lock is released.
std::unordered_map<int64_t, Pools>& registry() {
  static std::unordered_map<int64_t, Pools> pools;
  return pools;
}

std::mutex registry_mutex;

const Pools& pools_of(int64_t key) {
  std::lock_guard<std::mutex> guard(registry_mutex);
  auto it = registry().find(key);
  TORCH_CHECK(it != registry().end(), "no pools registered under cache key ", key);
  return it->second;
}

const at::Tensor& layer_pool(const std::vector<at::Tensor>& pools, int64_t layer, const char* kind) {
  TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(pools.size()), kind, " ", layer, " not registered");
  return pools[layer];
}

void set_kernels(int64_t conv, int64_t kda, int64_t mla, int64_t conv_verify, int64_t kda_verify,
                 int64_t kda_replay) {
  kernels.conv = reinterpret_cast<ConvDecode>(conv);
  kernels.kda = reinterpret_cast<KdaDecode>(kda);
  kernels.mla = reinterpret_cast<MlaDecode>(mla);
  kernels.conv_verify = reinterpret_cast<ConvVerify>(conv_verify);
  kernels.kda_verify = reinterpret_cast<KdaVerify>(kda_verify);
  kernels.kda_replay = reinterpret_cast<KdaReplay>(kda_replay);
}

void register_pools(int64_t key, std::vector<at::Tensor> conv, std::vector<at::Tensor> recurrent,
                    std::vector<at::Tensor> latent) {
  std::lock_guard<std::mutex> guard(registry_mutex);
  Pools& pools = registry()[key] = Pools{};
  pools.conv = std::move(conv);
  pools.recurrent = std::move(recurrent);
  pools.latent = std::move(latent);
}

void unregister_pools(int64_t key) {
  Pools gone;  // released after the lock
  std::lock_guard<std::mutex> guard(registry_mutex);
  auto it = registry().find(key);
  if (it != registry().end()) {
    gone = std::move(it->second);
    registry().erase(it);
  }
}

void register_window(int64_t key, std::vector<at::Tensor> x, std::vector<at::Tensor> k, std::vector<at::Tensor> v,
                     std::vector<at::Tensor> g, std::vector<at::Tensor> beta) {
  std::lock_guard<std::mutex> guard(registry_mutex);
  auto it = registry().find(key);
  TORCH_CHECK(it != registry().end(), "no pools registered under cache key ", key);
  it->second.ring_x = std::move(x);
  it->second.ring_k = std::move(k);
  it->second.ring_v = std::move(v);
  it->second.ring_g = std::move(g);
  it->second.ring_beta = std::move(beta);
}

// SpecWindow.save_*_inputs: ring[layer][:, :W].index_copy_(0, rows, x), as row copies (a row named twice, the
// padding rows' scratch row, keeps the later one, as index_copy_ leaves it): ATen's index_copy_ cost ~5-10 us a
// call, five calls a KDA layer.
void save_window(const std::vector<at::Tensor>& ring, int64_t layer, const at::Tensor& rows, const at::Tensor& x,
                 const char* kind) {
  const at::Tensor& dst = layer_pool(ring, layer, kind);
  const at::Tensor src = x.to(dst.scalar_type()).contiguous(), idx = rows.contiguous();
  const int64_t n = src.size(0), block = src.numel() / std::max<int64_t>(n, 1);
  TORCH_CHECK(dst.scalar_type() == at::kFloat && dst.is_contiguous() && idx.numel() == n && src.dim() == dst.dim() &&
                  src.size(1) <= dst.size(1) && block == src.size(1) * dst.stride(1),
              kind, ": ", n, " windows of shape ", src.sizes(), " do not fit rows of ", dst.sizes());
  const int64_t* row = idx.data_ptr<int64_t>();
  const float* from = src.data_ptr<float>();
  float* to = dst.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(row[i] >= 0 && row[i] < dst.size(0), kind, ": row ", row[i], " out of range for ", dst.size(0));
    std::copy(from + i * block, from + (i + 1) * block, to + row[i] * dst.stride(0));
  }
}

// kda_decode_cpu._factors: exp(g), k, beta k, v, q scale, each contiguous fp32.
struct KdaFactors {
  at::Tensor decay, k, beta_k, v, q_scaled;
};

KdaFactors kda_factors(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                       const at::Tensor& beta) {
  const double scale = std::pow(static_cast<double>(q.size(-1)), -0.5);  // Python's `K ** -0.5`
  const at::Tensor kf = k.to(at::kFloat).contiguous(), qf = q.to(at::kFloat).contiguous();
  const at::Tensor bf = beta.to(at::kFloat).contiguous();
  // beta k and q scale: one fp32 product each, as ATen's mul makes them (a float times a float scalar is one
  // IEEE rounding either way), without two more ATen calls a layer. The decay's exp stays ATen's.
  at::Tensor beta_k = at::empty_like(kf), q_scaled = at::empty_like(qf);
  const int64_t kdim = kf.size(-1), rows = kf.numel() / kdim;
  const float s = static_cast<float>(scale);
  const float *kp = kf.data_ptr<float>(), *qp = qf.data_ptr<float>(), *bp = bf.data_ptr<float>();
  float *bkp = beta_k.data_ptr<float>(), *qsp = q_scaled.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < kdim; ++i) {
      bkp[r * kdim + i] = bp[r] * kp[r * kdim + i];
      qsp[r * kdim + i] = qp[r * kdim + i] * s;
    }
  return KdaFactors{at::exp(g.to(at::kFloat)).contiguous(), kf, beta_k, v.to(at::kFloat).contiguous(), q_scaled};
}

// decode_graph.pool_conv_decode's fused path: conv1d_cpu_prepared, then the SiLU.
at::Tensor conv_decode(int64_t key, int64_t layer, const at::Tensor& x, const at::Tensor& weight,
                       const at::Tensor& slots) {
  TORCH_CHECK(kernels.conv != nullptr, "conv kernel not set");
  const at::Tensor& pool = layer_pool(pools_of(key).conv, layer, "conv pool");
  const at::Tensor xc = x.contiguous(), sc = slots.contiguous();
  const int64_t n = xc.size(0), c = xc.size(1);
  at::Tensor y = at::empty({n, c}, xc.options().dtype(at::kFloat));
  kernels.conv(pool.data_ptr<float>(), pool.stride(0), sc.data_ptr<int64_t>(), n, c, weight.size(-1),
               xc.data_ptr<float>(), weight.data_ptr<float>(), y.data_ptr<float>());
  return at::silu(y);
}

// decode_graph.pool_kda_decode's fused path: kda_decode_cpu with its factors (kda_decode_cpu._factors).
at::Tensor kda_decode(int64_t key, int64_t layer, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& g, const at::Tensor& beta, const at::Tensor& slots) {
  TORCH_CHECK(kernels.kda != nullptr, "KDA kernel not set");
  const at::Tensor& pool = layer_pool(pools_of(key).recurrent, layer, "recurrent pool");
  const int64_t n = k.size(0), h = k.size(1), kdim = k.size(2), vdim = pool.size(-1);
  const at::Tensor sc = slots.contiguous();
  at::Tensor out = at::empty({n, h, vdim}, v.options().dtype(at::kFloat));
  const KdaFactors f = kda_factors(q, k, v, g, beta);
  kernels.kda(pool.data_ptr<float>(), pool.stride(0), sc.data_ptr<int64_t>(), n, h, kdim, vdim,
              f.decay.data_ptr<float>(), f.k.data_ptr<float>(), f.beta_k.data_ptr<float>(), f.v.data_ptr<float>(),
              f.q_scaled.data_ptr<float>(), out.data_ptr<float>(), kSumLanes);
  return out;
}

// verify_graph.pool_conv_verify in replay mode: save the window's conv inputs, then conv1d_verify_padded's fused
// path (conv1d_verify_cpu and the SiLU) from the live state, nothing written back. x [B, W, C].
at::Tensor conv_verify(int64_t key, int64_t layer, const at::Tensor& x, const at::Tensor& weight,
                       const at::Tensor& slots, const at::Tensor& rows) {
  TORCH_CHECK(kernels.conv_verify != nullptr, "conv verify kernel not set");
  const Pools& pools = pools_of(key);
  save_window(pools.ring_x, layer, rows, x, "conv input ring");
  const at::Tensor& pool = layer_pool(pools.conv, layer, "conv pool");
  const at::Tensor xc = x.contiguous(), wc = weight.to(at::kFloat).contiguous(), sc = slots.contiguous();
  const int64_t n = xc.size(0), length = xc.size(1), c = xc.size(2);
  at::Tensor y = at::empty({n, length, c}, xc.options().dtype(at::kFloat));
  kernels.conv_verify(pool.data_ptr<float>(), pool.stride(0), sc.data_ptr<int64_t>(), n, length, c, wc.size(-1),
                      xc.data_ptr<float>(), wc.data_ptr<float>(), y.data_ptr<float>());
  return at::silu(y);
}

// verify_graph.pool_kda_verify in replay mode: save the window's inputs, then kda_verify_padded's fused path
// (kda_verify_cpu, no snapshots) from the live state, not written back. q, k, g [B, W, H, K], v [B, W, H, V].
at::Tensor kda_verify(int64_t key, int64_t layer, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& g, const at::Tensor& beta, const at::Tensor& slots, const at::Tensor& rows) {
  TORCH_CHECK(kernels.kda_verify != nullptr, "KDA verify kernel not set");
  const Pools& pools = pools_of(key);
  save_window(pools.ring_k, layer, rows, k, "key ring");
  save_window(pools.ring_v, layer, rows, v, "value ring");
  save_window(pools.ring_g, layer, rows, g.to(at::kFloat), "decay ring");
  save_window(pools.ring_beta, layer, rows, beta.to(at::kFloat), "beta ring");
  const at::Tensor& pool = layer_pool(pools.recurrent, layer, "recurrent pool");
  const int64_t n = k.size(0), w = k.size(1), h = k.size(2), kdim = k.size(3), vdim = pool.size(-1);
  const at::Tensor sc = slots.contiguous();
  at::Tensor out = at::empty({n, w, h, vdim}, v.options().dtype(at::kFloat));
  const KdaFactors f = kda_factors(q, k, v, g, beta);
  kernels.kda_verify(pool.data_ptr<float>(), pool.stride(0), sc.data_ptr<int64_t>(), n, w, h, kdim, vdim,
                     f.decay.data_ptr<float>(), f.k.data_ptr<float>(), f.beta_k.data_ptr<float>(),
                     f.v.data_ptr<float>(), f.q_scaled.data_ptr<float>(), out.data_ptr<float>(), nullptr, 0, 0,
                     nullptr, kSumLanes);
  return out;
}

// mla_paged.mla_store: buf[kv_slots[i]] = latent[i], in order (a slot named twice, the padding rows' scratch row,
// keeps the later row, as index_put_ leaves it). Row copies: ATen's index_put_ spent ~50 us a call setting up its
// iterator in a step whose weight reads evict its code and data.
void store_latents(const at::Tensor& buf, const at::Tensor& kv_slots, const at::Tensor& latent) {
  TORCH_CHECK(buf.scalar_type() == at::kFloat && latent.scalar_type() == at::kFloat && buf.stride(1) == 1,
              "store_latents: fp32 latents, rows contiguous");
  const at::Tensor src = latent.contiguous(), slots = kv_slots.contiguous();
  const int64_t n = src.size(0), d = src.size(1), rows = buf.size(0);
  TORCH_CHECK(slots.numel() == n && buf.size(1) == d, "store_latents: ", slots.numel(), " slots for ", n,
              " latents of ", d, " into rows of ", buf.size(1));
  const int64_t* slot = slots.data_ptr<int64_t>();
  const float* from = src.data_ptr<float>();
  float* to = buf.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(slot[i] >= 0 && slot[i] < rows, "KV slot ", slot[i], " out of range for ", rows, " rows");
    std::copy(from + i * d, from + (i + 1) * d, to + slot[i] * buf.stride(0));
  }
}

// decode_graph.pool_mla_decode's fused path: store the new latents, then mla.mla_decode_padded_cpu.
at::Tensor mla_decode(int64_t key, int64_t layer, const at::Tensor& q_nope, const at::Tensor& q_pe,
                      const at::Tensor& latent, const at::Tensor& kv_b_weight, const at::Tensor& kv_slots,
                      const at::Tensor& kv_rows, const at::Tensor& kv_lens, double scale) {
  TORCH_CHECK(kernels.mla != nullptr, "MLA kernel not set");
  at::Tensor buf = layer_pool(pools_of(key).latent, layer, "latent pool");
  store_latents(buf, kv_slots, latent);
  const int64_t h = q_nope.size(1), dn = q_nope.size(2);
  const at::Tensor w = kv_b_weight.view({h, -1, kv_b_weight.size(-1)});  // mla._split_kv_b
  const at::Tensor w_uk = w.slice(1, 0, dn), w_uv = w.slice(1, dn);
  // _absorbed_queries: einsum("thd,hdr->thr") is this bmm over the heads (einsum's own parsing cost ~30 us a call)
  const at::Tensor q = at::cat({at::bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1), q_pe}, -1);
  const at::Tensor rows = kv_rows.contiguous(), lens = kv_lens.contiguous();
  const int64_t n = q.size(0), e = q.size(2), r = w_uv.size(-1);
  at::Tensor out = at::empty({n, h, r}, q.options().dtype(at::kFloat));
  kernels.mla(q.data_ptr<float>(), buf.data_ptr<float>(), buf.stride(0), rows.data_ptr<int64_t>(),
              lens.data_ptr<int64_t>(), n, h, e, r, rows.size(1), static_cast<float>(scale), out.data_ptr<float>());
  return at::bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1).contiguous();  // einsum("nhr,hvr->nhv")
}

// SpecWindow.commit in replay mode: every KDA layer's live recurrent and conv states advanced over the first
// num_tokens[i] (>= 1) tokens saved in draft-window row rows[i]. The recurrent part is kda_pool.kda_replay: the
// saved inputs of the committed positions gathered and made fp32 (the decay's exp) by the same ATen ops, then the
// decode step's update per token (kda_decode_cpu.cpp). The conv part is conv1d_pool.conv1d_replay: each state's
// last W - 1 inputs of [state, the committed inputs], copied in place (state and ring fp32, as the registry's
// pools are).
void window_commit(int64_t key, const at::Tensor& slots, const at::Tensor& rows, const at::Tensor& num_tokens) {
  TORCH_CHECK(kernels.kda_replay != nullptr, "KDA replay kernel not set");
  const Pools& pools = pools_of(key);
  const at::Tensor sc = slots.contiguous(), rc = rows.contiguous(), nc = num_tokens.contiguous();
  const int64_t n = sc.size(0);
  TORCH_CHECK(rc.size(0) == n && nc.size(0) == n, "window_commit: slots, rows and num_tokens differ in length");
  if (n == 0) return;
  TORCH_CHECK(sc.scalar_type() == at::kLong && rc.scalar_type() == at::kLong && nc.scalar_type() == at::kLong,
              "window_commit: int64 slots, rows and num_tokens");
  const int64_t* counts = nc.data_ptr<int64_t>();
  const int64_t longest = *std::max_element(counts, counts + n);
  const int64_t* row_of = rc.data_ptr<int64_t>();
  const int64_t* slot_of = sc.data_ptr<int64_t>();
  // The kernels index raw memory with these: out-of-range values are errors, never reads or writes elsewhere.
  const at::Tensor& first_ring = layer_pool(pools.ring_x, 0, "conv input ring");
  const int64_t num_slots = layer_pool(pools.recurrent, 0, "recurrent pool").size(0);
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(counts[i] >= 1 && counts[i] <= first_ring.size(1) && row_of[i] >= 0 &&
                    row_of[i] < first_ring.size(0) && slot_of[i] >= 0 && slot_of[i] < num_slots,
                "window_commit: sequence ", i, " has ", counts[i], " tokens, row ", row_of[i], ", slot ", slot_of[i],
                " (window ", first_ring.size(0), " x ", first_ring.size(1), ", ", num_slots, " slots)");
  for (int64_t layer = 0; layer < static_cast<int64_t>(pools.recurrent.size()); ++layer) {
    const auto saved = [&](const std::vector<at::Tensor>& ring, const char* kind) {
      return layer_pool(ring, layer, kind).slice(1, 0, longest).index_select(0, rc);
    };
    const at::Tensor kf = saved(pools.ring_k, "key ring").to(at::kFloat);
    const at::Tensor decay = at::exp(saved(pools.ring_g, "decay ring").to(at::kFloat)).contiguous();
    const at::Tensor beta_k = at::mul(saved(pools.ring_beta, "beta ring").to(at::kFloat).unsqueeze(-1), kf)
                                  .contiguous();
    const at::Tensor v = saved(pools.ring_v, "value ring").to(at::kFloat).contiguous();
    const at::Tensor k = kf.contiguous();
    const at::Tensor& state = layer_pool(pools.recurrent, layer, "recurrent pool");
    kernels.kda_replay(state.data_ptr<float>(), state.stride(0), slot_of, n, longest, k.size(2), k.size(3),
                       v.size(3), decay.data_ptr<float>(), k.data_ptr<float>(), beta_k.data_ptr<float>(),
                       v.data_ptr<float>(), counts, kSumLanes);
    const at::Tensor& conv = layer_pool(pools.conv, layer, "conv pool");
    const at::Tensor& ring = layer_pool(pools.ring_x, layer, "conv input ring");
    TORCH_CHECK(conv.scalar_type() == at::kFloat && ring.scalar_type() == at::kFloat && ring.is_contiguous(),
                "window_commit: fp32 conv states and a contiguous fp32 input ring");
    const int64_t c = conv.size(1), keep = conv.size(2), width = ring.size(1);
    float* states = conv.data_ptr<float>();
    const float* inputs = ring.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) {
      float* s = states + slot_of[i] * conv.stride(0);
      const float* x = inputs + row_of[i] * width * c;
      // position j of the new state is position counts[i] + j of [state, inputs]: always later, so read before
      // it is written
      for (int64_t ch = 0; ch < c; ++ch)
        for (int64_t j = 0; j < keep; ++j) {
          const int64_t at = counts[i] + j;
          s[ch * conv.stride(1) + j * conv.stride(2)] =
              at < keep ? s[ch * conv.stride(1) + at * conv.stride(2)] : x[(at - keep) * c + ch];
        }
    }
  }
}

}  // namespace

TORCH_LIBRARY(radixk3_cpu, m) {
  m.def("set_kernels(int conv, int kda, int mla, int conv_verify, int kda_verify, int kda_replay) -> ()",
        &set_kernels);
  m.def("register_pools(int key, Tensor[] conv, Tensor[] recurrent, Tensor[] latent) -> ()", &register_pools);
  m.def("register_window(int key, Tensor[] x, Tensor[] k, Tensor[] v, Tensor[] g, Tensor[] beta) -> ()",
        &register_window);
  m.def("unregister_pools(int key) -> ()", &unregister_pools);
  m.def("conv_decode(int key, int layer, Tensor x, Tensor weight, Tensor slots) -> Tensor");
  m.def("kda_decode(int key, int layer, Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor slots) -> Tensor");
  m.def("mla_decode(int key, int layer, Tensor q_nope, Tensor q_pe, Tensor latent, Tensor kv_b_weight, "
        "Tensor kv_slots, Tensor kv_rows, Tensor kv_lens, float scale) -> Tensor");
  m.def("conv_verify(int key, int layer, Tensor x, Tensor weight, Tensor slots, Tensor rows) -> Tensor");
  m.def("kda_verify(int key, int layer, Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor slots, "
        "Tensor rows) -> Tensor");
  m.def("window_commit(int key, Tensor slots, Tensor rows, Tensor num_tokens) -> ()");
}

TORCH_LIBRARY_IMPL(radixk3_cpu, CPU, m) {
  m.impl("conv_decode", TORCH_FN(conv_decode));
  m.impl("kda_decode", TORCH_FN(kda_decode));
  m.impl("mla_decode", TORCH_FN(mla_decode));
  m.impl("conv_verify", TORCH_FN(conv_verify));
  m.impl("kda_verify", TORCH_FN(kda_verify));
  m.impl("window_commit", TORCH_FN(window_commit));
}

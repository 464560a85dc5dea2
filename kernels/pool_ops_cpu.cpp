// The captured decode step's pool ops on CPU as torch ops (see pool_ops_cpu.py): each reaches its pool through a
// registry by cache key and calls the C++ kernel of conv1d_cpu.cpp, kda_decode_cpu.cpp or mla_decode_cpu.cpp (the
// very functions their ctypes paths call, handed over as addresses), with the small tensor work around it done by
// the same ATen ops the Python bodies call, in the same order, so the bits are theirs.
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/einsum.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/index_put.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <unordered_map>
#include <vector>

namespace {

using ConvDecode = void (*)(float*, int64_t, const int64_t*, int64_t, int64_t, int64_t, const float*, const float*,
                            float*);
using KdaDecode = void (*)(float*, int64_t, const int64_t*, int64_t, int64_t, int64_t, int64_t, const float*,
                           const float*, const float*, const float*, const float*, float*, int64_t);
using MlaDecode = void (*)(const float*, const float*, int64_t, const int64_t*, const int64_t*, int64_t, int64_t,
                           int64_t, int64_t, int64_t, float, float*);

struct Kernels {
  ConvDecode conv = nullptr;
  KdaDecode kda = nullptr;
  MlaDecode mla = nullptr;
};

Kernels kernels;

// torch's CPU sum kernel's float lanes on x86 (kda_decode_cpu.py's _SUM_LANES).
constexpr int64_t kSumLanes = 8;

struct Pools {
  std::vector<at::Tensor> conv, recurrent, latent;
};

// Written when a cache's steps are built, read by every step (one thread: the worker's).
std::unordered_map<int64_t, Pools>& registry() {
  static std::unordered_map<int64_t, Pools> pools;
  return pools;
}

const Pools& pools_of(int64_t key) {
  auto it = registry().find(key);
  TORCH_CHECK(it != registry().end(), "no pools registered under cache key ", key);
  return it->second;
}

const at::Tensor& layer_pool(const std::vector<at::Tensor>& pools, int64_t layer, const char* kind) {
  TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(pools.size()), kind, " pool ", layer, " not registered");
  return pools[layer];
}

void set_kernels(int64_t conv, int64_t kda, int64_t mla) {
  kernels.conv = reinterpret_cast<ConvDecode>(conv);
  kernels.kda = reinterpret_cast<KdaDecode>(kda);
  kernels.mla = reinterpret_cast<MlaDecode>(mla);
}

void register_pools(int64_t key, std::vector<at::Tensor> conv, std::vector<at::Tensor> recurrent,
                    std::vector<at::Tensor> latent) {
  registry()[key] = Pools{std::move(conv), std::move(recurrent), std::move(latent)};
}

void unregister_pools(int64_t key) { registry().erase(key); }

// decode_graph.pool_conv_decode's fused path: conv1d_cpu_prepared, then the SiLU.
at::Tensor conv_decode(int64_t key, int64_t layer, const at::Tensor& x, const at::Tensor& weight,
                       const at::Tensor& slots) {
  TORCH_CHECK(kernels.conv != nullptr, "conv kernel not set");
  const at::Tensor& pool = layer_pool(pools_of(key).conv, layer, "conv");
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
  const at::Tensor& pool = layer_pool(pools_of(key).recurrent, layer, "recurrent");
  const int64_t n = k.size(0), h = k.size(1), kdim = k.size(2), vdim = pool.size(-1);
  const double scale = std::pow(static_cast<double>(q.size(-1)), -0.5);  // Python's `K ** -0.5`
  const at::Tensor sc = slots.contiguous();
  at::Tensor out = at::empty({n, h, vdim}, v.options().dtype(at::kFloat));
  const at::Tensor kf = k.to(at::kFloat);
  const at::Tensor decay = at::exp(g.to(at::kFloat)).contiguous();
  const at::Tensor kc = kf.contiguous();
  const at::Tensor beta_k = at::mul(beta.to(at::kFloat).unsqueeze(-1), kf).contiguous();
  const at::Tensor vc = v.to(at::kFloat).contiguous();
  const at::Tensor q_scaled = at::mul(q.to(at::kFloat), c10::Scalar(scale)).contiguous();
  kernels.kda(pool.data_ptr<float>(), pool.stride(0), sc.data_ptr<int64_t>(), n, h, kdim, vdim,
              decay.data_ptr<float>(), kc.data_ptr<float>(), beta_k.data_ptr<float>(), vc.data_ptr<float>(),
              q_scaled.data_ptr<float>(), out.data_ptr<float>(), kSumLanes);
  return out;
}

// decode_graph.pool_mla_decode's fused path: store the new latents, then mla.mla_decode_padded_cpu.
at::Tensor mla_decode(int64_t key, int64_t layer, const at::Tensor& q_nope, const at::Tensor& q_pe,
                      const at::Tensor& latent, const at::Tensor& kv_b_weight, const at::Tensor& kv_slots,
                      const at::Tensor& kv_rows, const at::Tensor& kv_lens, double scale) {
  TORCH_CHECK(kernels.mla != nullptr, "MLA kernel not set");
  at::Tensor buf = layer_pool(pools_of(key).latent, layer, "latent");
  at::index_put_(buf, c10::List<std::optional<at::Tensor>>({kv_slots}), latent);
  const int64_t h = q_nope.size(1), dn = q_nope.size(2);
  const at::Tensor w = kv_b_weight.view({h, -1, kv_b_weight.size(-1)});  // mla._split_kv_b
  const at::Tensor w_uk = w.slice(1, 0, dn), w_uv = w.slice(1, dn);
  const at::Tensor q = at::cat({at::einsum("thd,hdr->thr", {q_nope, w_uk}), q_pe}, -1);  // _absorbed_queries
  const at::Tensor rows = kv_rows.contiguous(), lens = kv_lens.contiguous();
  const int64_t n = q.size(0), e = q.size(2), r = w_uv.size(-1);
  at::Tensor out = at::empty({n, h, r}, q.options().dtype(at::kFloat));
  kernels.mla(q.data_ptr<float>(), buf.data_ptr<float>(), buf.stride(0), rows.data_ptr<int64_t>(),
              lens.data_ptr<int64_t>(), n, h, e, r, rows.size(1), static_cast<float>(scale), out.data_ptr<float>());
  return at::einsum("nhr,hvr->nhv", {out, w_uv}).contiguous();
}

}  // namespace

TORCH_LIBRARY(radixk3_cpu, m) {
  m.def("set_kernels(int conv, int kda, int mla) -> ()", &set_kernels);
  m.def("register_pools(int key, Tensor[] conv, Tensor[] recurrent, Tensor[] latent) -> ()", &register_pools);
  m.def("unregister_pools(int key) -> ()", &unregister_pools);
  m.def("conv_decode(int key, int layer, Tensor x, Tensor weight, Tensor slots) -> Tensor");
  m.def("kda_decode(int key, int layer, Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor slots) -> Tensor");
  m.def("mla_decode(int key, int layer, Tensor q_nope, Tensor q_pe, Tensor latent, Tensor kv_b_weight, "
        "Tensor kv_slots, Tensor kv_rows, Tensor kv_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixk3_cpu, CPU, m) {
  m.impl("conv_decode", TORCH_FN(conv_decode));
  m.impl("kda_decode", TORCH_FN(kda_decode));
  m.impl("mla_decode", TORCH_FN(mla_decode));
}

// A dense layer's few-row GEMM as a torch op (see linear_cpu.py): y = x w^T through skinny_gemm.h's kernel, called by
// a captured decode step's C++ wrapper without Python.
#include <torch/library.h>
#include <ATen/ATen.h>

#include "skinny_gemm.h"

namespace {

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1) && weight.size(1) > 0,
              "radixk3_gemm::linear: x [m, K] and weight [N, K], K > 0, got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && x.device().is_cpu() &&
                  weight.device().is_cpu() && weight.is_contiguous(),
              "radixk3_gemm::linear: fp32 CPU tensors, the weight contiguous");
  const at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), n = weight.size(0), k = weight.size(1);
  at::Tensor y = at::empty({m, n}, xc.options());
  if (m > 0) radixk3_gemm::grouped_gemm(xc.data_ptr<float>(), &m, 1, weight.data_ptr<float>(), n, k, y.data_ptr<float>());
  return y;
}

// Several weights of one input in one call: y [m, sum N_i], weight i's outputs in its own columns, each as `linear`
// computes it (the same bits); one call instead of one each spares a decode step each call's fixed costs.
at::Tensor linears(const at::Tensor& x, at::TensorList weights) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "radixk3_gemm::linears: x [m, K] fp32 on CPU, K > 0, got ", x.sizes());
  std::vector<const float*> ws;
  std::vector<int64_t> ns;
  for (const at::Tensor& w : weights) {
    TORCH_CHECK(w.dim() == 2 && w.size(1) == x.size(1) && w.scalar_type() == at::kFloat && w.device().is_cpu() &&
                    w.is_contiguous(),
                "radixk3_gemm::linears: each weight [N, K] fp32, contiguous, on CPU, K = x's, got ", w.sizes());
    ws.push_back(w.data_ptr<float>());
    ns.push_back(w.size(0));
  }
  const at::Tensor xc = x.contiguous();
  int64_t total = 0;
  for (int64_t n : ns) total += n;
  at::Tensor y = at::empty({xc.size(0), total}, xc.options());
  if (xc.size(0) > 0 && !ws.empty())
    radixk3_gemm::multi_gemm(xc.data_ptr<float>(), xc.size(0), ws.data(), ns.data(), static_cast<int64_t>(ws.size()),
                             xc.size(1), y.data_ptr<float>());
  return y;
}

}  // namespace

TORCH_LIBRARY(radixk3_gemm, m) {
  m.def("linear(Tensor x, Tensor weight) -> Tensor");
  m.def("linears(Tensor x, Tensor[] weights) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixk3_gemm, CPU, m) {
  m.impl("linear", TORCH_FN(linear));
  m.impl("linears", TORCH_FN(linears));
}

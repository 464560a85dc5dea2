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

}  // namespace

TORCH_LIBRARY(radixk3_gemm, m) { m.def("linear(Tensor x, Tensor weight) -> Tensor"); }

TORCH_LIBRARY_IMPL(radixk3_gemm, CPU, m) { m.impl("linear", TORCH_FN(linear)); }

// 16-float vectors for the C++ CPU ops (GCC/Clang vector extensions, compiled for this machine's width), shared by
// mla_decode_cpu.cpp and moe_gemm_cpu.cpp. cpu_extension.py rebuilds an op when a header beside it changes.
#pragma once

#include <cstring>

namespace radixk3_vec {

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

// 16 floats from p, any alignment.
inline v16 load(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// The 16 lanes' sum as a tree of vector adds: a chain of 16 scalar adds costs more than a short dot product.
inline float hsum(v16 v) {
  v8 lo, hi;
  std::memcpy(&lo, &v, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
  const v8 s8 = lo + hi;
  v4 a, b;
  std::memcpy(&a, &s8, sizeof a);
  std::memcpy(&b, reinterpret_cast<const char*>(&s8) + sizeof a, sizeof b);
  const v4 s4 = a + b;
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

}  // namespace radixk3_vec

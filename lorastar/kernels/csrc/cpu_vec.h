// Vector helpers shared by the CPU ops (cpu_attention.cpp, cpu_lora.cpp, cpu_elementwise.cpp); plain loops that the
// compiler vectorizes under `omp simd` (-fopenmp, -march=native).
#ifndef LORASTAR_CPU_VEC_H_
#define LORASTAR_CPU_VEC_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace lorastar_vec {

// exp(x) for x <= 0 (softmax after subtracting the max), vectorizable: 2^(x log2 e) as 2^n times a
// degree-6 polynomial of the fraction on [-0.5, 0.5]; relative error < 2e-7. std::exp is a scalar
// call per score: it took 60% of the op at 20 rows x 9 heads x 190 keys.
inline float exp_nonpos(float x) {
  x = std::max(x, -87.f);
  const float t = x * 1.44269504088896341f;
  const float n = (t + 12582912.f) - 12582912.f;  // round to nearest (1.5 * 2^23 trick; vectorizes,
                                                   // std::nearbyint was a libm call per score)
  const float f = t - n;  // [-0.5, 0.5]
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.f;
  int32_t bits;
  std::memcpy(&bits, &p, 4);
  bits += static_cast<int32_t>(n) << 23;
  std::memcpy(&p, &bits, 4);
  return p;
}

// sum(x[i]) (squares: sum(x[i]^2)) in 16 lanes by index, the lanes then added in a fixed tree: the
// same rounding wherever x sits in memory and whatever the compiler's loop peeling (an `omp simd`
// reduction may peel up to an aligned address, and its grouping then follows the address).
template <bool kSquares = false>
inline float lane_sum(const float* __restrict x, int64_t n) {
  float lane[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
#pragma omp simd
    for (int j = 0; j < 16; ++j) lane[j] += kSquares ? x[i + j] * x[i + j] : x[i + j];
  for (int j = 0; i < n; ++i, ++j) lane[j] += kSquares ? x[i] * x[i] : x[i];
  for (int w = 8; w > 0; w /= 2)
    for (int j = 0; j < w; ++j) lane[j] += lane[j + w];
  return lane[0];
}

// p [n] as fp32: fp32 as it is, another storage type (bf16) widened into buf (exact for bf16).
inline const float* as_f32(const float* p, int64_t, std::vector<float>&) { return p; }
template <typename T>
inline const float* as_f32(const T* p, int64_t n, std::vector<float>& buf) {
  buf.resize(n);
  for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(p[i]);
  return buf.data();
}

// y += w * x over n floats.
inline void axpy(float w, const float* __restrict x, float* __restrict y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += w * x[i];
}

// out[j * stride] = rows[j] . v for j < nq <= 4, rows contiguous [nq, n]: v is loaded once and the
// four dot products are independent accumulator chains (one chain per dot was bound by FMA latency).
inline void dot_rows4(const float* __restrict rows, int64_t nq, const float* __restrict v, int64_t n, float* out,
                      int64_t stride = 1) {
  const float* r0 = rows;
  const float* r1 = nq > 1 ? rows + n : rows;
  const float* r2 = nq > 2 ? rows + 2 * n : rows;
  const float* r3 = nq > 3 ? rows + 3 * n : rows;
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
  for (int64_t d = 0; d < n; ++d) {
    const float x = v[d];
    s0 += r0[d] * x;
    s1 += r1[d] * x;
    s2 += r2[d] * x;
    s3 += r3[d] * x;
  }
  const float s[4] = {s0, s1, s2, s3};
  for (int64_t j = 0; j < nq; ++j) out[j * stride] = s[j];
}

// The same against two vectors at once (eight chains): every row load serves both.
inline void dot_rows4x2(const float* __restrict rows, int64_t nq, const float* __restrict v0,
                        const float* __restrict v1, int64_t n, float* out0, float* out1) {
  const float* r0 = rows;
  const float* r1 = nq > 1 ? rows + n : rows;
  const float* r2 = nq > 2 ? rows + 2 * n : rows;
  const float* r3 = nq > 3 ? rows + 3 * n : rows;
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f, u0 = 0.f, u1 = 0.f, u2 = 0.f, u3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3, u0, u1, u2, u3)
  for (int64_t d = 0; d < n; ++d) {
    const float x = v0[d], y = v1[d], b0 = r0[d], b1 = r1[d], b2 = r2[d], b3 = r3[d];
    s0 += x * b0;
    s1 += x * b1;
    s2 += x * b2;
    s3 += x * b3;
    u0 += y * b0;
    u1 += y * b1;
    u2 += y * b2;
    u3 += y * b3;
  }
  const float s[4] = {s0, s1, s2, s3}, u[4] = {u0, u1, u2, u3};
  for (int64_t j = 0; j < nq; ++j) {
    out0[j] = s[j];
    out1[j] = u[j];
  }
}

}  // namespace lorastar_vec

#endif  // LORASTAR_CPU_VEC_H_

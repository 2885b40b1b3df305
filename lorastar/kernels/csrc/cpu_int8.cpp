// Logits against a per-row int8 table (quant/embedding_int8.py) for the few rows a decode step samples.
//
// Semantics: out[m, n] = (x[m] @ float(q[n])) * scale[n]
//   x [M, K] fp32 (contiguous rows), q [N, K] int8 given packed as qp [ceil(N / 16), K, 16] (table rows
//   n = 16 b + j at qp[b, :, j]; int8_pack), scale [N] fp32 -> out [M, N] fp32
// The table is read once a step for all M rows, one byte an element where the fp32 table reads four
// (torch's form first writes each block out in fp32 and reads it back: 15x slower than the fp32 table
// at one row). Sixteen table rows sit side by side, so each k widens 16 int8 into one vector and adds
// x[m, k] times it into 16 outputs per row m: no sum across lanes. The sum runs over k in order.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include "cpu_ops.h"

#include <algorithm>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kMaxRows = 8;  // rows of x per pass (their 16-wide accumulators stay in registers)

template <int64_t MM>
void int8_block(const float* X, int64_t K, const int8_t* qb, float (&out)[kMaxRows][kLanes]) {
#ifdef __AVX512F__
  __m512 acc[MM];
  for (int64_t i = 0; i < MM; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qb + k * kLanes));
    const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    for (int64_t i = 0; i < MM; ++i) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(X[i * K + k]), w, acc[i]);
  }
  for (int64_t i = 0; i < MM; ++i) _mm512_storeu_ps(out[i], acc[i]);
#else
  float acc[MM][kLanes] = {};
  for (int64_t k = 0; k < K; ++k) {
    float w[kLanes];
    for (int64_t j = 0; j < kLanes; ++j) w[j] = static_cast<float>(qb[k * kLanes + j]);
    for (int64_t i = 0; i < MM; ++i) {
      const float xv = X[i * K + k];
      for (int64_t j = 0; j < kLanes; ++j) acc[i][j] += xv * w[j];
    }
  }
  for (int64_t i = 0; i < MM; ++i)
    for (int64_t j = 0; j < kLanes; ++j) out[i][j] = acc[i][j];
#endif
}

}  // namespace

at::Tensor int8_pack(at::Tensor q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "q: [N, K] int8");
  const int64_t N = q.size(0), K = q.size(1), nb = (N + kLanes - 1) / kLanes;
  auto padded = at::zeros({nb * kLanes, K}, q.options());
  padded.narrow(0, 0, N).copy_(q);
  return padded.view({nb, kLanes, K}).transpose(1, 2).contiguous();  // [nb, K, 16]
}

at::Tensor int8_logits(at::Tensor x, at::Tensor qp, at::Tensor scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous [M, K] fp32");
  TORCH_CHECK(qp.dim() == 3 && qp.scalar_type() == at::kChar && qp.is_contiguous() && qp.size(2) == kLanes,
              "qp: int8_pack's [ceil(N / 16), K, 16] int8");
  TORCH_CHECK(qp.size(1) == x.size(1), "qp and x differ in K");
  TORCH_CHECK(scale.dim() == 1 && scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  scale.size(0) <= qp.size(0) * kLanes && scale.size(0) > (qp.size(0) - 1) * kLanes,
              "scale: contiguous [N] fp32, N the packed table's rows");
  const int64_t M = x.size(0), K = x.size(1), N = scale.size(0), nb = qp.size(0);
  auto out = at::empty({M, N}, x.options());
  const float* X = x.data_ptr<float>();
  const int8_t* QP = qp.data_ptr<int8_t>();
  const float* S = scale.data_ptr<float>();
  float* O = out.data_ptr<float>();
  at::parallel_for(0, nb, 16, [&](int64_t lo, int64_t hi) {
    float acc[kMaxRows][kLanes];
    for (int64_t b = lo; b < hi; ++b) {
      const int8_t* qb = QP + b * K * kLanes;
      const int64_t n0 = b * kLanes, width = std::min(kLanes, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
        const int64_t mm = std::min(kMaxRows, M - m0);
        const float* xm = X + m0 * K;
        switch (mm) {
          case 1: int8_block<1>(xm, K, qb, acc); break;
          case 2: int8_block<2>(xm, K, qb, acc); break;
          case 3: int8_block<3>(xm, K, qb, acc); break;
          case 4: int8_block<4>(xm, K, qb, acc); break;
          case 5: int8_block<5>(xm, K, qb, acc); break;
          case 6: int8_block<6>(xm, K, qb, acc); break;
          case 7: int8_block<7>(xm, K, qb, acc); break;
          default: int8_block<8>(xm, K, qb, acc); break;
        }
        for (int64_t i = 0; i < mm; ++i)
          for (int64_t j = 0; j < width; ++j) O[(m0 + i) * N + n0 + j] = acc[i][j] * S[n0 + j];
      }
    }
  });
  return out;
}

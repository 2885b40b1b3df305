// The elementwise steps between a CPU layer's GEMMs, each one pass over its rows instead of the 3-8
// torch ops (and temporaries) of its composite form. At a decode step's sizes those ops cost their
// dispatch more than their arithmetic: SmolLM2 at one row spent ~86 us a layer on them (RMSNorm
// alone is pow, mean, add, rsqrt, mul, mul on CPU).
//
// Semantics (fp32; rows with contiguous last dims, any row stride):
//   rms_norm(x [N, D], w [D])            -> w * (x * rsqrt(mean(x^2, -1) + eps))     [N, D]
//   add_rms_norm(x, h [N, D], w [D])     -> (s = x + h, rms_norm(s, w))             ([N, D], [N, D])
//   silu_and_mul(gu [N, 2I])             -> silu(gu[:, :I]) * gu[:, I:]               [N, I]
//   rotary(x [T, H, D], cos, sin [T, D]) -> x * cos + cat(-x[..., D/2:], x[..., :D/2]) * sin  [T, H, D]
// The same operation order as transformers' Llama (the cast back is a no-op in fp32); sums of squares
// and exp round differently from torch's (float lanes in another order, a polynomial exp: relative
// error < 2e-7), so results match torch's to a few ulp, not bit for bit. Each row's result depends on its
// values only, never on its address, batch or thread (greedy tokens must not depend on batching).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

#include "cpu_vec.h"

namespace {

// Rows per parallel task: about 16k floats, so a decode step's small tensors stay on one thread
// (waking the pool costs more than the pass).
inline int64_t grain_rows(int64_t row_len) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_len)); }

// silu(g) = g * sigmoid(g), the sigmoid from e = exp(-|g|) <= 1 (the attention's exp_nonpos, which
// vectorizes): 1 / (1 + e) for g >= 0, e / (1 + e) below; exp never overflows.
inline float silu(float g) {
  const float e = lorastar_vec::exp_nonpos(-std::fabs(g));
  return g * ((g >= 0.f ? 1.f : e) / (1.f + e));
}

inline void norm_row(const float* __restrict x, const float* __restrict w, float* __restrict out, int64_t D,
                     float eps) {
  const float ss = lorastar_vec::lane_sum<true>(x, D);  // the same at any address
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
#pragma omp simd
  for (int64_t i = 0; i < D; ++i) out[i] = w[i] * (x[i] * r);
}

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 2 && t.stride(1) == 1 && t.device().is_cpu(),
              what, ": a 2-D fp32 CPU tensor with contiguous rows");
}

void check_weight(const at::Tensor& w, int64_t D, const char* what) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == D, what, ": fp32 weight [D]");
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, "rms_norm x");
  const int64_t N = x.size(0), D = x.size(1);
  check_weight(w, D, "rms_norm");
  at::Tensor out = at::empty({N, D}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0);
  const float e = static_cast<float>(eps);
  at::parallel_for(0, N, grain_rows(D), [&](int64_t lo, int64_t hi) {
    for (int64_t n = lo; n < hi; ++n) norm_row(xp + n * xs, wp, op + n * D, D, e);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& h, const at::Tensor& w,
                                                double eps) {
  check_rows(x, "add_rms_norm x");
  check_rows(h, "add_rms_norm h");
  const int64_t N = x.size(0), D = x.size(1);
  TORCH_CHECK(h.size(0) == N && h.size(1) == D, "add_rms_norm: x and h of one shape");
  check_weight(w, D, "add_rms_norm");
  at::Tensor s = at::empty({N, D}, x.options()), out = at::empty({N, D}, x.options());
  const float *xp = x.data_ptr<float>(), *hp = h.data_ptr<float>(), *wp = w.data_ptr<float>();
  float *sp = s.data_ptr<float>(), *op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), hs = h.stride(0);
  const float e = static_cast<float>(eps);
  at::parallel_for(0, N, grain_rows(D), [&](int64_t lo, int64_t hi) {
    for (int64_t n = lo; n < hi; ++n) {
      const float *xr = xp + n * xs, *hr = hp + n * hs;
      float* sr = sp + n * D;
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) sr[i] = xr[i] + hr[i];
      norm_row(sr, wp, op + n * D, D, e);
    }
  });
  return {s, out};
}

at::Tensor silu_and_mul(const at::Tensor& gu) {
  check_rows(gu, "silu_and_mul");
  const int64_t N = gu.size(0), I = gu.size(1) / 2;
  TORCH_CHECK(gu.size(1) == 2 * I, "silu_and_mul: an even number of columns (gate, then up)");
  at::Tensor out = at::empty({N, I}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t gs = gu.stride(0);
  at::parallel_for(0, N, grain_rows(I), [&](int64_t lo, int64_t hi) {
    for (int64_t n = lo; n < hi; ++n) {
      const float *g = gp + n * gs, *u = g + I;
      float* o = op + n * I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) o[i] = silu(g[i]) * u[i];
    }
  });
  return out;
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 3 && x.stride(2) == 1 && x.device().is_cpu(),
              "rotary: x [T, H, D] fp32 with contiguous heads");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(D == 2 * half, "rotary: an even head size");
  for (const at::Tensor* c : {&cos, &sin})
    TORCH_CHECK(c->scalar_type() == at::kFloat && c->is_contiguous() && c->numel() == T * D,
                "rotary: contiguous fp32 cos and sin [T, D]");
  at::Tensor out = at::empty({T, H, D}, x.options());
  const float *xp = x.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1);
  at::parallel_for(0, T, grain_rows(H * D), [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const float *c = cp + t * D, *s = sp + t * D;
      for (int64_t h = 0; h < H; ++h) {
        const float* xr = xp + t * xs0 + h * xs1;
        float* o = op + (t * H + h) * D;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) o[i] = xr[i] * c[i] + -xr[i + half] * s[i];
#pragma omp simd
        for (int64_t i = half; i < D; ++i) o[i] = xr[i] * c[i] + xr[i - half] * s[i];
      }
    }
  });
  return out;
}

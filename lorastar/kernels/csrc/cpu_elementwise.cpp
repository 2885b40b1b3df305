// The elementwise steps between a CPU layer's GEMMs, each one pass over its rows instead of the 3-8
// torch ops (and temporaries) of its composite form. At a decode step's sizes those ops cost their
// dispatch more than their arithmetic: SmolLM2 at one row spent ~86 us a layer on them (RMSNorm
// alone is pow, mean, add, rsqrt, mul, mul on CPU).
//
// Semantics (fp32 or bf16, every tensor of one dtype; rows with contiguous last dims, any row stride):
//   rms_norm(x [N, D], w [D])            -> w * (x * rsqrt(mean(x^2, -1) + eps))     [N, D]
//   add_rms_norm(x, h [N, D], w [D])     -> (s = x + h, rms_norm(s, w))             ([N, D], [N, D])
//   silu_and_mul(gu [N, 2I])             -> silu(gu[:, :I]) * gu[:, I:]               [N, I]
//   rotary(x [T, H, D], cos, sin [T, D]) -> x * cos + cat(-x[..., D/2:], x[..., :D/2]) * sin  [T, H, D]
// The same operation order as transformers' Llama; sums of squares and exp round differently from
// torch's (float lanes in another order, a polynomial exp: relative error < 2e-7), so fp32 results
// match torch's to a few ulp, not bit for bit. Each row's result depends on its values only, never on
// its address, batch or thread (greedy tokens must not depend on batching).
// bf16 computes in fp32 and rounds to bf16 (nearest even) wherever torch's bf16 composite form
// produces a bf16 tensor: the norm's scaled x before the weight, x + h, silu(g) before the product,
// both rotary products and their sum. So rotary and the add are bit-identical to torch's bf16 forms,
// the norm and SiLU within one bf16 ulp (their fp32 values differ by a few fp32 ulp before rounding).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include "cpu_ops.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"

namespace {

using bf16 = at::BFloat16;

// Loads as fp32 and rounds a fp32 result to the storage type (bf16: nearest even, as torch's casts).
inline float ld(const float* p, int64_t i) { return p[i]; }
inline float ld(const bf16* p, int64_t i) { return static_cast<float>(p[i]); }
template <typename T>
inline float rnd(float v);
template <>
inline float rnd<float>(float v) { return v; }
template <>
inline float rnd<bf16>(float v) { return static_cast<float>(static_cast<bf16>(v)); }
inline void st(float* p, int64_t i, float v) { p[i] = v; }
inline void st(bf16* p, int64_t i, float v) { p[i] = static_cast<bf16>(v); }

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

// A bf16 row, its values widened into xf [D] first: the weight multiplies x * r rounded to bf16 (the
// cast back in transformers' order), and the product is rounded again.
inline void norm_row(const float* __restrict xf, const bf16* __restrict w, bf16* __restrict out, int64_t D,
                     float eps) {
  const float ss = lorastar_vec::lane_sum<true>(xf, D);
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
  for (int64_t i = 0; i < D; ++i) out[i] = static_cast<bf16>(ld(w, i) * rnd<bf16>(xf[i] * r));
}

bool is_cpu_float(const at::Tensor& t) {
  return (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16) && t.device().is_cpu();
}

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(is_cpu_float(t) && t.dim() == 2 && t.stride(1) == 1, what,
              ": a 2-D fp32 or bf16 CPU tensor with contiguous rows");
}

void check_weight(const at::Tensor& w, const at::Tensor& x, int64_t D, const char* what) {
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.is_contiguous() && w.numel() == D, what,
              ": a contiguous weight [D] of x's dtype");
}

template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& w, double eps, at::Tensor& out) {
  const int64_t N = x.size(0), D = x.size(1), xs = x.stride(0);
  const T *xp = x.data_ptr<T>(), *wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, N, grain_rows(D), [&](int64_t lo, int64_t hi) {
    if constexpr (std::is_same_v<T, float>) {
      for (int64_t n = lo; n < hi; ++n) norm_row(xp + n * xs, wp, op + n * D, D, e);
    } else {
      std::vector<float> xf(D);
      for (int64_t n = lo; n < hi; ++n) {
        const T* xr = xp + n * xs;
        for (int64_t i = 0; i < D; ++i) xf[i] = ld(xr, i);
        norm_row(xf.data(), wp, op + n * D, D, e);
      }
    }
  });
}

template <typename T>
void add_rms_norm_impl(const at::Tensor& x, const at::Tensor& h, const at::Tensor& w, double eps, at::Tensor& s,
                       at::Tensor& out) {
  const int64_t N = x.size(0), D = x.size(1), xs = x.stride(0), hs = h.stride(0);
  const T *xp = x.data_ptr<T>(), *hp = h.data_ptr<T>(), *wp = w.data_ptr<T>();
  T *sp = s.data_ptr<T>(), *op = out.data_ptr<T>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, N, grain_rows(D), [&](int64_t lo, int64_t hi) {
    std::vector<float> sf(std::is_same_v<T, float> ? 0 : D);
    for (int64_t n = lo; n < hi; ++n) {
      const T *xr = xp + n * xs, *hr = hp + n * hs;
      T* sr = sp + n * D;
      if constexpr (std::is_same_v<T, float>) {
#pragma omp simd
        for (int64_t i = 0; i < D; ++i) sr[i] = xr[i] + hr[i];
        norm_row(sr, wp, op + n * D, D, e);
      } else {
        for (int64_t i = 0; i < D; ++i) {
          sf[i] = rnd<T>(ld(xr, i) + ld(hr, i));
          st(sr, i, sf[i]);
        }
        norm_row(sf.data(), wp, op + n * D, D, e);
      }
    }
  });
}

template <typename T>
void silu_and_mul_impl(const at::Tensor& gu, at::Tensor& out) {
  const int64_t N = gu.size(0), I = gu.size(1) / 2, gs = gu.stride(0);
  const T* gp = gu.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, N, grain_rows(I), [&](int64_t lo, int64_t hi) {
    for (int64_t n = lo; n < hi; ++n) {
      const T *g = gp + n * gs, *u = g + I;
      T* o = op + n * I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) st(o, i, rnd<T>(silu(ld(g, i))) * ld(u, i));
    }
  });
}

template <typename T>
void rotary_impl(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t T_ = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  const T *xp = x.data_ptr<T>(), *cp = cos.data_ptr<T>(), *sp = sin.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1);
  at::parallel_for(0, T_, grain_rows(H * D), [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const T *c = cp + t * D, *s = sp + t * D;
      for (int64_t h = 0; h < H; ++h) {
        const T* xr = xp + t * xs0 + h * xs1;
        T* o = op + (t * H + h) * D;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i)
          st(o, i, rnd<T>(ld(xr, i) * ld(c, i)) + rnd<T>(-ld(xr, i + half) * ld(s, i)));
#pragma omp simd
        for (int64_t i = half; i < D; ++i)
          st(o, i, rnd<T>(ld(xr, i) * ld(c, i)) + rnd<T>(ld(xr, i - half) * ld(s, i)));
      }
    }
  });
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, "rms_norm x");
  const int64_t N = x.size(0), D = x.size(1);
  check_weight(w, x, D, "rms_norm");
  at::Tensor out = at::empty({N, D}, x.options());
  if (x.scalar_type() == at::kFloat)
    rms_norm_impl<float>(x, w, eps, out);
  else
    rms_norm_impl<bf16>(x, w, eps, out);
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& h, const at::Tensor& w,
                                                double eps) {
  check_rows(x, "add_rms_norm x");
  check_rows(h, "add_rms_norm h");
  const int64_t N = x.size(0), D = x.size(1);
  TORCH_CHECK(h.size(0) == N && h.size(1) == D && h.scalar_type() == x.scalar_type(),
              "add_rms_norm: x and h of one shape and dtype");
  check_weight(w, x, D, "add_rms_norm");
  at::Tensor s = at::empty({N, D}, x.options()), out = at::empty({N, D}, x.options());
  if (x.scalar_type() == at::kFloat)
    add_rms_norm_impl<float>(x, h, w, eps, s, out);
  else
    add_rms_norm_impl<bf16>(x, h, w, eps, s, out);
  return {s, out};
}

at::Tensor silu_and_mul(const at::Tensor& gu) {
  check_rows(gu, "silu_and_mul");
  const int64_t N = gu.size(0), I = gu.size(1) / 2;
  TORCH_CHECK(gu.size(1) == 2 * I, "silu_and_mul: an even number of columns (gate, then up)");
  at::Tensor out = at::empty({N, I}, gu.options());
  if (gu.scalar_type() == at::kFloat)
    silu_and_mul_impl<float>(gu, out);
  else
    silu_and_mul_impl<bf16>(gu, out);
  return out;
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(is_cpu_float(x) && x.dim() == 3 && x.stride(2) == 1,
              "rotary: x [T, H, D] fp32 or bf16 with contiguous heads");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(D == 2 * half, "rotary: an even head size");
  for (const at::Tensor* c : {&cos, &sin})
    TORCH_CHECK(c->scalar_type() == x.scalar_type() && c->is_contiguous() && c->numel() == T * D,
                "rotary: contiguous cos and sin [T, D] of x's dtype");
  at::Tensor out = at::empty({T, H, D}, x.options());
  if (x.scalar_type() == at::kFloat)
    rotary_impl<float>(x, cos, sin, out);
  else
    rotary_impl<bf16>(x, cos, sin, out);
  return out;
}

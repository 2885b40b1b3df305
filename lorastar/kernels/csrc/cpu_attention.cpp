// Paged decode attention for the CPU: reads K/V straight out of the block cache (no gather copy).
//
// Semantics: out[rows[b], h] = softmax_p(capped(scale * q[rows[b], h] . K[p, h / G])) @ V[p, h / G]
//   for key positions p in [lo[b], lens[b]), K[p] = k_cache[gather[b, p / BS - lo[b] / BS], p % BS]
//   q, out [T, Hq, D] fp32 (rows may be strided); k_cache, v_cache [NB, BS, Hkv, D] fp32; rows, gather [Bd, nblk], lo,
//   lens [Bd] int64; G = Hq / Hkv; capped(s) = softcap * tanh(s / softcap) when softcap > 0.
//
// Each cached K/V byte is read once per step and layer (the gather path read it, wrote a copy and
// read the copy again).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_vec.h"

namespace {

using lorastar_vec::axpy;
using lorastar_vec::dot_rows4;

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

// Blocks sit anywhere in the cache and one block of one layer spans 3 pages (16 tokens x 768 B):
// the hardware prefetcher stops at each page, so the next block is prefetched by hand.
inline void prefetch_block(const float* p, int64_t floats) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < floats * 4; off += 64) __builtin_prefetch(c + off, 0, 3);
}

}  // namespace

void paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& rows, const at::Tensor& gather, const at::Tensor& lo,
                  const at::Tensor& lens, at::Tensor& out, double scale, double softcap) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "paged_decode: fp32 q, caches and out");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && gather.is_contiguous() &&
                  q.stride(2) == 1 && q.stride(1) == q.size(2) && out.stride(2) == 1 &&
                  out.stride(1) == out.size(2),
              "paged_decode: contiguous caches, [Hq, D] contiguous within each row of q and out");
  TORCH_CHECK(rows.scalar_type() == at::kLong && gather.scalar_type() == at::kLong &&
                  lo.scalar_type() == at::kLong && lens.scalar_type() == at::kLong,
              "paged_decode: int64 indices");
  const int64_t Bd = rows.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), Hkv = k_cache.size(2), nblk = gather.size(1);
  TORCH_CHECK(Hq % Hkv == 0 && k_cache.size(3) == D, "paged_decode: head shapes");
  const int64_t G = Hq / Hkv;
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* gp = gather.data_ptr<int64_t>();
  const int64_t* lop = lo.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t qrow = q.stride(0), orow = out.stride(0);
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);

  // One work item per decode row: its tokens' K/V rows ([Hkv, D], all heads) are read in cache
  // order, block by block, and every query head (G per kv head) reuses each read. Splitting the
  // item by kv head read each 768-byte token row in three strided pieces, 1.3x slower end to end.
  at::parallel_for(0, Bd, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s, acc(Hq * D);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t r = rp[b], l0 = lop[b], n = lp[b] - l0;
      const float* qr = qp + r * qrow;  // [Hq, D]; head h reads kv head h / G
      float* orow_p = op + r * orow;
      if (n <= 0) {
        std::fill(orow_p, orow_p + Hq * D, 0.f);
        continue;
      }
      s.resize(Hq * n);  // [Hq, n] scores, then weights
      // Walk block by block (no division per key): positions first * BS + c * BS + t, t in [t0, t1).
      const int64_t* blocks = gp + b * nblk;
      const int64_t first = l0 / BS, ncols = (lp[b] + BS - 1) / BS - first, tok = Hkv * D;
      auto span = [&](int64_t c, int64_t& t0, int64_t& t1) {
        t0 = c == 0 ? l0 - first * BS : 0;
        t1 = std::min(BS, lp[b] - (first + c) * BS);
      };
      for (int64_t c = 0, i = 0; c < ncols; ++c) {
        int64_t t0, t1;
        span(c, t0, t1);
        const float* kb = kp + blocks[c] * BS * tok;
        if (c == 0 && ncols > 1) prefetch_block(kp + blocks[1] * BS * tok, BS * tok);
        if (c + 2 < ncols) prefetch_block(kp + blocks[c + 2] * BS * tok, BS * tok);
        if (c + 2 >= ncols && c + 2 - ncols < ncols)  // the first V blocks, read next
          prefetch_block(vp + blocks[c + 2 - ncols] * BS * tok, BS * tok);
        for (int64_t t = t0; t < t1; ++t, ++i) {
          for (int64_t hk = 0; hk < Hkv; ++hk)
            for (int64_t g = 0; g < G; g += 4) {
              const int64_t nq = std::min<int64_t>(4, G - g);
              float d4[4];
              dot_rows4(qr + (hk * G + g) * D, nq, kb + t * tok + hk * D, D, d4);
              for (int64_t j = 0; j < nq; ++j) {
                float x = sc * d4[j];
                if (cap > 0.f) x = cap * std::tanh(x / cap);
                s[(hk * G + g + j) * n + i] = x;
              }
            }
        }
      }
      for (int64_t h = 0; h < Hq; ++h) {
        float* sh = s.data() + h * n;
        float m = -std::numeric_limits<float>::infinity(), sum = 0.f;
#pragma omp simd reduction(max : m)
        for (int64_t i = 0; i < n; ++i) m = std::max(m, sh[i]);
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; ++i) sum += (sh[i] = exp_nonpos(sh[i] - m));
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) sh[i] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t c = 0, i = 0; c < ncols; ++c) {
        int64_t t0, t1;
        span(c, t0, t1);
        const float* vb = vp + blocks[c] * BS * tok;
        if (c + 2 < ncols) prefetch_block(vp + blocks[c + 2] * BS * tok, BS * tok);
        for (int64_t t = t0; t < t1; ++t, ++i)
          for (int64_t hk = 0; hk < Hkv; ++hk)
            for (int64_t h = hk * G; h < (hk + 1) * G; ++h) axpy(s[h * n + i], vb + t * tok + hk * D, acc.data() + h * D, D);
      }
      std::copy(acc.begin(), acc.end(), orow_p);
    }
  });
}

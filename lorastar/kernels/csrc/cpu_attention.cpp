// Paged decode attention for the CPU: reads K/V straight out of the block cache (no gather copy).
//
// Semantics: out[rows[b], h] = softmax_p(capped(scale * q[rows[b], h] . K[p, h / G])) @ V[p, h / G]
//   for key positions p in [lo[b], lens[b]), K[p] = k_cache[gather[b, p / BS - lo[b] / BS], p % BS]
//   q, out [T, Hq, D] (rows may be strided); k_cache, v_cache [NB, BS, Hkv, D]: all fp32 or all bf16;
//   rows, gather [Bd, nblk], lo, lens [Bd] int64; G = Hq / Hkv; capped(s) = softcap * tanh(s / softcap)
//   when softcap > 0.
//
// Each cached K/V byte is read once per step and layer (the gather path read it, wrote a copy and
// read the copy again).
//
// Two forms of a row's work, the same arithmetic up to float summation order:
// * tiled (built for AVX-512, D a multiple of 16 up to 128 or 256, BS a multiple of 16): scores for 16
//   keys at a time (16 dot products reduced together by one shuffle tree, no horizontal sum per
//   key), then each group of query heads' output rows held in registers over all keys. SmolLM2's
//   shapes (9 heads over 3, D = 64), 16 rows x 200 keys: 410 vs 730 us; 64 rows x 300 keys: 2.5 vs
//   4.7 ms, one thread (Xeon, AVX-512). Built for AVX2 the same code spills and ran 2.5x slower than
//   the generic form, which such builds keep.
// * generic: one key at a time, four query heads per pass (dot_rows4).
// bf16: q and each K/V row are widened to fp32 as they are read (exact), scores, softmax and the
// weighted sum run in fp32 as above, and the output row is rounded to bf16 once, at the end.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include "cpu_ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"

namespace {

using lorastar_vec::axpy;
using lorastar_vec::dot_rows4;
using lorastar_vec::exp_nonpos;

// Blocks sit anywhere in the cache and one block of one layer spans 3 pages (16 tokens x 768 B):
// the hardware prefetcher stops at each page, so the next block is prefetched by hand.
template <typename T>
inline void prefetch_block(const T* p, int64_t elems) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < elems * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(c + off, 0, 3);
}

using bf16 = at::BFloat16;

// x[i0:i1] = softmax(x[i0:i1]) in place (i1 > i0).
inline void softmax_inplace(float* x, int64_t i0, int64_t i1) {
  float m = -std::numeric_limits<float>::infinity(), sum = 0.f;
#pragma omp simd reduction(max : m)
  for (int64_t i = i0; i < i1; ++i) m = std::max(m, x[i]);
#pragma omp simd reduction(+ : sum)
  for (int64_t i = i0; i < i1; ++i) sum += (x[i] = exp_nonpos(x[i] - m));
  const float inv = 1.f / sum;
#pragma omp simd
  for (int64_t i = i0; i < i1; ++i) x[i] *= inv;
}

// GCC's vector extensions (__builtin_shuffle): other compilers build the generic form only.
#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__)
#define LORASTAR_TILED_DECODE 1
// 16 floats in one register (GCC vector extensions: one zmm here).
typedef float vf16 __attribute__((vector_size(64)));
typedef int vi16 __attribute__((vector_size(64)));
inline vf16 load16(const float* p) {
  vf16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store16(float* p, vf16 v) { std::memcpy(p, &v, sizeof v); }
// 16 bf16 widened to fp32: the 16 bits become the high half of each float (exact).
typedef unsigned short vu16 __attribute__((vector_size(32)));
inline vf16 load16(const bf16* p) {
  vu16 h;
  std::memcpy(&h, p, sizeof h);
  const vi16 w = __builtin_convertvector(h, vi16) << 16;
  vf16 v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}

// The lane sums of 16 vectors at once: the sum of v[i]'s lanes lands in lane kTreeLane[i] (an
// involution), so callers put key t's products in v[kTreeLane[t]] and read its score in lane t.
// Every add joins lanes of one vector only. 4 levels, 30 shuffles and 15 adds for 16 sums.
constexpr int kTreeLane[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};
inline vf16 sum16(const vf16* v) {
  const vi16 q01 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const vi16 q23 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  const vi16 q02 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const vi16 q13 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
  const vi16 e01 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
  const vi16 e23 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
  const vi16 e02 = {0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30};
  const vi16 e13 = {1, 3, 17, 19, 5, 7, 21, 23, 9, 11, 25, 27, 13, 15, 29, 31};
  vf16 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i) w[i] = __builtin_shuffle(v[i], v[i + 8], q01) + __builtin_shuffle(v[i], v[i + 8], q23);
  for (int i = 0; i < 4; ++i) x[i] = __builtin_shuffle(w[i], w[i + 4], q02) + __builtin_shuffle(w[i], w[i + 4], q13);
  for (int i = 0; i < 2; ++i) y[i] = __builtin_shuffle(x[i], x[i + 2], e01) + __builtin_shuffle(x[i], x[i + 2], e23);
  return __builtin_shuffle(y[0], y[1], e02) + __builtin_shuffle(y[0], y[1], e13);
}

// One decode row, D = 16 * NCH. Scores cover whole blocks (positions first * BS + j, j < W) and
// only [j0, j1) are used: the rest of a block's slots are read but never weigh in.
template <int NCH, typename T>
void decode_row_tiled(const float* qr, const T* kp, const T* vp, const int64_t* blocks, int64_t l0,
                      int64_t len, int64_t Hq, int64_t Hkv, int64_t BS, float sc, float cap, float* orow_p,
                      std::vector<float>& s) {
  constexpr int64_t D = NCH * 16;
  // Query heads whose [D] accumulators stay in registers together (at most ~24 of the 32 zmm).
  constexpr int GC = std::max(1, std::min(8, 24 / NCH));
  const int64_t G = Hq / Hkv, tok = Hkv * D, first = l0 / BS, ncols = (len + BS - 1) / BS - first;
  const int64_t W = ncols * BS, j0 = l0 - first * BS, j1 = len - first * BS;
  s.resize(Hq * W);  // [Hq, W] scores, then weights
  for (int64_t c = 0; c < ncols; ++c) {
    const T* kb = kp + blocks[c] * BS * tok;
    if (c + 1 < ncols) prefetch_block(kp + blocks[c + 1] * BS * tok, BS * tok);
    else prefetch_block(vp + blocks[0] * BS * tok, BS * tok);  // the first V block, read next
    for (int64_t t0 = 0; t0 < BS; t0 += 16)
      for (int64_t hk = 0; hk < Hkv; ++hk) {
        const T* kt = kb + t0 * tok + hk * D;  // key t0 + t of kv head hk: kt + t * tok
        for (int64_t g = 0; g < G; ++g) {
          const float* qh = qr + (hk * G + g) * D;
          vf16 acc[16];
#pragma GCC unroll 16
          for (int t = 0; t < 16; ++t) acc[t] = vf16{};
#pragma GCC unroll 16
          for (int ch = 0; ch < NCH; ++ch) {
            const vf16 qv = load16(qh + ch * 16);
#pragma GCC unroll 16
            for (int t = 0; t < 16; ++t) acc[t] += qv * load16(kt + kTreeLane[t] * tok + ch * 16);
          }
          store16(s.data() + (hk * G + g) * W + c * BS + t0, sc * sum16(acc));
        }
      }
  }
  for (int64_t h = 0; h < Hq; ++h) {
    float* sh = s.data() + h * W;
    if (cap > 0.f)
      for (int64_t j = j0; j < j1; ++j) sh[j] = cap * std::tanh(sh[j] / cap);
    softmax_inplace(sh, j0, j1);
  }
  for (int64_t hk = 0; hk < Hkv; ++hk)
    for (int64_t g0 = 0; g0 < G; g0 += GC) {
      const int ng = static_cast<int>(std::min<int64_t>(GC, G - g0));
      const float* sp = s.data() + (hk * G + g0) * W;
      vf16 acc[GC][NCH];
#pragma GCC unroll 16
      for (int j = 0; j < GC; ++j)
#pragma GCC unroll 16
        for (int ch = 0; ch < NCH; ++ch) acc[j][ch] = vf16{};
      for (int64_t c = 0; c < ncols; ++c) {
        const int64_t t0 = c == 0 ? j0 : 0, t1 = std::min(BS, j1 - c * BS);
        const T* vb = vp + blocks[c] * BS * tok + hk * D;
        if (hk == 0 && g0 == 0 && c + 1 < ncols) prefetch_block(vp + blocks[c + 1] * BS * tok, BS * tok);
        for (int64_t t = t0; t < t1; ++t) {
          vf16 vv[NCH];
#pragma GCC unroll 16
          for (int ch = 0; ch < NCH; ++ch) vv[ch] = load16(vb + t * tok + ch * 16);
#pragma GCC unroll 16
          for (int j = 0; j < GC; ++j)
            if (j < ng) {
              const vf16 w = vf16{} + sp[j * W + c * BS + t];
#pragma GCC unroll 16
              for (int ch = 0; ch < NCH; ++ch) acc[j][ch] += w * vv[ch];
            }
        }
      }
      for (int j = 0; j < ng; ++j)
        for (int ch = 0; ch < NCH; ++ch) store16(orow_p + (hk * G + g0 + j) * D + ch * 16, acc[j][ch]);
    }
}

template <typename T>
using TiledRow = void (*)(const float*, const T*, const T*, const int64_t*, int64_t, int64_t, int64_t, int64_t,
                          int64_t, float, float, float*, std::vector<float>&);
template <typename T>
TiledRow<T> tiled_for(int64_t D, int64_t BS) {
  if (BS % 16 != 0) return nullptr;
  switch (D) {
    case 16: return decode_row_tiled<1, T>;
    case 32: return decode_row_tiled<2, T>;
    case 48: return decode_row_tiled<3, T>;
    case 64: return decode_row_tiled<4, T>;
    case 80: return decode_row_tiled<5, T>;
    case 96: return decode_row_tiled<6, T>;
    case 112: return decode_row_tiled<7, T>;
    case 128: return decode_row_tiled<8, T>;
    case 256: return decode_row_tiled<16, T>;
    default: return nullptr;
  }
}
#endif

template <typename T>
void paged_decode_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& rows, const at::Tensor& gather, const at::Tensor& lo, const at::Tensor& lens,
                       at::Tensor& out, double scale, double softcap, bool tiled) {
  const int64_t Bd = rows.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), Hkv = k_cache.size(2), nblk = gather.size(1);
  const int64_t G = Hq / Hkv;
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* gp = gather.data_ptr<int64_t>();
  const int64_t* lop = lo.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int64_t qrow = q.stride(0), orow = out.stride(0);
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
  constexpr bool kF32 = std::is_same_v<T, float>;

  // One work item per decode row: its tokens' K/V rows ([Hkv, D], all heads) are read in cache
  // order, block by block, and every query head (G per kv head) reuses each read. Splitting the
  // item by kv head read each 768-byte token row in three strided pieces, 1.3x slower end to end.
#ifdef LORASTAR_TILED_DECODE
  const TiledRow<T> tiled_row = tiled ? tiled_for<T>(D, BS) : nullptr;
#else
  (void)tiled;
#endif
  at::parallel_for(0, Bd, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s, acc(Hq * D), qbuf, kbuf, vbuf;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t r = rp[b], l0 = lop[b], n = lp[b] - l0;
      const float* qr = lorastar_vec::as_f32(qp + r * qrow, Hq * D, qbuf);  // [Hq, D]; head h reads kv head h / G
      // fp32 rows are written in place; bf16 ones go through acc and are rounded at the end.
      float* orow_p = kF32 ? reinterpret_cast<float*>(op + r * orow) : acc.data();
      auto finish = [&] {
        if constexpr (!kF32) {
          T* o = op + r * orow;
          for (int64_t i = 0; i < Hq * D; ++i) o[i] = static_cast<T>(acc[i]);
        }
      };
      if (n <= 0) {
        std::fill(orow_p, orow_p + Hq * D, 0.f);
        finish();
        continue;
      }
#ifdef LORASTAR_TILED_DECODE
      if (tiled_row != nullptr) {
        tiled_row(qr, kp, vp, gp + b * nblk, l0, lp[b], Hq, Hkv, BS, sc, cap, orow_p, s);
        finish();
        continue;
      }
#endif
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
        const T* kb = kp + blocks[c] * BS * tok;
        if (c == 0 && ncols > 1) prefetch_block(kp + blocks[1] * BS * tok, BS * tok);
        if (c + 2 < ncols) prefetch_block(kp + blocks[c + 2] * BS * tok, BS * tok);
        if (c + 2 >= ncols && c + 2 - ncols < ncols)  // the first V blocks, read next
          prefetch_block(vp + blocks[c + 2 - ncols] * BS * tok, BS * tok);
        for (int64_t t = t0; t < t1; ++t, ++i) {
          const float* kt = lorastar_vec::as_f32(kb + t * tok, tok, kbuf);  // [Hkv, D]
          for (int64_t hk = 0; hk < Hkv; ++hk)
            for (int64_t g = 0; g < G; g += 4) {
              const int64_t nq = std::min<int64_t>(4, G - g);
              float d4[4];
              dot_rows4(qr + (hk * G + g) * D, nq, kt + hk * D, D, d4);
              for (int64_t j = 0; j < nq; ++j) {
                float x = sc * d4[j];
                if (cap > 0.f) x = cap * std::tanh(x / cap);
                s[(hk * G + g + j) * n + i] = x;
              }
            }
        }
      }
      for (int64_t h = 0; h < Hq; ++h) softmax_inplace(s.data() + h * n, 0, n);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t c = 0, i = 0; c < ncols; ++c) {
        int64_t t0, t1;
        span(c, t0, t1);
        const T* vb = vp + blocks[c] * BS * tok;
        if (c + 2 < ncols) prefetch_block(vp + blocks[c + 2] * BS * tok, BS * tok);
        for (int64_t t = t0; t < t1; ++t, ++i) {
          const float* vt = lorastar_vec::as_f32(vb + t * tok, tok, vbuf);  // [Hkv, D]
          for (int64_t hk = 0; hk < Hkv; ++hk)
            for (int64_t h = hk * G; h < (hk + 1) * G; ++h) axpy(s[h * n + i], vt + hk * D, acc.data() + h * D, D);
        }
      }
      if constexpr (kF32) std::copy(acc.begin(), acc.end(), orow_p);
      finish();
    }
  });
}

}  // namespace

void paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& rows, const at::Tensor& gather, const at::Tensor& lo,
                  const at::Tensor& lens, at::Tensor& out, double scale, double softcap, bool tiled) {
  const auto dt = q.scalar_type();
  TORCH_CHECK((dt == at::kFloat || dt == at::kBFloat16) && k_cache.scalar_type() == dt &&
                  v_cache.scalar_type() == dt && out.scalar_type() == dt,
              "paged_decode: q, caches and out all fp32 or all bf16");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && gather.is_contiguous() &&
                  q.stride(2) == 1 && q.stride(1) == q.size(2) && out.stride(2) == 1 &&
                  out.stride(1) == out.size(2),
              "paged_decode: contiguous caches, [Hq, D] contiguous within each row of q and out");
  TORCH_CHECK(rows.scalar_type() == at::kLong && gather.scalar_type() == at::kLong &&
                  lo.scalar_type() == at::kLong && lens.scalar_type() == at::kLong,
              "paged_decode: int64 indices");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && k_cache.size(3) == q.size(2), "paged_decode: head shapes");
  if (dt == at::kFloat)
    paged_decode_impl<float>(q, k_cache, v_cache, rows, gather, lo, lens, out, scale, softcap, tiled);
  else
    paged_decode_impl<bf16>(q, k_cache, v_cache, rows, gather, lo, lens, out, scale, softcap, tiled);
}

// Whether this build has the tiled form (compiled for AVX-512); paged_decode uses it where the head
// size and block size allow unless told not to.
bool paged_decode_tiled() {
#ifdef LORASTAR_TILED_DECODE
  return true;
#else
  return false;
#endif
}

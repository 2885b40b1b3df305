// Multi-LoRA for CPU decode rows: punica's SGMV over (slot, rows) segments at each slot's true rank.
//
// Semantics: for (slot, s, e) in segs, for slice i, r = ranks[slot] > 0:
//   y[s:e, off_i : off_i + N_i] += (x[s:e] @ A_i[slot, :r].T) @ Bt_i[slot, :r]
//   x [T, H]; y [T, Ntot] (rows may be strided); A_i [S, R, H]; Bt_i [S, R, N_i] (B transposed,
//   scaling folded in), all fp32 or all bf16; shared[slot]: every slice of the slot holds the same A,
//   so one shrink serves all.
// bf16 follows ref_lora_shrink / ref_lora_expand (the GPU kernels' rounding): the shrink is computed in
// fp32 from the bf16 values and rounded to bf16, the expand sums in fp32 and y + delta is rounded once.
//
// Each adapter's weights are read once per step and linear, only its first r ranks: the batched
// torch form (one bmm over a [slots, rows, H] grid) read every slot at the step's largest rank.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include "cpu_ops.h"

#include <array>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"

namespace {

using bf16 = at::BFloat16;

template <typename T>
void lora_segments_impl(const at::Tensor& x, at::Tensor& y, const std::vector<at::Tensor>& a,
                        const std::vector<at::Tensor>& b, const std::vector<int64_t>& offsets,
                        const std::vector<int64_t>& segs, const std::vector<int64_t>& ranks,
                        const std::vector<bool>& shared) {
  constexpr bool kF32 = std::is_same_v<T, float>;
  const int64_t P = static_cast<int64_t>(a.size());
  const int64_t H = x.size(1), R = a[0].size(1);
  const int64_t nseg = static_cast<int64_t>(segs.size() / 3), T_ = x.size(0);
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const int64_t xs = x.stride(0), ys = y.stride(0);
  at::Tensor t = at::empty({T_, P, R}, x.options().dtype(at::kFloat));  // shrink results (bf16: rounded)
  float* tp = t.data_ptr<float>();

  // Shrink: one item per (segment, slice that needs its own A).
  std::vector<std::array<int64_t, 3>> shrink, expand;
  for (int64_t k = 0; k < nseg; ++k) {
    const int64_t slot = segs[3 * k];
    if (ranks[slot] == 0 || segs[3 * k + 1] == segs[3 * k + 2]) continue;
    for (int64_t i = 0; i < (shared[slot] ? 1 : P); ++i) shrink.push_back({k, i, 0});
  }
  at::parallel_for(0, static_cast<int64_t>(shrink.size()), 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> xbuf, abuf;
    for (int64_t w = lo; w < hi; ++w) {
      const int64_t k = shrink[w][0], i = shrink[w][1];
      const int64_t slot = segs[3 * k], s = segs[3 * k + 1], e = segs[3 * k + 2], r = ranks[slot];
      // The segment's rows [e - s, H] and the slot's first r rows of A [r, H], as fp32.
      const float* xr;
      int64_t xrs = xs;
      if constexpr (kF32) {
        xr = xp + s * xs;
      } else {
        xbuf.resize((e - s) * H);
        for (int64_t row = s; row < e; ++row)
          for (int64_t d = 0; d < H; ++d) xbuf[(row - s) * H + d] = static_cast<float>(xp[row * xs + d]);
        xr = xbuf.data();
        xrs = H;
      }
      const float* ap = lorastar_vec::as_f32(a[i].data_ptr<T>() + slot * R * H, r * H, abuf);
      for (int64_t j = 0; j < r; j += 4) {
        const int64_t nq = std::min<int64_t>(4, r - j);
        int64_t row = s;
        for (; row + 1 < e; row += 2)
          lorastar_vec::dot_rows4x2(ap + j * H, nq, xr + (row - s) * xrs, xr + (row + 1 - s) * xrs, H,
                                   tp + (row * P + i) * R + j, tp + ((row + 1) * P + i) * R + j);
        if (row < e) lorastar_vec::dot_rows4(ap + j * H, nq, xr + (row - s) * xrs, H, tp + (row * P + i) * R + j);
      }
      if constexpr (!kF32)
        for (int64_t row = s; row < e; ++row)
          for (int64_t j = 0; j < r; ++j) {
            float& v = tp[(row * P + i) * R + j];
            v = static_cast<float>(static_cast<bf16>(v));
          }
    }
  });

  // Expand: one item per (segment, slice, block of 256 output columns): y row += t[j] * Bt[j].
  constexpr int64_t kCols = 256;
  for (int64_t k = 0; k < nseg; ++k) {
    const int64_t slot = segs[3 * k];
    if (ranks[slot] == 0 || segs[3 * k + 1] == segs[3 * k + 2]) continue;
    for (int64_t i = 0; i < P; ++i)
      for (int64_t c = 0; c < b[i].size(2); c += kCols) expand.push_back({k, i, c});
  }
  at::parallel_for(0, static_cast<int64_t>(expand.size()), 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> bbuf;
    float acc[kCols];
    for (int64_t w = lo; w < hi; ++w) {
      const int64_t k = expand[w][0], i = expand[w][1], c0 = expand[w][2];
      const int64_t slot = segs[3 * k], s = segs[3 * k + 1], e = segs[3 * k + 2], r = ranks[slot];
      const int64_t N = b[i].size(2), c1 = std::min(N, c0 + kCols), src = shared[slot] ? 0 : i, n = c1 - c0;
      const T* bp = b[i].data_ptr<T>() + slot * R * N + c0;
      if constexpr (kF32) {
        for (int64_t row = s; row < e; ++row) {
          const float* tr = tp + (row * P + src) * R;
          float* yr = yp + row * ys + offsets[i] + c0;
          for (int64_t j = 0; j < r; ++j) lorastar_vec::axpy(tr[j], bp + j * N, yr, n);
        }
      } else {
        bbuf.resize(r * n);  // this block's columns of B.T's first r rows, as fp32
        for (int64_t j = 0; j < r; ++j)
          for (int64_t c = 0; c < n; ++c) bbuf[j * n + c] = static_cast<float>(bp[j * N + c]);
        for (int64_t row = s; row < e; ++row) {
          const float* tr = tp + (row * P + src) * R;
          bf16* yr = yp + row * ys + offsets[i] + c0;
          std::fill(acc, acc + n, 0.f);
          for (int64_t j = 0; j < r; ++j) lorastar_vec::axpy(tr[j], bbuf.data() + j * n, acc, n);
          for (int64_t c = 0; c < n; ++c) yr[c] = static_cast<bf16>(static_cast<float>(yr[c]) + acc[c]);
        }
      }
    }
  });
}

}  // namespace

void lora_segments(const at::Tensor& x, at::Tensor& y, const std::vector<at::Tensor>& a,
                   const std::vector<at::Tensor>& b, const std::vector<int64_t>& offsets,
                   const std::vector<int64_t>& segs, const std::vector<int64_t>& ranks,
                   const std::vector<bool>& shared) {
  const int64_t P = static_cast<int64_t>(a.size());
  TORCH_CHECK(P > 0 && static_cast<int64_t>(b.size()) == P &&
                  static_cast<int64_t>(offsets.size()) == P && segs.size() % 3 == 0,
              "lora_segments: one A, B and offset per slice; segments as (slot, start, end) triples");
  const auto dt = x.scalar_type();
  TORCH_CHECK((dt == at::kFloat || dt == at::kBFloat16) && y.scalar_type() == dt && x.stride(1) == 1 &&
                  y.stride(1) == 1,
              "lora_segments: x and y both fp32 or both bf16, with contiguous rows");
  const int64_t H = x.size(1), R = a[0].size(1), S = a[0].size(0);
  for (int64_t i = 0; i < P; ++i) {
    TORCH_CHECK(a[i].scalar_type() == dt && b[i].scalar_type() == dt && a[i].is_contiguous() &&
                    b[i].is_contiguous() && a[i].size(1) == R && a[i].size(2) == H && b[i].size(1) == R &&
                    a[i].size(0) == S && b[i].size(0) == S,
                "lora_segments: contiguous A [S, R, H] and B.T [S, R, N] per slice, of x's dtype");
    TORCH_CHECK(offsets[i] >= 0 && offsets[i] + b[i].size(2) <= y.size(1), "lora_segments: slice columns");
  }
  TORCH_CHECK(static_cast<int64_t>(ranks.size()) == S && static_cast<int64_t>(shared.size()) == S,
              "lora_segments: one rank and shared flag per slot");
  const int64_t nseg = static_cast<int64_t>(segs.size() / 3), T = x.size(0);
  for (int64_t k = 0; k < nseg; ++k) {
    const int64_t slot = segs[3 * k], s = segs[3 * k + 1], e = segs[3 * k + 2];
    TORCH_CHECK(slot >= 0 && slot < S && 0 <= s && s <= e && e <= T, "lora_segments: segment out of range");
    TORCH_CHECK(ranks[slot] >= 0 && ranks[slot] <= R, "lora_segments: rank past the buffers");
  }
  if (dt == at::kFloat)
    lora_segments_impl<float>(x, y, a, b, offsets, segs, ranks, shared);
  else
    lora_segments_impl<bf16>(x, y, a, b, offsets, segs, ranks, shared);
}

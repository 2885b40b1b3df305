// The CPU ops as Python sees them (semantics in each op's source file and in reference.py).
//
// Declared here and defined in their own sources, which include only ATen's core headers, so they
// compile apart from (and in parallel with) the Python bindings in cpu_bindings.cpp: a
// <torch/extension.h> in every source took ~28 s of parsing per build on 2 cores.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <tuple>
#include <vector>

// cpu_attention.cpp
void paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& rows, const at::Tensor& gather, const at::Tensor& lo,
                  const at::Tensor& lens, at::Tensor& out, double scale, double softcap, bool tiled);
bool paged_decode_tiled();

// cpu_lora.cpp
void lora_segments(const at::Tensor& x, at::Tensor& y, const std::vector<at::Tensor>& a,
                   const std::vector<at::Tensor>& b, const std::vector<int64_t>& offsets,
                   const std::vector<int64_t>& segs, const std::vector<int64_t>& ranks,
                   const std::vector<bool>& shared);

// cpu_elementwise.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& h, const at::Tensor& w,
                                                double eps);
at::Tensor silu_and_mul(const at::Tensor& gu);
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// cpu_int8.cpp
at::Tensor int8_pack(at::Tensor q);
at::Tensor int8_logits(at::Tensor x, at::Tensor qp, at::Tensor scale);

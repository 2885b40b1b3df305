// Python bindings of the CPU ops (cpu_ops.h), as torch's load_inline wrote them: each call turns a
// c10::Error (TORCH_CHECK) into a Python exception and keeps torch's warning handling.
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>

#include "cpu_ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", torch::wrap_pybind_function(paged_decode), "paged_decode");
  m.def("paged_decode_tiled", torch::wrap_pybind_function(paged_decode_tiled), "paged_decode_tiled");
  m.def("lora_segments", torch::wrap_pybind_function(lora_segments), "lora_segments");
  m.def("rms_norm", torch::wrap_pybind_function(rms_norm), "rms_norm");
  m.def("add_rms_norm", torch::wrap_pybind_function(add_rms_norm), "add_rms_norm");
  m.def("silu_and_mul", torch::wrap_pybind_function(silu_and_mul), "silu_and_mul");
  m.def("rotary", torch::wrap_pybind_function(rotary), "rotary");
  m.def("int8_pack", torch::wrap_pybind_function(int8_pack), "int8_pack");
  m.def("int8_logits", torch::wrap_pybind_function(int8_logits), "int8_logits");
}

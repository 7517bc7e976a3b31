// What the CPU and CUDA torch bindings share: the table built from Python lists, and id checks.
#pragma once

#include <torch/extension.h>

#include <vector>

#include "state_copy.h"

namespace sgl_state_copy {

inline StateTable make_table(const std::vector<int64_t>& base, const std::vector<int64_t>& num_layers,
                             const std::vector<int64_t>& layer_stride, const std::vector<int64_t>& slot_stride,
                             const std::vector<int64_t>& row_bytes, int64_t num_slots) {
  const size_t n = base.size();
  TORCH_CHECK(n >= 1 && n <= static_cast<size_t>(kMaxTensors), "state copy: 1 to ", kMaxTensors,
              " state tensors, got ", n);
  TORCH_CHECK(num_layers.size() == n && layer_stride.size() == n && slot_stride.size() == n &&
                  row_bytes.size() == n,
              "state copy: table columns differ in length");
  StateTable t;
  t.num_tensors = static_cast<int32_t>(n);
  t.num_slots = num_slots;
  for (size_t k = 0; k < n; ++k) {
    t.base[k] = base[k];
    t.num_layers[k] = num_layers[k];
    t.layer_stride[k] = layer_stride[k];
    t.slot_stride[k] = slot_stride[k];
    t.row_bytes[k] = row_bytes[k];
  }
  return t;
}

inline void check_ids(const torch::Tensor& ids, const char* what, const torch::Device& device) {
  TORCH_CHECK(ids.device() == device && ids.scalar_type() == torch::kInt64 && ids.dim() == 1 && ids.is_contiguous(),
              "state copy: ", what, " must be a contiguous 1-D int64 tensor on ", device);
}

inline const bool* check_mask(const c10::optional<torch::Tensor>& mask, int64_t rows, const torch::Device& device) {
  if (!mask.has_value()) return nullptr;
  TORCH_CHECK(mask->device() == device && mask->scalar_type() == torch::kBool && mask->is_contiguous() &&
                  mask->numel() == rows,
              "state copy: mask must be a contiguous bool tensor on ", device, " with one entry per row");
  return mask->data_ptr<bool>();
}

// Registers StateTable, copy(table, src, dst, mask=None) and clear(table, slots) on the module. The CPU
// and CUDA extensions both register a StateTable, and a process loads both on a GPU machine: the class is
// module-local, else pybind11 refuses the second ("generic_type: type "StateTable" is already registered").
template <typename CopyFn, typename ClearFn>
void define_module(pybind11::module_& m, CopyFn copy, ClearFn clear) {
  namespace py = pybind11;
  py::class_<StateTable>(m, "StateTable", py::module_local())
      .def(py::init(&make_table), py::arg("base"), py::arg("num_layers"), py::arg("layer_stride"),
           py::arg("slot_stride"), py::arg("row_bytes"), py::arg("num_slots"));
  m.def("copy", copy, "Copy the slot rows src[i] -> dst[i] of every state tensor (kept rows only).",
        py::arg("table"), py::arg("src"), py::arg("dst"), py::arg("mask") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("clear", clear, "Zero the slot rows of every state tensor (slots > 0 only).", py::arg("table"),
        py::arg("slots"), py::call_guard<py::gil_scoped_release>());
}

}  // namespace sgl_state_copy

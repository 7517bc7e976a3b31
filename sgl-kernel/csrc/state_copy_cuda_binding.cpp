// Torch binding of the CUDA state-copy kernel (state_copy_cuda.cu): launches on the current stream
// of the ids' device, so the op orders with the forward like any torch op and can be graph-captured.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/extension.h>

#include "state_copy.h"
#include "state_copy_binding.h"

namespace sgl_state_copy {
namespace {

void launch_checked(const StateTable& t, const int64_t* src, const torch::Tensor& dst, const bool* mask) {
  const c10::cuda::CUDAGuard guard(dst.device());
  const int err = launch_state_copy_cuda(t, src, dst.data_ptr<int64_t>(), mask, dst.numel(),
                                         c10::cuda::getCurrentCUDAStream(dst.device().index()).stream());
  TORCH_CHECK(err == 0, "state copy: CUDA launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}

void copy(const StateTable& t, const torch::Tensor& src, const torch::Tensor& dst,
          const c10::optional<torch::Tensor>& mask) {
  TORCH_CHECK(dst.is_cuda(), "state copy: dst must be a CUDA tensor");
  check_ids(src, "src", dst.device());
  check_ids(dst, "dst", dst.device());
  TORCH_CHECK(src.numel() == dst.numel(), "state copy: src and dst differ in length");
  launch_checked(t, src.data_ptr<int64_t>(), dst, check_mask(mask, dst.numel(), dst.device()));
}

void clear(const StateTable& t, const torch::Tensor& slots) {
  TORCH_CHECK(slots.is_cuda(), "state copy: slots must be a CUDA tensor");
  check_ids(slots, "slots", slots.device());
  launch_checked(t, nullptr, slots, nullptr);
}

}  // namespace
}  // namespace sgl_state_copy

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  sgl_state_copy::define_module(m, &sgl_state_copy::copy, &sgl_state_copy::clear);
}

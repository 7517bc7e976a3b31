// Mamba state-copy ops: what the CPU (OpenMP) and CUDA implementations share.
//
// A launch moves whole slot rows of every state tensor of a pool (all layers, conv and SSM) at once.
// Each state tensor is described by byte quantities, so one launch serves any mix of dtypes:
//   row(t, layer, slot) = base[t] + layer * layer_stride[t] + slot * slot_stride[t], row_bytes[t] long.
//
// Row i of a launch is kept when (mask == nullptr || mask[i]) and dst[i] > 0 and, for a copy,
// src[i] >= 0 and src[i] != dst[i]. So -1 entries (any negative id) are skipped, the dummy slot 0 is never
// written, and a row copying a slot onto itself does nothing. Kept rows must not overlap: their
// destinations are distinct and no destination is another kept row's source (the Python front-end
// checks this for host ids). A clear zeroes the rows of dst (bytes 0: +0.0 in every float type).
// An id >= num_slots is a caller error: the CPU op raises, the CUDA kernel skips the row (it cannot
// raise without a device sync).
#pragma once

#include <cstdint>

namespace sgl_state_copy {

constexpr int kMaxTensors = 8;

struct StateTable {
  int32_t num_tensors = 0;
  int64_t num_slots = 0;  // slot ids are < num_slots in every tensor
  int64_t base[kMaxTensors] = {};  // address of row(t, 0, 0)
  int64_t num_layers[kMaxTensors] = {};
  int64_t layer_stride[kMaxTensors] = {};
  int64_t slot_stride[kMaxTensors] = {};
  int64_t row_bytes[kMaxTensors] = {};
};

#if defined(__CUDACC__)
#define SGL_STATE_COPY_HD __host__ __device__ __forceinline__
#else
#define SGL_STATE_COPY_HD inline
#endif

SGL_STATE_COPY_HD bool row_kept(const int64_t* src, const int64_t* dst, const bool* mask, int64_t i) {
  if (mask != nullptr && !mask[i]) return false;
  const int64_t d = dst[i];
  if (d <= 0) return false;
  if (src == nullptr) return true;
  const int64_t s = src[i];
  return s >= 0 && s != d;
}

}  // namespace sgl_state_copy

namespace sgl_state_copy {
// Defined in state_copy_cuda.cu. src == nullptr clears the rows of dst; stream is a cudaStream_t.
// Returns a cudaError_t (0 on success).
int launch_state_copy_cuda(const StateTable& t, const int64_t* src, const int64_t* dst, const bool* mask,
                           int64_t rows, void* stream);
}  // namespace sgl_state_copy

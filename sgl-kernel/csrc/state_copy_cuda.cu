// CUDA state-copy kernel: see state_copy.h for the semantics. Plain CUDA (no torch headers), so CI
// compile-checks it with `nvcc -c -arch=sm_90` on machines whose torch has no CUDA; the torch binding
// is state_copy_cuda_binding.cpp.
//
// One launch covers every kept row, state tensor, layer: grid.x enumerates the tiles of one row (per
// tensor, per layer, kTileVecs vectors each), grid.y the rows. Each thread moves kUnroll vectors of the
// widest type that divides every base, stride and row length (16 bytes for the pools' layouts), loads
// first and stores after, so a thread keeps kUnroll loads in flight.
#include <cuda_runtime.h>

#include <cstdint>

#include "state_copy.h"

namespace sgl_state_copy {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 8;
constexpr int64_t kTileVecs = static_cast<int64_t>(kThreads) * kUnroll;
constexpr int64_t kMaxGridY = 65535;

struct Tiling {
  int64_t tiles_per_layer[kMaxTensors];
  int64_t tile_start[kMaxTensors + 1];
};

template <typename V>
__global__ void __launch_bounds__(kThreads)
    state_copy_kernel(StateTable t, Tiling tl, const int64_t* __restrict__ src, const int64_t* __restrict__ dst,
                      const bool* __restrict__ mask, int64_t rows) {
  const int64_t tile = blockIdx.x;
  int k = 0;
  while (tile >= tl.tile_start[k + 1]) ++k;
  const int64_t j = tile - tl.tile_start[k];
  const int64_t layer = j / tl.tiles_per_layer[k];
  const int64_t first = (j % tl.tiles_per_layer[k]) * kTileVecs;
  const int64_t row_vecs = t.row_bytes[k] / static_cast<int64_t>(sizeof(V));
  const int64_t n = row_vecs - first < kTileVecs ? row_vecs - first : kTileVecs;
  const int64_t layer_base = t.base[k] + layer * t.layer_stride[k];

  for (int64_t i = blockIdx.y; i < rows; i += gridDim.y) {
    if (!row_kept(src, dst, mask, i)) continue;
    const int64_t d = dst[i];
    if (d >= t.num_slots || (src != nullptr && src[i] >= t.num_slots)) continue;
    V* to = reinterpret_cast<V*>(layer_base + d * t.slot_stride[k]) + first;
    V buf[kUnroll];
    if (src != nullptr) {
      const V* from = reinterpret_cast<const V*>(layer_base + src[i] * t.slot_stride[k]) + first;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t idx = threadIdx.x + static_cast<int64_t>(u) * kThreads;
        if (idx < n) buf[u] = from[idx];
      }
    } else {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) buf[u] = V{};
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t idx = threadIdx.x + static_cast<int64_t>(u) * kThreads;
      if (idx < n) to[idx] = buf[u];
    }
  }
}

int64_t gcd64(int64_t a, int64_t b) {
  a = a < 0 ? -a : a;
  b = b < 0 ? -b : b;
  while (b != 0) {
    const int64_t r = a % b;
    a = b;
    b = r;
  }
  return a;
}

template <typename V>
cudaError_t launch(const StateTable& t, const int64_t* src, const int64_t* dst, const bool* mask, int64_t rows,
                   cudaStream_t stream) {
  Tiling tl{};
  tl.tile_start[0] = 0;
  for (int k = 0; k < t.num_tensors; ++k) {
    const int64_t vecs = t.row_bytes[k] / static_cast<int64_t>(sizeof(V));
    tl.tiles_per_layer[k] = (vecs + kTileVecs - 1) / kTileVecs;
    tl.tile_start[k + 1] = tl.tile_start[k] + t.num_layers[k] * tl.tiles_per_layer[k];
  }
  for (int k = t.num_tensors; k < kMaxTensors; ++k) tl.tile_start[k + 1] = tl.tile_start[k];
  const int64_t tiles = tl.tile_start[t.num_tensors];
  if (tiles == 0 || rows == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(rows < kMaxGridY ? rows : kMaxGridY));
  state_copy_kernel<V><<<grid, kThreads, 0, stream>>>(t, tl, src, dst, mask, rows);
  return cudaGetLastError();
}

}  // namespace

// src == nullptr: clear the rows of dst. Returns a cudaError_t.
int launch_state_copy_cuda(const StateTable& t, const int64_t* src, const int64_t* dst, const bool* mask,
                           int64_t rows, void* stream) {
  int64_t g = 16;
  for (int k = 0; k < t.num_tensors; ++k) {
    g = gcd64(g, t.base[k]);
    g = gcd64(g, t.layer_stride[k]);
    g = gcd64(g, t.slot_stride[k]);
    g = gcd64(g, t.row_bytes[k]);
  }
  const auto s = static_cast<cudaStream_t>(stream);
  switch (g) {
    case 16:
      return launch<uint4>(t, src, dst, mask, rows, s);
    case 8:
      return launch<uint2>(t, src, dst, mask, rows, s);
    case 4:
      return launch<uint32_t>(t, src, dst, mask, rows, s);
    case 2:
      return launch<uint16_t>(t, src, dst, mask, rows, s);
    default:
      return launch<uint8_t>(t, src, dst, mask, rows, s);
  }
}

}  // namespace sgl_state_copy

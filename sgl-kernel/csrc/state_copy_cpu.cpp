// CPU state-copy ops (OpenMP), a torch extension: see state_copy.h for the semantics.
//
// A launch is split into units of at most kChunkBytes (one unit never spans two rows), which the
// threads take in static contiguous ranges: the rows of an 80B-size slot (2 MB SSM, 48 KB conv per
// layer) then spread evenly over the threads. A launch of kStreamBytes or more writes with
// non-temporal (streaming) stores on x86-64: its destination would not stay in the caches anyway, and
// streaming skips reading each destination line before overwriting it (measured on the project's
// 2-core EPYC VM: ~25-29 GB/s read+write against ~17-22 GB/s for memcpy of the same 256 KB units,
// whose glibc threshold for streaming is far above them). Smaller launches use memcpy / memset,
// leaving the rows cached for the layer that reads them next.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define SGL_STATE_COPY_STREAM 1
#endif

#include <algorithm>
#include <cstring>
#include <vector>

#include "state_copy.h"
#include "state_copy_binding.h"

namespace sgl_state_copy {
namespace {

constexpr int64_t kChunkBytes = 256 << 10;
// Below this many bytes one thread does the work: waking a second one costs more than it saves.
constexpr int64_t kSerialBytes = 1 << 20;
constexpr int64_t kStreamBytes = 8 << 20;

// Copy (src != nullptr) or zero len bytes at dst, with streaming stores where the launch is large.
inline void move_bytes(char* dst, const char* src, int64_t len, bool stream) {
#ifdef SGL_STATE_COPY_STREAM
  if (stream) {
    const int64_t head = std::min<int64_t>(len, (16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16);
    if (head > 0) {
      if (src != nullptr) {
        std::memcpy(dst, src, head);
      } else {
        std::memset(dst, 0, head);
      }
    }
    int64_t i = head;
    if (src != nullptr) {
      for (; i + 64 <= len; i += 64) {
        const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
        const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
        const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
      }
      if (i < len) std::memcpy(dst + i, src + i, len - i);
    } else {
      const __m128i z = _mm_setzero_si128();
      for (; i + 64 <= len; i += 64) {
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), z);
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), z);
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), z);
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), z);
      }
      if (i < len) std::memset(dst + i, 0, len - i);
    }
    return;
  }
#endif
  if (src != nullptr) {
    std::memcpy(dst, src, len);
  } else {
    std::memset(dst, 0, len);
  }
}

void run(const StateTable& t, const int64_t* src, const int64_t* dst, const bool* mask, int64_t rows) {
  std::vector<int64_t> kept;
  kept.reserve(rows);
  for (int64_t i = 0; i < rows; ++i) {
    if (!row_kept(src, dst, mask, i)) continue;
    TORCH_CHECK(dst[i] < t.num_slots, "state copy: slot ", dst[i], " is past the pool (", t.num_slots, " slots)");
    TORCH_CHECK(src == nullptr || src[i] < t.num_slots, "state copy: slot ", src[i], " is past the pool (",
                t.num_slots, " slots)");
    kept.push_back(i);
  }
  if (kept.empty()) return;

  // Units in memory order: tensor, layer, row of the launch, chunk of the row. Consecutive slots of a
  // layer are adjacent, so runs of rows read and write sequential memory (what prefetchers follow).
  const int64_t n_kept = static_cast<int64_t>(kept.size());
  int64_t chunks[kMaxTensors];
  int64_t unit_start[kMaxTensors + 1];
  int64_t bytes = 0;
  unit_start[0] = 0;
  for (int k = 0; k < t.num_tensors; ++k) {
    chunks[k] = (t.row_bytes[k] + kChunkBytes - 1) / kChunkBytes;
    unit_start[k + 1] = unit_start[k] + t.num_layers[k] * n_kept * chunks[k];
    bytes += n_kept * t.num_layers[k] * t.row_bytes[k];
  }
  const int64_t total = unit_start[t.num_tensors];
  const int threads = bytes < kSerialBytes ? 1 : std::max(1, at::get_num_threads());
  const bool stream = bytes >= kStreamBytes;

#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#pragma omp for schedule(static) nowait
    for (int64_t u = 0; u < total; ++u) {
      int k = 0;
      while (u >= unit_start[k + 1]) ++k;
      const int64_t j = u - unit_start[k];
      const int64_t off = (j % chunks[k]) * kChunkBytes;
      const int64_t i = kept[(j / chunks[k]) % n_kept];
      const int64_t layer = j / chunks[k] / n_kept;
      const int64_t len = std::min(kChunkBytes, t.row_bytes[k] - off);
      const int64_t layer_base = t.base[k] + layer * t.layer_stride[k] + off;
      const char* from =
          src == nullptr ? nullptr : reinterpret_cast<const char*>(layer_base + src[i] * t.slot_stride[k]);
      move_bytes(reinterpret_cast<char*>(layer_base + dst[i] * t.slot_stride[k]), from, len, stream);
    }
#ifdef SGL_STATE_COPY_STREAM
    // Streaming stores are weakly ordered: each thread fences its own before the region's closing
    // barrier, so every later reader sees them.
    if (stream) _mm_sfence();
#endif
  }
}

void copy(const StateTable& t, const torch::Tensor& src, const torch::Tensor& dst,
          const c10::optional<torch::Tensor>& mask) {
  const torch::Device cpu(torch::kCPU);
  check_ids(src, "src", cpu);
  check_ids(dst, "dst", cpu);
  TORCH_CHECK(src.numel() == dst.numel(), "state copy: src and dst differ in length");
  const bool* m = check_mask(mask, dst.numel(), cpu);
  run(t, src.data_ptr<int64_t>(), dst.data_ptr<int64_t>(), m, dst.numel());
}

void clear(const StateTable& t, const torch::Tensor& slots) {
  check_ids(slots, "slots", torch::Device(torch::kCPU));
  run(t, nullptr, slots.data_ptr<int64_t>(), nullptr, slots.numel());
}

}  // namespace
}  // namespace sgl_state_copy

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  sgl_state_copy::define_module(m, &sgl_state_copy::copy, &sgl_state_copy::clear);
}

// Paged decode attention for CPU: one query token per sequence, read from the layer-packed,
// head-major KV cache in place (no gather, no padding). One task per sequence walks its blocks
// (prefetching the next block's K/V tiles of this layer into L2, since the walk is DRAM-bound)
// and runs an online softmax per query head; each K row is read once for its whole GQA group.
// Float accumulation.
// Registered as torch.ops.kvrelay.paged_decode (no pybind: light headers, faster build).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}

template <typename T>
void decode_kernel(const T* q, const T* kv, const int64_t* block_ids, const int64_t* block_starts,
                   const int64_t* ctx_lens, T* out, int64_t num_seqs, int64_t num_heads,
                   int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t layer,
                   int64_t num_layers, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t tile = block_size * head_dim;
  const int64_t kv_stride = num_kv_heads * tile;
  const int64_t block_stride = num_layers * 2 * kv_stride;
  const int64_t layer_offset = layer * 2 * kv_stride;
  const int64_t layer_bytes = 2 * kv_stride * static_cast<int64_t>(sizeof(T));
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(num_heads * head_dim), acc(num_heads * head_dim);
    std::vector<float> scores(group * block_size), running_max(num_heads), running_sum(num_heads);
    for (int64_t seq = begin; seq < end; ++seq) {
      const T* q_seq = q + seq * num_heads * head_dim;
      for (int64_t i = 0; i < num_heads * head_dim; ++i) qf[i] = to_float(q_seq[i]) * scale;
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(running_max.begin(), running_max.end(), -std::numeric_limits<float>::infinity());
      std::fill(running_sum.begin(), running_sum.end(), 0.0f);
      const int64_t ctx_len = ctx_lens[seq];
      const int64_t first_block = block_starts[seq], last_block = block_starts[seq + 1];
      for (int64_t b = first_block; b < last_block; ++b) {
        const T* block = kv + block_ids[b] * block_stride + layer_offset;
        if (b + 1 < last_block) {
          const char* next =
              reinterpret_cast<const char*>(kv + block_ids[b + 1] * block_stride + layer_offset);
          for (int64_t off = 0; off < layer_bytes; off += 64) {
            __builtin_prefetch(next + off, 0, 2);  // read, keep in L2
          }
        }
        const int64_t valid = std::min(block_size, ctx_len - (b - first_block) * block_size);
        for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
          const T* k_tile = block + kv_head * tile;
          const T* v_tile = k_tile + kv_stride;
          const float* q_group = qf.data() + kv_head * group * head_dim;
          for (int64_t t = 0; t < valid; ++t) {
            const T* k_row = k_tile + t * head_dim;
            for (int64_t g = 0; g < group; ++g) {
              const float* qg = q_group + g * head_dim;
              float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
              for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * to_float(k_row[d]);
              scores[g * block_size + t] = dot;
            }
          }
          for (int64_t g = 0; g < group; ++g) {
            const int64_t head = kv_head * group + g;
            const float* sg = scores.data() + g * block_size;
            float block_max = -std::numeric_limits<float>::infinity();
            for (int64_t t = 0; t < valid; ++t) block_max = std::max(block_max, sg[t]);
            const float new_max = std::max(running_max[head], block_max);
            const float correction = std::exp(running_max[head] - new_max);
            float* acc_h = acc.data() + head * head_dim;
            float sum = running_sum[head] * correction;
            for (int64_t d = 0; d < head_dim; ++d) acc_h[d] *= correction;
            for (int64_t t = 0; t < valid; ++t) {
              const float p = std::exp(sg[t] - new_max);
              sum += p;
              const T* v_row = v_tile + t * head_dim;
#pragma omp simd
              for (int64_t d = 0; d < head_dim; ++d) acc_h[d] += p * to_float(v_row[d]);
            }
            running_max[head] = new_max;
            running_sum[head] = sum;
          }
        }
      }
      T* out_seq = out + seq * num_heads * head_dim;
      for (int64_t h = 0; h < num_heads; ++h) {
        const float inv = 1.0f / running_sum[h];
        for (int64_t d = 0; d < head_dim; ++d) {
          out_seq[h * head_dim + d] = static_cast<T>(acc[h * head_dim + d] * inv);
        }
      }
    }
  });
}

}  // namespace

// q: [B, H, D]; kv_cache: [num_blocks, L, 2, Hkv, block_size, D] (contiguous);
// block_ids: [NB] int64, each sequence's blocks in order; block_starts: [B + 1] int64 offsets
// into block_ids; ctx_lens: [B] int64 (>= 1). Returns [B, H, D] in q's dtype.
at::Tensor paged_decode(at::Tensor q, at::Tensor kv_cache, at::Tensor block_ids,
                           at::Tensor block_starts, at::Tensor ctx_lens, int64_t layer,
                           double scale) {
  TORCH_CHECK(q.device().is_cpu() && kv_cache.device().is_cpu(), "paged_decode is CPU only");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [B, H, D] tensor");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous [N, L, 2, Hkv, block_size, D] tensor");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(), "q and kv_cache dtypes differ");
  TORCH_CHECK(block_ids.scalar_type() == at::kLong && block_starts.scalar_type() == at::kLong &&
                  ctx_lens.scalar_type() == at::kLong,
              "block tables must be int64");
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_layers = kv_cache.size(1), num_kv_heads = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(5) == head_dim && num_heads % num_kv_heads == 0, "shape mismatch");
  TORCH_CHECK(block_starts.numel() == num_seqs + 1 && ctx_lens.numel() == num_seqs,
              "block table size mismatch");
  TORCH_CHECK(layer >= 0 && layer < num_layers, "layer out of range");
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), kv_cache.data_ptr<scalar_t>(),
                            block_ids.data_ptr<int64_t>(), block_starts.data_ptr<int64_t>(),
                            ctx_lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), num_seqs,
                            num_heads, num_kv_heads, head_dim, kv_cache.size(4), layer, num_layers,
                            static_cast<float>(scale));
  });
  return out;
}

TORCH_LIBRARY(kvrelay, m) {
  m.def("paged_decode(Tensor q, Tensor kv_cache, Tensor block_ids, Tensor block_starts, "
        "Tensor ctx_lens, int layer, float scale) -> Tensor");
  m.impl("paged_decode", c10::DispatchKey::CPU, TORCH_FN(paged_decode));
}

// Native CPU re-rotation of a layer's attention sinks into its store (hf_kvcache/kernels/cpu_rope.py calls it; built
// into the same extension as cpu_decode.cpp).
//
// A sink cache re-rotates its sinks at every decode step, in every layer, to sit just before the oldest other kept
// token (StreamingLLM's positions inside the cache; hf_kvcache.policies.sinks.SinkMemory._rotate_into). In torch
// that is a dozen eager ops on a few hundred numbers, ~10 us each inside a decode step. This is the same arithmetic
// in one call:
//   delta = (oldest[b, hm] + shift[b, i]) * has_other[b, hm]        (int64; sink i of row b, meta head hm)
//   a     = float(delta) * inv_freq[j]                              (float32, as torch's int64 x float32 product)
//   (x1, x2) = the arrived key's rotary pair j ("half": j, j + r/2; "interleaved": 2j, 2j + 1), in float32
//   target pair = (x1 cos a - x2 sin a, x2 cos a + x1 sin a), rounded once to the store's dtype
// Dims past the rotary ones are left as they are. cos / sin are the C library's float32 ones (torch's vectorised
// ones may differ from them in the last bit: results agree to float32 rounding, not bit for bit).

#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

template <typename T>
void rotate_pairs(const at::Tensor& keys, at::Tensor& target, const at::Tensor& oldest, const at::Tensor& shift,
                  const c10::optional<at::Tensor>& has_other, const at::Tensor& inv_freq, bool interleaved) {
  const int64_t B = target.size(0), H = target.size(1), S = target.size(2), half = inv_freq.size(0);
  const int64_t Hm = oldest.size(1);
  const T* src = keys.data_ptr<T>();
  T* dst = target.data_ptr<T>();
  const int64_t* old = oldest.data_ptr<int64_t>();
  const int64_t* sh = shift.data_ptr<int64_t>();
  const bool* other = has_other ? has_other->data_ptr<bool>() : nullptr;
  const float* f = inv_freq.data_ptr<float>();
  const int64_t step = interleaved ? 2 : 1, gap = interleaved ? 1 : half;  // pair j: (j * step, j * step + gap)
  std::vector<float> cs(2 * half);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t hm = 0; hm < Hm; ++hm) {
      const bool moved = other == nullptr || other[b * has_other->stride(0) + hm * has_other->stride(1)];
      const int64_t o = old[b * oldest.stride(0) + hm * oldest.stride(1)];
      for (int64_t i = 0; i < S; ++i) {
        const int64_t delta = moved ? o + sh[b * shift.stride(0) + i * shift.stride(2)] : 0;
        for (int64_t j = 0; j < half; ++j) {
          const float a = static_cast<float>(delta) * f[j];
          cs[2 * j] = std::cos(a);
          cs[2 * j + 1] = std::sin(a);
        }
        // the angles of (b, hm, i) serve every KV head of that meta head (all of them when Hm is 1)
        const int64_t h0 = Hm == 1 ? 0 : hm, h1 = Hm == 1 ? H : hm + 1;
        for (int64_t h = h0; h < h1; ++h) {
          const T* x = src + b * keys.stride(0) + h * keys.stride(1) + i * keys.stride(2);
          T* y = dst + b * target.stride(0) + h * target.stride(1) + i * target.stride(2);
          for (int64_t j = 0; j < half; ++j) {
            const int64_t p = j * step, q = p + gap;
            const float x1 = static_cast<float>(x[p]), x2 = static_cast<float>(x[q]);
            const float c = cs[2 * j], s = cs[2 * j + 1];
            y[p] = static_cast<T>(x1 * c - x2 * s);
            y[q] = static_cast<T>(x2 * c + x1 * s);
          }
        }
      }
    }
}

}  // namespace

// keys: the sinks as they arrived [B, H, >= S, D]; target: the store's sink slots [B, H, S, D] (any strides, the
// last dim contiguous; the same dtype: float32, bfloat16 or float16); oldest [B, Hm] and shift [B, 1, S] int64;
// has_other [B, Hm] bool or None; inv_freq [r / 2] float32 (r: the rotary dims, r <= D).
void rotate_sinks(torch::Tensor keys, torch::Tensor target, torch::Tensor oldest, torch::Tensor shift,
                  c10::optional<torch::Tensor> has_other, torch::Tensor inv_freq, bool interleaved) {
  TORCH_CHECK(target.dim() == 4 && keys.dim() == 4 && keys.scalar_type() == target.scalar_type(),
              "hf_kvcache rotate_sinks: keys and target must be 4-d tensors of one dtype");
  TORCH_CHECK(keys.size(0) == target.size(0) && keys.size(1) == target.size(1) && keys.size(2) >= target.size(2) &&
                  keys.size(3) == target.size(3) && keys.stride(3) == 1 && target.stride(3) == 1,
              "hf_kvcache rotate_sinks: keys [B, H, >= S, D] and target [B, H, S, D] with contiguous last dims");
  TORCH_CHECK(oldest.scalar_type() == at::kLong && oldest.dim() == 2 && oldest.size(0) == target.size(0) &&
                  (oldest.size(1) == 1 || oldest.size(1) == target.size(1)),
              "hf_kvcache rotate_sinks: oldest must be int64 [B, 1 or H]");
  TORCH_CHECK(shift.scalar_type() == at::kLong && shift.dim() == 3 && shift.size(0) == target.size(0) &&
                  shift.size(2) == target.size(2),
              "hf_kvcache rotate_sinks: shift must be int64 [B, 1, S]");
  TORCH_CHECK(!has_other || (has_other->scalar_type() == at::kBool && has_other->sizes() == oldest.sizes()),
              "hf_kvcache rotate_sinks: has_other must be bool, shaped like oldest");
  TORCH_CHECK(inv_freq.scalar_type() == at::kFloat && inv_freq.dim() == 1 && inv_freq.is_contiguous() &&
                  2 * inv_freq.size(0) <= target.size(3),
              "hf_kvcache rotate_sinks: inv_freq must be contiguous float32 [r / 2], r <= D");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, target.scalar_type(), "rotate_sinks", [&] {
    rotate_pairs<scalar_t>(keys, target, oldest, shift, has_other, inv_freq, interleaved);
  });
}

// Native CPU write of a decode step's new tokens into an FP8 store with one scale per token and channel group
// (hf_kvcache/kernels/cpu_encode.py calls it; built into the same extension as cpu_decode.cpp).
//
// The torch path (hf_kvcache.stores.fp8.FP8Codec.encode, then `put`) is a dozen eager ops for a few hundred numbers:
// in a decode step that is ~100 us per layer of dispatch for ~1 us of arithmetic. This does the same arithmetic,
// in the same order and the same float32 / storage-dtype roundings, bit for bit:
//   amax  = max |x| over the group                                  (linalg.vector_norm(x, inf))
//   scale = float32 storage: amax / fmax; else round(amax * ((1 + eps) / fmax)) to the storage dtype (rounded up:
//           the group's largest element stays within fmax), then clamped to [tiny, max] of the storage dtype
//   code  = fp8(clamp(x / scale, -fmax, fmax)), round to nearest even (c10's conversion, which torch's uses)
// Nothing is written unless every input is finite: the caller then raises its own error (counting the culprits).

#include <torch/extension.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <limits>

namespace {

constexpr int64_t FMT_E4M3 = 1;

template <typename S>
inline float stored_scale(float amax, float fmax, float up, S* out) {
  if constexpr (std::is_same_v<S, float>) {
    float s = amax / fmax;
    s = std::min(std::max(s, std::numeric_limits<float>::min()), std::numeric_limits<float>::max());
    *out = s;
    return s;
  } else {
    S s = S(amax * up);  // round to nearest even, as tensor.to(dtype)
    const float lo = static_cast<float>(std::numeric_limits<S>::min());
    const float hi = static_cast<float>(std::numeric_limits<S>::max());
    const float f = static_cast<float>(s);
    if (f < lo) s = std::numeric_limits<S>::min();
    else if (f > hi) s = std::numeric_limits<S>::max();
    *out = s;
    return static_cast<float>(s);
  }
}

inline uint8_t to_fp8(float q, int64_t fmt) {
  return fmt == FMT_E4M3 ? c10::Float8_e4m3fn(q).x : c10::Float8_e5m2(q).x;
}

template <typename X, typename S>
void encode_rows(const torch::Tensor& x, int64_t row0, torch::Tensor& data, torch::Tensor& scale, int64_t slot,
                 int64_t fmt, int64_t group, float fmax, float up) {
  const int64_t B = x.size(0), H = x.size(1), n = x.size(2), D = x.size(3), G = D / group;
  const X* xp = x.data_ptr<X>();
  uint8_t* dp = data.data_ptr<uint8_t>();
  S* sp = scale.data_ptr<S>();
  const int64_t cap = data.size(2);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < n; ++t) {
        const X* row = xp + ((b * H + h) * n + t) * D;
        const int64_t at = ((row0 + b) * H + h) * cap + slot + t;
        for (int64_t g = 0; g < G; ++g) {
          float amax = 0.0f;
          for (int64_t d = g * group; d < (g + 1) * group; ++d)
            amax = std::max(amax, std::abs(static_cast<float>(row[d])));
          const float s = stored_scale<S>(amax, fmax, up, sp + at * G + g);
          for (int64_t d = g * group; d < (g + 1) * group; ++d) {
            const float q = static_cast<float>(row[d]) / s;
            dp[at * D + d] = to_fp8(std::min(std::max(q, -fmax), fmax), fmt);
          }
        }
      }
}

bool all_finite(const torch::Tensor& x) {
  bool ok = true;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "all_finite", [&] {
    const scalar_t* p = x.data_ptr<scalar_t>();
    for (int64_t i = 0, e = x.numel(); i < e; ++i) ok &= std::isfinite(static_cast<float>(p[i]));
  });
  return ok;
}

}  // namespace

// Whether every element of keys (and values) is finite: the stores' check before quantizing, in one call for the
// few hundred numbers of a decode step (torch's isfinite / all / and / assert are five dispatches).
bool tensors_finite(torch::Tensor keys, c10::optional<torch::Tensor> values) {
  return all_finite(keys.contiguous()) && (!values || all_finite(values->contiguous()));
}

// keys (and values) [B, H, n, D] written at slots [slot, slot + n) of rows [0, B) (values: rows [B, 2B)) of
// `data` [R, H, capacity, D] uint8 and `scale` [R, H, capacity, D / group] (float32, bfloat16 or float16).
// `up`: (1 + eps of the scale dtype) / fmax, computed by the caller as torch's scalar multiply sees it.
// Returns false, having written nothing, when an input is not finite.
bool fp8_write_tokens(torch::Tensor keys, c10::optional<torch::Tensor> values, torch::Tensor data,
                      torch::Tensor scale, int64_t slot, int64_t fmt, int64_t group, double fmax, double up) {
  TORCH_CHECK(keys.dim() == 4 && keys.is_contiguous() && data.is_contiguous() && scale.is_contiguous(),
              "fp8_write_tokens: contiguous 4-D tensors expected");
  TORCH_CHECK(data.scalar_type() == at::kByte && keys.size(3) % group == 0 && data.dim() == 4 && scale.dim() == 4 &&
                  data.size(1) == keys.size(1) && data.size(3) == keys.size(3) && scale.size(0) == data.size(0) &&
                  scale.size(1) == data.size(1) && scale.size(2) == data.size(2) &&
                  scale.size(3) == keys.size(3) / group,
              "fp8_write_tokens: data must be uint8 [R, H, capacity, D] and scale [R, H, capacity, D / group]");
  const int64_t rows = keys.size(0) * (values ? 2 : 1);
  TORCH_CHECK(data.size(0) >= rows && slot >= 0 && slot + keys.size(2) <= data.size(2),
              "fp8_write_tokens: the tokens do not fit the slot buffers");
  TORCH_CHECK(!values || (values->sizes() == keys.sizes() && values->scalar_type() == keys.scalar_type() &&
                          values->is_contiguous()), "fp8_write_tokens: values must be like keys");
  if (!tensors_finite(keys, values)) return false;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, keys.scalar_type(), "fp8_write_tokens", [&] {
    using X = scalar_t;
    auto run = [&](auto s_tag) {
      using S = decltype(s_tag);
      encode_rows<X, S>(keys, 0, data, scale, slot, fmt, group, float(fmax), float(up));
      if (values) encode_rows<X, S>(*values, keys.size(0), data, scale, slot, fmt, group, float(fmax), float(up));
    };
    switch (scale.scalar_type()) {
      case at::kFloat: run(float{}); break;
      case at::kBFloat16: run(c10::BFloat16{}); break;
      case at::kHalf: run(c10::Half{}); break;
      default: TORCH_CHECK(false, "fp8_write_tokens: scales must be float32, bfloat16 or float16");
    }
  });
  return true;
}

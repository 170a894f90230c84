// Native CPU kernel for `blockwise_attention` (hf_kvcache/kernels/cpu_blockwise.py builds and calls it).
//
// A unit is a (batch row, KV head, tile of at most TILE query rows of that head: row r is query head h * groups + r / q,
// query r % q). With few units and many columns (batch-1 decode: 3 units for SmolLM2) each unit's columns are split
// into ranges (flash-decoding), so every thread works: a range walks its key columns once (16 tokens at a time in
// registers for FP8 per-token codes, KIVI's INT4 blocks and full-precision values in float32, bfloat16 or float16,
// else TOK tokens' codes at a time decoded into float rows
// that stay in L1) taking their dot products with every query row of the tile; keeps
// its largest logit m, the sum l of exp(logit - m) and the value rows accumulated with those weights; a merge per
// unit rescales the ranges by exp(m_i - max m) (softmax stays exact). Range sizes follow from the shapes alone, never
// from the thread count, so results do not depend on it. Column scores are the probabilities summed over the queries
// of each query head (weighted). No full-precision copy of a segment is ever made: the work per column is one pass
// over its codes for keys and one for values.
//
// Decoding follows `hf_kvcache.kernels.codes` (see QuantizedKV): FP8 bits go through float32 bit patterns times a
// power of two (E4M3: (byte & 0x7F) << 20, x 2^120; E5M2: << 21, x 2^112; subnormals included), integers are
// unpacked from their byte and shift; the scale (and zero point) of a token and channel is read at
// (token / s_tok, channel / s_ch) with zero strides for broadcast dimensions. Arithmetic is float32 throughout, in
// 16-float vectors (GCC / Clang vector extensions, lowered to the machine's registers by -march=native); sums across
// a vector are trees, never chains of dependent adds.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t TILE = 64;       // query rows whose logits are held at once
constexpr int64_t META = 9;        // ints per segment, in this order:
enum { M_LEN, M_FMT, M_PER_BYTE, M_HQQ, M_PACK, M_PACK_BLOCK, M_S_TOK, M_S_CH, M_ZERO_CODE };
// FMT_NONE: float32 values; FMT_BF16 / FMT_F16: bfloat16 / float16 values, widened to float32 as they are read
enum { FMT_NONE = 0, FMT_E4M3 = 1, FMT_E5M2 = 2, FMT_INT = 3, FMT_BF16 = 4, FMT_F16 = 5 };
enum { PACK_NONE = 0, PACK_CHANNEL = 1, PACK_TOKEN = 2 };

// A float tensor [B or 1, H or 1, rows, C] (scales, zero points, bias), with zero strides along its size-1
// dimensions so that broadcast ones read the same element. Scales and zero points are read as they are stored, in
// float32, bfloat16 or float16 (`half`: FMT_BF16 / FMT_F16; through `at` and `load16`, widened exactly): converting a
// bfloat16 model's scales to float32 at every call cost more than reading them (KIVI at 8K: 7.6-8.2 ms for SmolLM2's 30
// layers against 6.8 ms for float32 scales, which are twice the bytes). Bias is float32.
struct Strided {
  const float* p = nullptr;
  const uint16_t* q = nullptr;  // another dtype's elements: read only as bfloat16 / float16 (`half` set)
  int64_t b = 0, h = 0, n = 0, d = 0, half = 0;
  explicit operator bool() const { return p != nullptr || q != nullptr; }
  int64_t offset(int64_t bi, int64_t hi, int64_t ni) const { return bi * b + hi * h + ni * n; }
  const float* row(int64_t bi, int64_t hi, int64_t ni) const { return p + offset(bi, hi, ni); }  // float32 only
  // element k (counted in elements, strides applied by the caller) of row (bi, hi, ni), in either precision
  float at(int64_t bi, int64_t hi, int64_t ni, int64_t k = 0) const;
};

Strided strided(const at::Tensor* t) {
  if (!t) return {};
  auto stride = [&](int64_t dim) { return t->size(dim) == 1 ? 0 : t->stride(dim); };
  Strided out{nullptr, nullptr, stride(0), stride(1), stride(2), stride(3), 0};
  if (t->scalar_type() == at::kFloat) out.p = t->data_ptr<float>();
  else out.q = static_cast<const uint16_t*>(t->const_data_ptr());
  return out;
}

struct Segment {
  int64_t len = 0, fmt = 0, per_byte = 1, hqq = 0, pack = 0, pack_block = 1, s_tok = 1, s_ch = 1, zero_code = 0;
  int64_t dim = 0;                                  // channels after unpacking
  const uint8_t* codes = nullptr;                   // full precision: the values; contiguous along the channels
  int64_t c_b = 0, c_h = 0, c_n = 0;
  Strided scale, zero, bias;
  bool row_scale = false;                           // one scale (and zero) covers a token's whole row
};

bool fp8_fast(const Segment& s);  // (below: the register route)

// The segments of one call. Scales and zero points in bfloat16 / float16 are read as they are (Strided); a bias in
// another precision than float32, and any other dtype, is converted here into `keep`.
std::vector<Segment> segments(const std::vector<std::optional<at::Tensor>>& tensors, const std::vector<int64_t>& meta,
                              int64_t dim, std::vector<at::Tensor>& keep) {
  const int64_t count = static_cast<int64_t>(meta.size()) / META;
  TORCH_CHECK(static_cast<int64_t>(tensors.size()) == 4 * count, "hf_kvcache cpu_decode: 4 tensors per segment");
  std::vector<Segment> out(count);
  for (int64_t i = 0; i < count; ++i) {
    Segment& s = out[i];
    const int64_t* m = meta.data() + i * META;
    s.len = m[M_LEN]; s.fmt = m[M_FMT]; s.per_byte = m[M_PER_BYTE]; s.hqq = m[M_HQQ]; s.pack = m[M_PACK];
    s.pack_block = m[M_PACK_BLOCK]; s.s_tok = m[M_S_TOK]; s.s_ch = m[M_S_CH]; s.zero_code = m[M_ZERO_CODE];
    s.dim = dim;
    const at::Tensor& c = *tensors[4 * i];
    TORCH_CHECK(c.dim() == 4 && c.stride(3) == 1, "hf_kvcache cpu_decode: codes must be 4-D, contiguous along the "
                "channels");
    const at::ScalarType dtype = s.fmt == FMT_NONE ? at::kFloat : s.fmt == FMT_BF16 ? at::kBFloat16
                                 : s.fmt == FMT_F16 ? at::kHalf : at::kByte;
    TORCH_CHECK(c.scalar_type() == dtype, "hf_kvcache cpu_decode: segment ", i, " of format ", s.fmt, " takes ",
                dtype, " codes, got ", c.scalar_type());
    s.codes = static_cast<const uint8_t*>(c.const_data_ptr());
    s.c_b = c.stride(0); s.c_h = c.stride(1); s.c_n = c.stride(2);
    // the tokens read must lie in the buffers (a caller may pass whole buffers and a shorter length)
    const int64_t held = c.size(2) * (s.per_byte > 1 && s.pack == PACK_TOKEN ? s.per_byte : 1);
    TORCH_CHECK(s.len >= 0 && s.len <= held, "hf_kvcache cpu_decode: segment ", i, " reads ", s.len,
                " tokens, its codes hold ", held);
    for (int64_t j = 1; j < 3; ++j) {
      const auto& t = tensors[4 * i + j];
      TORCH_CHECK(!t || t->size(2) == 1 || (s.len + s.s_tok - 1) / s.s_tok <= t->size(2), "hf_kvcache cpu_decode: ",
                  "segment ", i, " reads ", s.len, " tokens, its scales or zero points cover ", t->size(2) * s.s_tok);
    }
    Strided* fields[3] = {&s.scale, &s.zero, &s.bias};
    for (int64_t j = 1; j < 4; ++j)
      if (tensors[4 * i + j]) *fields[j - 1] = strided(&*tensors[4 * i + j]);
    s.row_scale = !s.scale || s.scale.d == 0 || s.s_ch >= dim;
    for (int64_t j = 1; j < 4; ++j) {
      const auto& t = tensors[4 * i + j];
      if (!t || t->scalar_type() == at::kFloat) continue;
      const at::ScalarType type = t->scalar_type();
      if (j < 3 && (type == at::kBFloat16 || type == at::kHalf)) {  // scales and zero points: read as they are
        fields[j - 1]->half = type == at::kBFloat16 ? FMT_BF16 : FMT_F16;
      } else {
        keep.push_back(t->to(at::kFloat));
        *fields[j - 1] = strided(&keep.back());
      }
    }
  }
  return out;
}

inline float bits_to_float(uint32_t bits) { return __builtin_bit_cast(float, bits); }

// A bfloat16 (its bits are float32's top half) or float16 (c10's conversion) value as float32, exactly
inline float half_to_float(uint16_t bits, int64_t fmt) {
  if (fmt == FMT_BF16) return bits_to_float(static_cast<uint32_t>(bits) << 16);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

inline float Strided::at(int64_t bi, int64_t hi, int64_t ni, int64_t k) const {
  const int64_t i = offset(bi, hi, ni) + k;
  return half ? half_to_float(q[i], half) : p[i];
}

// The power of two FP8's bit route leaves the value off by (exponent bias 127 of float32 vs 7 / 15).
inline float fp8_factor(int64_t fmt) { return fmt == FMT_E4M3 ? 0x1p120f : 0x1p112f; }

// FP8 codes p[0, D) as float32 bit patterns times k (fold fp8_factor and a row's scale into k).
inline void fp8_row(const uint8_t* __restrict p, int64_t D, int64_t fmt, float k, float* __restrict x) {
  const int shift = fmt == FMT_E4M3 ? 20 : 21;
  for (int64_t d = 0; d < D; ++d) {
    const uint32_t c = p[d];
    x[d] = bits_to_float(((c & 0x80u) << 24) | ((c & 0x7Fu) << shift)) * k;
  }
}

// The codes of token t of (b, h) as floats before scaling (FP8: the bit route, off by a power of two, returned;
// integers: the unpacked values).
float decode_codes(const Segment& s, int64_t b, int64_t h, int64_t t, float* __restrict x) {
  const int64_t D = s.dim;
  const uint8_t* base = s.codes + b * s.c_b + h * s.c_h;
  if (s.fmt == FMT_E4M3 || s.fmt == FMT_E5M2) {
    fp8_row(base + t * s.c_n, D, s.fmt, 1.0f, x);
    return fp8_factor(s.fmt);
  }
  const int bits = 8 / static_cast<int>(s.per_byte);
  const uint32_t mask = (1u << bits) - 1u;
  auto shift_of = [&](int64_t slot) { return static_cast<int>(s.hqq ? 8 - bits * (slot + 1) : bits * slot); };
  if (s.per_byte == 1 || s.pack == PACK_NONE) {
    const uint8_t* p = base + t * s.c_n;
    for (int64_t d = 0; d < D; ++d) x[d] = static_cast<float>(p[d]);
  } else if (s.pack == PACK_CHANNEL) {  // byte j holds channels j + i * D / per_byte
    const uint8_t* p = base + t * s.c_n;
    const int64_t dp = D / s.per_byte;
    for (int64_t i = 0; i < s.per_byte; ++i) {
      const int sh = shift_of(i);
      float* xi = x + i * dp;
      for (int64_t j = 0; j < dp; ++j) xi[j] = static_cast<float>((static_cast<uint32_t>(p[j]) >> sh) & mask);
    }
  } else {  // token packing: within a block of pack_block tokens, byte row r holds tokens r + i * R
    const int64_t r_per = s.pack_block / s.per_byte;
    const int64_t row = (t / s.pack_block) * r_per + t % r_per;
    const int sh = shift_of((t % s.pack_block) / r_per);
    const uint8_t* p = base + row * s.c_n;
    for (int64_t d = 0; d < D; ++d) x[d] = static_cast<float>((static_cast<uint32_t>(p[d]) >> sh) & mask);
  }
  return 1.0f;
}

// x = x * scale (+ zero, or (x - zero) * scale) with token t's scales and zero points; `work`: D floats of scratch.
void scale_row(const Segment& s, int64_t b, int64_t h, int64_t t, float factor, float* __restrict x,
               float* __restrict work) {
  const int64_t D = s.dim, n = t / s.s_tok;
  const bool zp = static_cast<bool>(s.zero);
  auto scale = [&](int64_t k) { return s.scale.at(b, h, n, k * s.scale.d); };  // scale k of the row (group or channel)
  auto zero = [&](int64_t k) { return s.zero.at(b, h, n, k * s.zero.d); };
  if (s.row_scale) {
    const float k = scale(0) * factor;
    if (!zp) {
      for (int64_t d = 0; d < D; ++d) x[d] *= k;
    } else if (s.zero_code) {
      const float z = zero(0);
      for (int64_t d = 0; d < D; ++d) x[d] = (x[d] - z) * k;
    } else {
      const float z = zero(0);
      for (int64_t d = 0; d < D; ++d) x[d] = x[d] * k + z;
    }
    return;
  }
  if (s.s_ch == 1) {  // one scale per channel (KIVI keys): a row of scales, contiguous in the usual layout
    for (int64_t d = 0; d < D; ++d) work[d] = scale(d) * factor;
    if (!zp) {
      for (int64_t d = 0; d < D; ++d) x[d] *= work[d];
    } else if (s.zero_code) {
      for (int64_t d = 0; d < D; ++d) x[d] = (x[d] - zero(d)) * work[d];
    } else {
      for (int64_t d = 0; d < D; ++d) x[d] = x[d] * work[d] + zero(d);
    }
    return;
  }
  for (int64_t g = 0; g * s.s_ch < D; ++g) {  // groups of s_ch channels, one scale (and zero) each
    float* xg = x + g * s.s_ch;
    const int64_t w = std::min(s.s_ch, D - g * s.s_ch);
    const float k = scale(g) * factor;
    if (!zp) {
      for (int64_t d = 0; d < w; ++d) xg[d] *= k;
    } else if (s.zero_code) {
      const float z = zero(g);
      for (int64_t d = 0; d < w; ++d) xg[d] = (xg[d] - z) * k;
    } else {
      const float z = zero(g);
      for (int64_t d = 0; d < w; ++d) xg[d] = xg[d] * k + z;
    }
  }
}

// Token t of (b, h) of segment s as float32 x[0, dim). `work`: dim floats of scratch.
void load_row(const Segment& s, int64_t b, int64_t h, int64_t t, float* __restrict x, float* __restrict work) {
  const int64_t D = s.dim;
  if (s.fmt == FMT_NONE) {
    const float* p = reinterpret_cast<const float*>(s.codes) + b * s.c_b + h * s.c_h + t * s.c_n;
    for (int64_t d = 0; d < D; ++d) x[d] = p[d];
  } else if (s.fmt == FMT_BF16 || s.fmt == FMT_F16) {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(s.codes) + b * s.c_b + h * s.c_h + t * s.c_n;
    for (int64_t d = 0; d < D; ++d) x[d] = half_to_float(p[d], s.fmt);
  } else if ((s.fmt == FMT_E4M3 || s.fmt == FMT_E5M2) && !s.zero && s.row_scale) {
    // the common case (FP8, one scale per token) in one pass: scaled while the row is in registers (a second pass
    // reloading the row just stored costs as much as the decoding)
    const float k = s.scale.at(b, h, t / s.s_tok) * fp8_factor(s.fmt);
    fp8_row(s.codes + b * s.c_b + h * s.c_h + t * s.c_n, D, s.fmt, k, x);
  } else {
    scale_row(s, b, h, t, decode_codes(s, b, h, t, x), x, work);
  }
  if (s.bias) {
    const float* bp = s.bias.row(b, h, 0);
    for (int64_t d = 0; d < D; ++d) x[d] += bp[d * s.bias.d];
  }
}

// 16 floats. With AVX-512 (or no AVX2) a GCC / Clang vector of 16 lanes, one AVX-512 register; with AVX2 and no
// AVX-512, two 8-lane vectors in a struct: a 64-byte vector type there has no machine mode of its own, so GCC keeps
// such values in memory and moves them 8 bytes at a time through general registers (measured 7x slower), while a
// struct of two native vectors is split into registers once inlined.
#if defined(__AVX2__) && !defined(__AVX512F__)
#define HF_KVCACHE_V16_PAIR 1
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
struct v16 {
  v8 lo, hi;
};
inline v16 operator+(v16 a, v16 b) { return {a.lo + b.lo, a.hi + b.hi}; }
inline v16 operator-(v16 a, v16 b) { return {a.lo - b.lo, a.hi - b.hi}; }
inline v16 operator*(v16 a, v16 b) { return {a.lo * b.lo, a.hi * b.hi}; }
inline v16 operator+(v16 a, float b) { return {a.lo + b, a.hi + b}; }
inline v16 operator-(v16 a, float b) { return {a.lo - b, a.hi - b}; }
inline v16 operator*(v16 a, float b) { return {a.lo * b, a.hi * b}; }
inline v16& operator+=(v16& a, v16 b) {
  a.lo += b.lo;
  a.hi += b.hi;
  return a;
}
inline v16 load16(const float* p) {
  v8 lo, hi;
  std::memcpy(&lo, p, sizeof lo);
  std::memcpy(&hi, p + 8, sizeof hi);
  return {lo, hi};
}
inline void store16(float* p, v16 v) {
  std::memcpy(p, &v.lo, sizeof v.lo);
  std::memcpy(p + 8, &v.hi, sizeof v.hi);
}
inline v16 splat(float x) {
  const v8 h = {x, x, x, x, x, x, x, x};
  return {h, h};
}
inline v8 vmax8(v8 a, v8 b) { return a > b ? a : b; }
inline v16 vmax(v16 a, v16 b) { return {vmax8(a.lo, b.lo), vmax8(a.hi, b.hi)}; }
inline v8 ones8(v8 a) { return a != 0.0f ? v8{} + 1.0f : v8{}; }
inline v16 ones_where_nonzero(v16 a) { return {ones8(a.lo), ones8(a.hi)}; }
inline float hsum(v16 v) {
  const v8 s = v.lo + v.hi;
  return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
}
// the 32 floats of a, b as 16 pairs -> the pairs' first elements, in order (even), and their second ones (odd)
inline void deinterleave(v16 a, v16 b, v16& even, v16& odd) {
  even = {__builtin_shufflevector(a.lo, a.hi, 0, 2, 4, 6, 8, 10, 12, 14),
          __builtin_shufflevector(b.lo, b.hi, 0, 2, 4, 6, 8, 10, 12, 14)};
  odd = {__builtin_shufflevector(a.lo, a.hi, 1, 3, 5, 7, 9, 11, 13, 15),
         __builtin_shufflevector(b.lo, b.hi, 1, 3, 5, 7, 9, 11, 13, 15)};
}
#else
typedef float v16 __attribute__((vector_size(64)));

inline v16 load16(const float* p) { v16 v; std::memcpy(&v, p, sizeof v); return v; }
inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }
// a broadcast (v16{} + x would be an add of 0.0f first: not foldable, since -0.0f + 0.0f is +0.0f)
inline v16 splat(float x) { return v16{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
inline v16 vmax(v16 a, v16 b) { return a > b ? a : b; }
inline v16 ones_where_nonzero(v16 a) { return a != 0.0f ? splat(1.0f) : splat(0.0f); }  // 1 where a != 0, else 0
inline float hsum(v16 v) {  // a tree, not a chain of 16 dependent adds
  float a[16];
  std::memcpy(a, &v, sizeof a);
  for (int j = 0; j < 8; ++j) a[j] += a[j + 8];
  for (int j = 0; j < 4; ++j) a[j] += a[j + 4];
  return (a[0] + a[2]) + (a[1] + a[3]);
}
// the 32 floats of a, b as 16 pairs -> the pairs' first elements, in order (even), and their second ones (odd)
inline void deinterleave(v16 a, v16 b, v16& even, v16& odd) {
  even = __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  odd = __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#endif

constexpr int TOK = 4;  // tokens decoded, then multiplied together (their rows stay in registers / L1)

// How many v16 values the vector registers hold (AVX-512: 32 registers; AVX2: 16 of half the width; SSE: 16 of a
// quarter): the register routes keep more in registers where it fits, never so much that the compiler spills.
#if defined(__AVX512F__)
constexpr int V16_REGS = 32;
#elif defined(HF_KVCACHE_V16_PAIR)
constexpr int V16_REGS = 8;
#else
constexpr int V16_REGS = 4;
#endif

// Software prefetch of the code rows PREFETCH tokens ahead of the register routes (the next 16-token group but one;
// INT4 blocks: the next block). The hardware prefetcher alone left the FP8 kernel waiting on memory: 30 layers of
// SmolLM2's shape at 8K, 2 threads, interleaved: 16 tokens ahead 0.965x, 32 0.93x, 48 0.94x, 64 0.98x; KIVI 0.97x.
// A prefetch never faults, so reading ahead past a segment's end is harmless.
constexpr int PREFETCH = 32;
inline void prefetch_row(const uint8_t* row, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(row + o);
}

// out[r * TOK + t] = q_r . X_t for R query rows q [R][D] and TOK decoded tokens X [TOK][D]
template <int R>
void logits_block(const float* __restrict q, const float* __restrict X, int64_t D, float* __restrict out) {
  v16 acc[R][TOK] = {};
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    v16 x[TOK];
    for (int t = 0; t < TOK; ++t) x[t] = load16(X + t * D + d);
    for (int r = 0; r < R; ++r) {
      const v16 qv = load16(q + r * D + d);
      for (int t = 0; t < TOK; ++t) acc[r][t] += qv * x[t];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TOK; ++t) {
      float s = hsum(acc[r][t]);
      for (int64_t e = d; e < D; ++e) s += q[r * D + e] * X[t * D + e];
      out[r * TOK + t] = s;
    }
}

// acc[r] += sum_t P[r * TOK + t] * X_t for R accumulators acc [R][D] and TOK decoded tokens X [TOK][D]
template <int R>
void accumulate_block(const float* __restrict P, const float* __restrict X, int64_t D, float* __restrict acc) {
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    v16 x[TOK];
    for (int t = 0; t < TOK; ++t) x[t] = load16(X + t * D + d);
    for (int r = 0; r < R; ++r) {
      v16 a = load16(acc + r * D + d);
      for (int t = 0; t < TOK; ++t) a += splat(P[r * TOK + t]) * x[t];
      store16(acc + r * D + d, a);
    }
  }
  for (; d < D; ++d)
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < TOK; ++t) acc[r * D + d] += P[r * TOK + t] * X[t * D + d];
}

constexpr int RG = 4;  // query rows per register group

// Calls fn(std::integral_constant<int, R>{}, first row) for the groups of at most RG of `rows` query rows, so the
// two kernels above run with R known at compile time (their accumulators stay in registers).
template <int MAXR = RG, typename Fn>
void for_row_groups(int64_t rows, Fn&& fn) {
  for (int64_t r = 0; r < rows; r += MAXR) {
    switch (std::min<int64_t>(MAXR, rows - r)) {
      case 1: fn(std::integral_constant<int, 1>{}, r); break;
      case 2: fn(std::integral_constant<int, 2>{}, r); break;
      case 3: fn(std::integral_constant<int, 3>{}, r); break;
      default: fn(std::integral_constant<int, 4>{}, r); break;
    }
  }
}

void logits_rows(const float* q, const float* X, int64_t D, int64_t rows, float* out) {
  for_row_groups(rows, [&](auto R, int64_t r) { logits_block<decltype(R)::value>(q + r * D, X, D, out + r * TOK); });
}

void accumulate_rows(const float* P, const float* X, int64_t D, int64_t rows, float* acc) {
  for_row_groups(rows, [&](auto R, int64_t r) {
    accumulate_block<decltype(R)::value>(P + r * TOK, X, D, acc + r * D);
  });
}

// -- FP8 with one scale per token, decoded in registers ---------------------------------------------------------------
// The common FP8 layout (E4M3 / E5M2, a scale per token and head, no zero point or bias, head_dim a multiple of 16)
// never writes a decoded row: 16 codes become 16 floats in a register (zero-extended, sign and exponent-mantissa bits
// moved into float32 position) and go straight into the dot products; a token's scale (times the power of two the
// bit route leaves) multiplies its logit once, and multiplies its probability once on the value side, instead of
// every element.
// 16 codes -> 16 floats in one register: AVX-512 (one sign extension), AVX2 (two), else a portable loop. The sign
// extension puts the code's sign bit in bit 31 (and, shifted, in the bits above the exponent-mantissa field, which the
// mask clears), so the bit route is three operations: extend, shift, and.
template <int SHIFT>
inline v16 fp8x16(const uint8_t* p) {
  constexpr uint32_t MASK = 0x80000000u | (0x7Fu << SHIFT);
#if defined(__AVX512F__)
  const __m512i c = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i bits = _mm512_and_si512(_mm512_slli_epi32(c, SHIFT), _mm512_set1_epi32(static_cast<int>(MASK)));
  return reinterpret_cast<v16>(_mm512_castsi512_ps(bits));
#elif defined(HF_KVCACHE_V16_PAIR)
  const __m256i m = _mm256_set1_epi32(static_cast<int>(MASK));
  const __m256i c0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i c1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
  return {reinterpret_cast<v8>(_mm256_and_si256(_mm256_slli_epi32(c0, SHIFT), m)),
          reinterpret_cast<v8>(_mm256_and_si256(_mm256_slli_epi32(c1, SHIFT), m))};
#else
  float x[16];
  for (int d = 0; d < 16; ++d) {
    const uint32_t c = p[d];
    x[d] = bits_to_float(((c & 0x80u) << 24) | ((c & 0x7Fu) << SHIFT));
  }
  return load16(x);
#endif
}

// 16 bfloat16 (BF16 true) or float16 values -> 16 floats, exactly: bfloat16 is float32's top half (zero-extend,
// shift); float16 through the F16C conversion where the CPU has it
template <bool BF16>
inline v16 half16(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if constexpr (BF16) {
    return reinterpret_cast<v16>(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
  } else {
    return reinterpret_cast<v16>(_mm512_cvtph_ps(h));
  }
#elif defined(HF_KVCACHE_V16_PAIR) && defined(__F16C__)
  const __m128i h0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i h1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16));
  if constexpr (BF16)
    return {reinterpret_cast<v8>(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h0), 16)),
            reinterpret_cast<v8>(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h1), 16))};
  else return {reinterpret_cast<v8>(_mm256_cvtph_ps(h0)), reinterpret_cast<v8>(_mm256_cvtph_ps(h1))};
#else
  float x[16];
  uint16_t bits[16];
  std::memcpy(bits, p, sizeof bits);
  for (int d = 0; d < 16; ++d) x[d] = half_to_float(bits[d], BF16 ? FMT_BF16 : FMT_F16);
  return load16(x);
#endif
}

// Elements [i, i + 16) of a contiguous run of scales or zero points (offsets from Strided::offset), widened
inline v16 load16(const Strided& s, int64_t i) {
  if (!s.half) return load16(s.p + i);
  const uint8_t* p = reinterpret_cast<const uint8_t*>(s.q + i);
  return s.half == FMT_BF16 ? half16<true>(p) : half16<false>(p);
}

// The register routes' code kinds (the template argument ROUTE below): FP8 through the bit route (its shift, 20: E4M3,
// 21: E5M2), or full-precision values taken as they are with a scale of 1 (float32, bfloat16, float16)
enum { ROUTE_F32 = 0, ROUTE_BF16 = 1, ROUTE_F16 = 2, ROUTE_E4M3 = 20, ROUTE_E5M2 = 21 };

// Bytes per code of a route
template <int ROUTE>
constexpr int64_t code_size() { return ROUTE == ROUTE_F32 ? 4 : ROUTE == ROUTE_BF16 || ROUTE == ROUTE_F16 ? 2 : 1; }

// Channels [d, d + 16) of a code row starting at byte `row`
template <int ROUTE>
inline v16 codes16(const uint8_t* row, int64_t d) {
  if constexpr (ROUTE == ROUTE_F32) return load16(reinterpret_cast<const float*>(row) + d);
  else if constexpr (ROUTE == ROUTE_BF16 || ROUTE == ROUTE_F16) return half16<ROUTE == ROUTE_BF16>(row + 2 * d);
  else return fp8x16<ROUTE>(row + d);
}

inline bool full_precision(const Segment& s) {
  return s.fmt == FMT_NONE || s.fmt == FMT_BF16 || s.fmt == FMT_F16;
}

// The register route: FP8 with one scale per token (and head or channel group covering the row), or full-precision
// values
bool fp8_fast(const Segment& s) {
  if (full_precision(s)) return !s.bias && s.dim % 16 == 0;
  return (s.fmt == FMT_E4M3 || s.fmt == FMT_E5M2) && s.row_scale && !s.zero && !s.bias && s.dim % 16 == 0 &&
         s.s_tok == 1;
}

// Bytes per code of a register-route segment, and the byte address of token t's row of (b, h)
inline int64_t code_bytes(const Segment& s) { return s.fmt == FMT_NONE ? 4 : full_precision(s) ? 2 : 1; }
inline const uint8_t* code_row(const Segment& s, int64_t b, int64_t h, int64_t t) {
  return s.codes + (b * s.c_b + h * s.c_h + t * s.c_n) * code_bytes(s);
}

// Calls fn(std::integral_constant<int, ROUTE>{}) for a register-route segment's format
template <typename Fn>
inline void with_route(const Segment& s, Fn fn) {
  if (s.fmt == FMT_E4M3) fn(std::integral_constant<int, ROUTE_E4M3>{});
  else if (s.fmt == FMT_E5M2) fn(std::integral_constant<int, ROUTE_E5M2>{});
  else if (s.fmt == FMT_BF16) fn(std::integral_constant<int, ROUTE_BF16>{});
  else if (s.fmt == FMT_F16) fn(std::integral_constant<int, ROUTE_F16>{});
  else fn(std::integral_constant<int, ROUTE_F32>{});
}

// out[r * TOK + t] = k[t] * (q_r . codes_t) for TOK tokens whose code rows start at p + t * stride
template <int R, int ROUTE>
void fp8_logits_block(const float* __restrict q, const uint8_t* __restrict p, int64_t stride, const float* k,
                      int64_t D, float* __restrict out) {
  v16 acc[R][TOK] = {};
  for (int64_t d = 0; d < D; d += 16) {
    v16 x[TOK];
    for (int t = 0; t < TOK; ++t) x[t] = codes16<ROUTE>(p + t * stride, d);
    for (int r = 0; r < R; ++r) {
      const v16 qv = load16(q + r * D + d);
      for (int t = 0; t < TOK; ++t) acc[r][t] += qv * x[t];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TOK; ++t) out[r * TOK + t] = hsum(acc[r][t]) * k[t];
}

// acc[r] += sum over T tokens t of W[r * T + t] * codes_t (W: probabilities already times the tokens' scales; acc rows
// D apart). DC = 0: a channel block's accumulators stay in registers across the T tokens. DC = 64: channels
// [0, 64) only, all their accumulators (R x 4 registers) in registers with the tokens outside, so each token's weights
// are broadcast once instead of once per channel block (measured 0.86-0.92x for FP8 with the query rows of
// fp8_logits16 kept in registers too); the same sums in the same order, bit for bit.
template <int T, int R, int ROUTE, int DC = 0>
void fp8_accumulate(const float* __restrict W, const uint8_t* __restrict p, int64_t stride, int64_t D,
                    float* __restrict acc) {
  if constexpr (DC != 0) {
    static_assert(DC % 16 == 0 && R * (DC / 16) + DC / 16 + 1 <= V16_REGS, "the accumulators must fit the registers");
    constexpr int NB = DC / 16;
    v16 a[R][NB];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NB; ++j) a[r][j] = load16(acc + r * D + 16 * j);
    for (int t = 0; t < T; ++t) {
      prefetch_row(p + (PREFETCH + t) * stride, DC * code_size<ROUTE>());
      v16 x[NB];
      for (int j = 0; j < NB; ++j) x[j] = codes16<ROUTE>(p + t * stride, 16 * j);
      for (int r = 0; r < R; ++r) {
        const v16 wv = splat(W[r * T + t]);
        for (int j = 0; j < NB; ++j) a[r][j] += wv * x[j];
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NB; ++j) store16(acc + r * D + 16 * j, a[r][j]);
    return;
  }
  for (int64_t d = 0; d < D; d += 16) {
    v16 a[R];
    for (int r = 0; r < R; ++r) a[r] = load16(acc + r * D + d);
    for (int t = 0; t < T; ++t) {
      if (d == 0) prefetch_row(p + (PREFETCH + t) * stride, D * code_size<ROUTE>());
      const v16 x = codes16<ROUTE>(p + t * stride, d);
      for (int r = 0; r < R; ++r) a[r] += splat(W[r * T + t]) * x;
    }
    for (int r = 0; r < R; ++r) store16(acc + r * D + d, a[r]);
  }
}

// -- 16 tokens at a time --------------------------------------------------------------------------------------------
// Logits: a token's dot product with a query row leaves 16 partial sums in a register; instead of summing each
// register across its lanes (a dozen operations per logit), a tree of shuffles and adds turns 16 such registers into
// one register holding the 16 tokens' logits (15 adds for 16 logits). Levels 1-2 stay within 128-bit lanes (4 tokens
// per register, one partial per lane), levels 3-4 cross them; the logits come out in token order.
#if defined(HF_KVCACHE_V16_PAIR)  // the same shuffles per 256-bit half (tree1, tree2); tree34 joins the halves
inline v16 tree1(v16 x, v16 y) {
  return {__builtin_shufflevector(x.lo, y.lo, 0, 8, 1, 9, 4, 12, 5, 13) +
              __builtin_shufflevector(x.lo, y.lo, 2, 10, 3, 11, 6, 14, 7, 15),
          __builtin_shufflevector(x.hi, y.hi, 0, 8, 1, 9, 4, 12, 5, 13) +
              __builtin_shufflevector(x.hi, y.hi, 2, 10, 3, 11, 6, 14, 7, 15)};
}
inline v16 tree2(v16 s, v16 u) {
  return {__builtin_shufflevector(s.lo, u.lo, 0, 1, 8, 9, 4, 5, 12, 13) +
              __builtin_shufflevector(s.lo, u.lo, 2, 3, 10, 11, 6, 7, 14, 15),
          __builtin_shufflevector(s.hi, u.hi, 0, 1, 8, 9, 4, 5, 12, 13) +
              __builtin_shufflevector(s.hi, u.hi, 2, 3, 10, 11, 6, 7, 14, 15)};
}
inline v16 tree34(v16 a, v16 b) {
  return {__builtin_shufflevector(a.lo, a.hi, 0, 1, 2, 3, 8, 9, 10, 11) +
              __builtin_shufflevector(a.lo, a.hi, 4, 5, 6, 7, 12, 13, 14, 15),
          __builtin_shufflevector(b.lo, b.hi, 0, 1, 2, 3, 8, 9, 10, 11) +
              __builtin_shufflevector(b.lo, b.hi, 4, 5, 6, 7, 12, 13, 14, 15)};
}
#else
inline v16 tree1(v16 x, v16 y) {  // per 128-bit lane L: (x, y, x, y) partials of elements (4L, 4L+2), (4L+1, 4L+3)
  return __builtin_shufflevector(x, y, 0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29) +
         __builtin_shufflevector(x, y, 2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31);
}
inline v16 tree2(v16 s, v16 u) {  // (tokens of s, tokens of u): per 128-bit lane, one sum per token
  return __builtin_shufflevector(s, u, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
         __builtin_shufflevector(s, u, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
}
inline v16 tree34(v16 a, v16 b) {  // 128-bit lanes (a0 + a1, a2 + a3, b0 + b1, b2 + b3)
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
         __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
}
#endif
// 4 registers of 4 tokens each (tree2's output) -> the 16 tokens' sums, in order
inline v16 tree_finish(const v16* v) { return tree34(tree34(v[0], v[1]), tree34(v[2], v[3])); }

// out[r * ld + t] = k[t] * (q_r . codes_t) for 16 tokens whose code rows start at p + t * stride. DC: D known at
// compile time (64 or 128; 0: not), so that the channel loop unrolls and, where they fit next to the accumulators,
// the query rows stay in registers instead of being loaded again for every 4 tokens (8K tokens, 2 threads: D 64 with
// 3 or 4 query rows per KV head 0.91x / 0.92x, D 128 with 1 row 0.95x, with 4 rows 0.99x).
template <int R, int ROUTE, int DC = 0>
void fp8_logits16(const float* __restrict q, const uint8_t* __restrict p, int64_t stride, v16 k, int64_t Drt,
                  float* __restrict out, int64_t ld) {
  const int64_t D = DC ? DC : Drt;
  constexpr bool HOIST = DC != 0 && R * (DC / 16) + R * 4 + 4 <= V16_REGS - 4;  // (query, sums, codes; spare 4)
  v16 qh[HOIST ? R : 1][HOIST ? DC / 16 : 1];
  if constexpr (HOIST)
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < DC / 16; ++j) qh[r][j] = load16(q + r * D + 16 * j);
  v16 part[R][4];
  for (int g = 0; g < 4; ++g) {
    v16 acc[R][4] = {};
    const uint8_t* pg = p + 4 * g * stride;
    for (int t = 0; t < 4; ++t) prefetch_row(pg + (PREFETCH + t) * stride, D * code_size<ROUTE>());
    for (int64_t d = 0; d < D; d += 16) {
      v16 x[4];
      for (int t = 0; t < 4; ++t) x[t] = codes16<ROUTE>(pg + t * stride, d);
      for (int r = 0; r < R; ++r) {
        v16 qv;
        if constexpr (HOIST) qv = qh[r][d / 16];
        else qv = load16(q + r * D + d);
        for (int t = 0; t < 4; ++t) acc[r][t] += qv * x[t];
      }
    }
    for (int r = 0; r < R; ++r) part[r][g] = tree2(tree1(acc[r][0], acc[r][1]), tree1(acc[r][2], acc[r][3]));
  }
  for (int r = 0; r < R; ++r) store16(out + r * ld, tree_finish(part[r]) * k);
}

// The scales of 16 tokens of a fast FP8 segment from token t, times the bit route's power of two and `extra`
inline v16 fp8_scales16(const Segment& s, int64_t b, int64_t h, int64_t t, float extra) {
  if (full_precision(s)) return splat(extra);
  const float f = fp8_factor(s.fmt) * extra;
  if (s.scale.n == 1) return load16(s.scale, s.scale.offset(b, h, t)) * f;  // 16 contiguous scales
  float k[16];
  for (int i = 0; i < 16; ++i) k[i] = s.scale.at(b, h, t + i) * f;
  return load16(k);
}

void fp8_logits16_rows(const Segment& s, const float* q, const uint8_t* p, v16 k, int64_t rows, float* out,
                       int64_t ld) {
  for_row_groups(rows, [&](auto R, int64_t r) {
    constexpr int RR = decltype(R)::value;
    with_route(s, [&](auto S) {
      constexpr int SS = decltype(S)::value;
      const float* qr = q + r * s.dim;
      const int64_t stride = s.c_n * code_bytes(s);
      if (s.dim == 64) fp8_logits16<RR, SS, 64>(qr, p, stride, k, s.dim, out + r * ld, ld);
      else if (s.dim == 128) fp8_logits16<RR, SS, 128>(qr, p, stride, k, s.dim, out + r * ld, ld);
      else fp8_logits16<RR, SS>(qr, p, stride, k, s.dim, out + r * ld, ld);
    });
  });
}

// TOK tokens of a fast FP8 segment from token t: their code rows and scales (times the bit route's power of two)
inline const uint8_t* fp8_rows(const Segment& s, int64_t b, int64_t h, int64_t t, float* k) {
  if (full_precision(s)) {
    for (int i = 0; i < TOK; ++i) k[i] = 1.0f;
  } else {
    const float f = fp8_factor(s.fmt);
    for (int i = 0; i < TOK; ++i) k[i] = s.scale.at(b, h, t + i) * f;
  }
  return code_row(s, b, h, t);
}

void fp8_logits_rows(const Segment& s, const float* q, const uint8_t* p, const float* k, int64_t rows, float* out) {
  for_row_groups(rows, [&](auto R, int64_t r) {
    constexpr int RR = decltype(R)::value;
    with_route(s, [&](auto S) {
      fp8_logits_block<RR, decltype(S)::value>(q + r * s.dim, p, s.c_n * code_bytes(s), k, s.dim, out + r * TOK);
    });
  });
}

// fp8_accumulate over T tokens for every query row (W [rows][T])
template <int T>
void fp8_accumulate_rows(const Segment& s, const float* W, const uint8_t* p, int64_t rows, float* acc) {
  for_row_groups(rows, [&](auto R, int64_t r) {
    constexpr int RR = decltype(R)::value;
    with_route(s, [&](auto S) {
      constexpr int SS = decltype(S)::value;
      const int64_t stride = s.c_n * code_bytes(s);
      if constexpr (RR * 4 + 4 + 1 <= V16_REGS) {
        if (s.dim % 64 == 0) {  // 64 channels at a time
          for (int64_t c = 0; c < s.dim; c += 64)
            fp8_accumulate<T, RR, SS, 64>(W + r * T, p + c * code_bytes(s), stride, s.dim, acc + r * s.dim + c);
          return;
        }
      }
      fp8_accumulate<T, RR, SS>(W + r * T, p, stride, s.dim, acc + r * s.dim);
    });
  });
}

// -- INT4 token pairs (KIVI): scales folded into the query (keys) and the probabilities (values) -------------------
// An append-only integer store packs each block of `pack_block` tokens in byte rows: row j holds token j in its low
// nibble and token j + pack_block / 2 in its high one (optimum-quanto's order). One byte row gives two tokens' codes,
// 16 channels to a register. Keys (one scale and zero per channel for a whole block, KIVI): q . (c s + z) is
// (q s) . c + q . z, so the query is scaled once per block and the codes enter the dot products as they are. Values
// (one scale and zero per token and group of channels): p (c s + z) adds (p s) c + p z, per group.

inline void int4x16(const uint8_t* p, v16& lo, v16& hi) {
#if defined(__AVX512F__)
  const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = reinterpret_cast<v16>(_mm512_cvtepi32_ps(_mm512_and_si512(c, _mm512_set1_epi32(0xF))));
  hi = reinterpret_cast<v16>(_mm512_cvtepi32_ps(_mm512_srli_epi32(c, 4)));
#elif defined(HF_KVCACHE_V16_PAIR)
  const __m256i c0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i c1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
  const __m256i low = _mm256_set1_epi32(0xF);
  lo = {reinterpret_cast<v8>(_mm256_cvtepi32_ps(_mm256_and_si256(c0, low))),
        reinterpret_cast<v8>(_mm256_cvtepi32_ps(_mm256_and_si256(c1, low)))};
  hi = {reinterpret_cast<v8>(_mm256_cvtepi32_ps(_mm256_srli_epi32(c0, 4))),
        reinterpret_cast<v8>(_mm256_cvtepi32_ps(_mm256_srli_epi32(c1, 4)))};
#else
  float l[16], h[16];
  for (int d = 0; d < 16; ++d) {
    l[d] = static_cast<float>(p[d] & 0xFu);
    h[d] = static_cast<float>(p[d] >> 4);
  }
  lo = load16(l);
  hi = load16(h);
#endif
}

bool int4_pairs(const Segment& s) {
  return s.fmt == FMT_INT && s.per_byte == 2 && s.pack == PACK_TOKEN && !s.hqq && s.zero && !s.zero_code &&
         !s.bias && s.dim % 16 == 0 && s.pack_block % 2 == 0;
}

bool int4_keys_fast(const Segment& s) {  // a scale and zero per channel, one per block (or per several blocks)
  return int4_pairs(s) && s.s_ch == 1 && s.s_tok % s.pack_block == 0 && s.scale.d == 1 && s.zero.d == 1;
}

bool int4_values_fast(const Segment& s) {  // a scale and zero per token and group of 16k channels
  return int4_pairs(s) && s.s_tok == 1 && s.s_ch % 16 == 0;
}

// out[r * 4 + i]: q'_r . codes of the tokens (j, j + 1, j + half, j + 1 + half) of byte rows p0 (token j) and p1
template <int R>
void int4_logits_block(const float* __restrict qs, const uint8_t* __restrict p0, const uint8_t* __restrict p1,
                       int64_t D, float* __restrict out) {
  v16 acc[R][4] = {};
  for (int64_t d = 0; d < D; d += 16) {
    v16 x[4];
    int4x16(p0 + d, x[0], x[2]);
    int4x16(p1 + d, x[1], x[3]);
    for (int r = 0; r < R; ++r) {
      const v16 qv = load16(qs + r * D + d);
      for (int i = 0; i < 4; ++i) acc[r][i] += qv * x[i];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 4; ++i) out[r * 4 + i] = hsum(acc[r][i]);
}

// 16 byte rows from p: out_lo[r * ld + j] = q'_r . low-nibble codes of row j + bias[r], out_hi the high nibbles
// (tokens j and j + half of a block); the logits of 16 tokens come out of the reduction tree in one register
template <int R>
void int4_logits16(const float* __restrict qs, const uint8_t* __restrict p, int64_t stride, int64_t D,
                   const float* bias, float* __restrict out_lo, float* __restrict out_hi, int64_t ld) {
  v16 part_lo[R][4], part_hi[R][4];
  for (int g = 0; g < 4; ++g) {
    v16 lo[R][4] = {}, hi[R][4] = {};
    const uint8_t* pg = p + 4 * g * stride;
    for (int64_t d = 0; d < D; d += 16) {
      for (int t = 0; t < 4; ++t) {
        v16 xl, xh;
        int4x16(pg + t * stride + d, xl, xh);
        for (int r = 0; r < R; ++r) {
          const v16 qv = load16(qs + r * D + d);
          lo[r][t] += qv * xl;
          hi[r][t] += qv * xh;
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      part_lo[r][g] = tree2(tree1(lo[r][0], lo[r][1]), tree1(lo[r][2], lo[r][3]));
      part_hi[r][g] = tree2(tree1(hi[r][0], hi[r][1]), tree1(hi[r][2], hi[r][3]));
    }
  }
  for (int r = 0; r < R; ++r) {
    store16(out_lo + r * ld, tree_finish(part_lo[r]) + splat(bias[r]));
    store16(out_hi + r * ld, tree_finish(part_hi[r]) + splat(bias[r]));
  }
}

// A whole block of keys from token t (a multiple of pack_block): logits[r * ld + i] for its pack_block tokens
void int4_key_block(const Segment& s, int64_t b, int64_t h, int64_t t, const float* q, int64_t nr, float* qs,
                    float* bias, float* block, float* logits, int64_t ld) {
  const int64_t D = s.dim, half = s.pack_block / 2;
  const int64_t sc = s.scale.offset(b, h, t / s.s_tok), zp = s.zero.offset(b, h, t / s.s_tok);
  for (int64_t r = 0; r < nr; ++r) {  // D is a multiple of 16 (int4_pairs)
    v16 z = {};
    for (int64_t d = 0; d < D; d += 16) {
      const v16 qv = load16(q + r * D + d);
      store16(qs + r * D + d, qv * load16(s.scale, sc + d));
      z += qv * load16(s.zero, zp + d);
    }
    bias[r] = hsum(z);
  }
  const uint8_t* base = s.codes + b * s.c_b + h * s.c_h + (t / s.pack_block) * half * s.c_n;
  for (int64_t j = 0; j < half; ++j) prefetch_row(base + (half + j) * s.c_n, D);  // the next block
  if (half % 16 == 0) {  // 16 byte rows (32 tokens) at a time; at most 3 query rows keep 24 sums in registers
    for (int64_t j = 0; j < half; j += 16)
      for_row_groups<3>(nr, [&](auto R, int64_t r) {
        int4_logits16<decltype(R)::value>(qs + r * D, base + j * s.c_n, s.c_n, D, bias + r, logits + r * ld + j,
                                          logits + r * ld + j + half, ld);
      });
    return;
  }
  for (int64_t j = 0; j < half; j += 2) {
    const uint8_t* p0 = base + j * s.c_n;
    const uint8_t* p1 = j + 1 < half ? p0 + s.c_n : p0;  // an odd half: the last pair reads its row twice
    for_row_groups(nr, [&](auto R, int64_t r) {
      int4_logits_block<decltype(R)::value>(qs + r * D, p0, p1, D, block + r * 4);
    });
    const int64_t tokens[4] = {j, j + 1, j + half, j + 1 + half};
    for (int64_t r = 0; r < nr; ++r)
      for (int i = 0; i < 4; ++i)
        if (i % 2 == 0 || j + 1 < half) logits[r * ld + tokens[i]] = block[r * 4 + i] + bias[r];
  }
}

// acc[r] (one block of 16 channels, group g) += sum over the byte rows j of W[r][j] lo_j + W[r][j + half] hi_j
// + U[r]; the accumulators stay in registers across the block's rows, two per query row (low and high tokens)
template <int R>
void int4_accumulate_rows(const float* __restrict W, int64_t ldw, const float* U, const uint8_t* __restrict p,
                          int64_t stride, int64_t half, float* __restrict acc, int64_t D) {
  v16 a[R], e[R] = {};
  for (int r = 0; r < R; ++r) a[r] = load16(acc + r * D) + splat(U[r]);
  for (int64_t j = 0; j < half; ++j) {
    v16 lo, hi;
    int4x16(p + j * stride, lo, hi);
    for (int r = 0; r < R; ++r) {
      a[r] += splat(W[r * ldw + j]) * lo;
      e[r] += splat(W[r * ldw + j + half]) * hi;
    }
  }
  for (int r = 0; r < R; ++r) store16(acc + r * D, a[r] + e[r]);
}

// A whole block of values from token t: acc[r] += sum over its tokens of P[r][token] (c s + z). With a half block of
// 16k byte rows, the weights P s of every (row, group, token) and the zero terms sum P z of every (row, group) are
// made first (`work`: nr x groups x (pack_block + 1) floats), then each block of 16 channels is one register pass.
void int4_value_block(const Segment& s, int64_t b, int64_t h, int64_t t, const float* P, int64_t ld, int64_t nr,
                      float* acc, std::vector<float>& work) {
  const int64_t D = s.dim, half = s.pack_block / 2, G = s.s_ch;
  const uint8_t* base = s.codes + b * s.c_b + h * s.c_h + (t / s.pack_block) * half * s.c_n;
  for (int64_t j = 0; j < half; ++j) prefetch_row(base + (half + j) * s.c_n, D);  // the next block
  if (half % 16 == 0) {
    // per (row, group): n weights, then U; after them the block's scales and zeros by (group, token)
    const int64_t groups = D / G, n = s.pack_block, ldw = n + 1, rows_end = nr * groups * ldw;
    work.resize(std::max<size_t>(work.size(), rows_end + 2 * groups * n));
    v16 any = {};
    for (int64_t r = 0; r < nr; ++r)
      for (int64_t j = 0; j < n; j += 16) any = any + ones_where_nonzero(load16(P + r * ld + j));
    if (hsum(any) == 0.0f) return;  // every weight of the block is zero (masked or evicted columns)
    float *S = &work[rows_end], *Z = S + groups * n;
    if (groups == 2 && s.scale.n == 2 && s.scale.d == 1 && s.zero.n == 2 && s.zero.d == 1) {
      // two groups a token (KIVI's 32 of 64 channels), token-major: a vector transpose, not 4n scalar moves
      const int64_t sp = s.scale.offset(b, h, t), zp = s.zero.offset(b, h, t);
      for (int64_t j = 0; j < n; j += 16) {
        v16 even, odd;
        deinterleave(load16(s.scale, sp + 2 * j), load16(s.scale, sp + 2 * j + 16), even, odd);
        store16(S + j, even);
        store16(S + n + j, odd);
        deinterleave(load16(s.zero, zp + 2 * j), load16(s.zero, zp + 2 * j + 16), even, odd);
        store16(Z + j, even);
        store16(Z + n + j, odd);
      }
    } else {
      for (int64_t j = 0; j < n; ++j)
        for (int64_t g = 0; g < groups; ++g) {
          S[g * n + j] = s.scale.at(b, h, t + j, g * s.scale.d);
          Z[g * n + j] = s.zero.at(b, h, t + j, g * s.zero.d);
        }
    }
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t r = 0; r < nr; ++r) {  // n is a multiple of 32
        float* w = &work[(r * groups + g) * ldw];
        v16 u = {};
        for (int64_t j = 0; j < n; j += 16) {
          const v16 pj = load16(P + r * ld + j);
          store16(w + j, pj * load16(S + g * n + j));
          u += pj * load16(Z + g * n + j);
        }
        w[n] = hsum(u);
      }
    for (int64_t d = 0; d < D; d += 16) {
      const int64_t g = d / G;
      for_row_groups(nr, [&](auto R, int64_t r) {
        constexpr int RR = decltype(R)::value;
        float U[RR];
        for (int i = 0; i < RR; ++i) U[i] = work[((r + i) * groups + g) * ldw + n];
        int4_accumulate_rows<RR>(&work[(r * groups + g) * ldw], groups * ldw, U, base + d, s.c_n, half,
                                 acc + r * D + d, D);
      });
    }
    return;
  }
  for (int64_t j = 0; j < half; ++j) {
    const uint8_t* p = base + j * s.c_n;
    // token j (low nibbles) and j + half (high nibbles): group g's scale and zero point
    auto sl = [&](int64_t g) { return s.scale.at(b, h, t + j, g * s.scale.d); };
    auto zl = [&](int64_t g) { return s.zero.at(b, h, t + j, g * s.zero.d); };
    auto sh = [&](int64_t g) { return s.scale.at(b, h, t + j + half, g * s.scale.d); };
    auto zh = [&](int64_t g) { return s.zero.at(b, h, t + j + half, g * s.zero.d); };
    for (int64_t r = 0; r < nr; ++r) {
      const float pl = P[r * ld + j], ph = P[r * ld + j + half];
      if (pl == 0.0f && ph == 0.0f) continue;
      float* a = acc + r * D;
      for (int64_t d = 0; d < D; d += 16) {
        const int64_t g = d / G;
        v16 lo, hi;
        int4x16(p + d, lo, hi);
        const float wl = pl * sl(g), wh = ph * sh(g);
        const float u = pl * zl(g) + ph * zh(g);
        store16(a + d, load16(a + d) + splat(wl) * lo + splat(wh) * hi + splat(u));
      }
    }
  }
}

// Cephes' expf core, for one float or 16 lanes: e^r for r = x - k ln2 (k = x / ln2 rounded, |r| <= ln2 / 2, ln2 in
// two parts), by its degree-7 polynomial
template <typename T>
inline T exp_core(T clamped, T k) {
  T r = clamped - k * 0.693359375f;
  r = r - k * -2.12194440e-4f;
  T p = T{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

// exp(x) for x <= 0 (or -inf -> 0), Cephes' expf: x = k ln2 + r, |r| <= ln2 / 2, 2^k from the exponent bits;
// within 2 ulp of std::exp and vectorisable (std::exp is not without -ffast-math).
inline float exp_nonpositive(float x) {
  const float clamped = x < -87.0f ? -87.0f : x;
  const float k = std::nearbyint(clamped * 1.44269504088896341f);
  const float p = exp_core(clamped, k);
  const float two_k = bits_to_float(static_cast<uint32_t>(static_cast<int32_t>(k) + 127) << 23);
  return x < -87.0f ? 0.0f : p * two_k;
}

// exp_nonpositive on 16 lanes (the same steps: round to nearest by the 1.5 x 2^23 trick, the same polynomial)
#if defined(HF_KVCACHE_V16_PAIR)
inline v8 exp8_nonpositive(v8 x) {
  const v8 low = v8{} - 87.0f;
  const v8 clamped = x < low ? low : x;
  const v8 magic = v8{} + 12582912.0f;
  const v8 k = (clamped * 1.44269504088896341f + magic) - magic;
  const v8 p = exp_core(clamped, k);
  const i32x8 e = (__builtin_convertvector(k, i32x8) + 127) << 23;
  return x < low ? v8{} : p * reinterpret_cast<v8>(e);
}
inline v16 exp16_nonpositive(v16 x) { return {exp8_nonpositive(x.lo), exp8_nonpositive(x.hi)}; }
#else
typedef int32_t i32x16 __attribute__((vector_size(64)));

inline v16 exp16_nonpositive(v16 x) {
  const v16 low = splat(-87.0f);
  const v16 clamped = x < low ? low : x;
  const v16 magic = splat(12582912.0f);  // 1.5 x 2^23: adding and subtracting it rounds to an integer (ties even)
  const v16 k = (clamped * 1.44269504088896341f + magic) - magic;
  const v16 p = exp_core(clamped, k);
  const i32x16 e = (__builtin_convertvector(k, i32x16) + 127) << 23;
  v16 two_k;
  std::memcpy(&two_k, &e, sizeof two_k);
  return x < low ? splat(0.0f) : p * two_k;
}
#endif

// What every range of one call shares: the segments, the shapes, the masks' tail, the sinks and the scalings (`vrow`:
// the validity row of the range's (batch row, KV head)).
struct Range {
  const std::vector<Segment>& ks;
  const std::vector<Segment>& vs;
  int64_t Dk, dv, tail, Q, groups;
  const bool* vrow;
  const float* sinkp;
  float scale, cap;
};

// A thread's buffers: the tile's query rows, TOK decoded rows (zeros past a segment's end), a row of scratch, the
// block logits, and for INT4 keys the query times a block's scales, its bias and 4 logits per row.
struct Scratch {
  std::vector<float> qrows, X, work, block, qs, bias, block4, w16, int4w;
  Scratch(int64_t tile_rows, int64_t Dk, int64_t dmax)
      : qrows(tile_rows * Dk), X(TOK * dmax, 0.0f), work(dmax), block(tile_rows * TOK), qs(tile_rows * Dk),
        bias(tile_rows), block4(tile_rows * 4), w16(tile_rows * 16) {}
};

// fn(segment, first token, token count, first column) for the tokens of `segs` whose columns lie in [c0, c1)
template <typename Fn>
void for_columns(const std::vector<Segment>& segs, int64_t c0, int64_t c1, Fn&& fn) {
  int64_t off = 0;
  for (const Segment& s : segs) {
    const int64_t lo = std::max(c0, off), hi = std::min(c1, off + s.len);
    if (lo < hi) fn(s, lo - off, hi - lo, lo);
    off += s.len;
  }
}

// The columns [c0, c1) of one (batch row, KV head, tile of query rows; its query rows in sc.qrows): each row's
// logits there (softcap and visibility applied), its largest logit m (the sink included, so that one range reproduces
// the one-pass softmax), the sum l of exp(logit - m) over the range (the sink not included) and acc = sum of
// exp(logit - m) x value row. `probs` [nr][c1 - c0] keeps exp(logit - m).
void attend_range(const Range& g, int64_t b, int64_t h, int64_t r0, int64_t nr, int64_t c0, int64_t c1,
                  float* probs, float* m, float* l, float* acc, Scratch& sc) {
  const int64_t w = c1 - c0;
  const float* qrows = sc.qrows.data();
  float *X = sc.X.data(), *work = sc.work.data(), *block = sc.block.data();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  // keys: logits of every row against every column of the range, TOK tokens at a time
  for_columns(g.ks, c0, c1, [&](const Segment& s, int64_t t0, int64_t count, int64_t col0) {
    const bool fast = fp8_fast(s), int4 = int4_keys_fast(s);
    float k[TOK];
    for (int64_t t = 0, tb = 0; t < count; t += tb) {
      if (int4 && (t0 + t) % s.pack_block == 0 && count - t >= s.pack_block) {  // a whole block
        int4_key_block(s, b, h, t0 + t, qrows, nr, sc.qs.data(), sc.bias.data(), sc.block4.data(),
                       probs + col0 - c0 + t, w);
        for (int64_t r = 0; r < nr; ++r)
          for (int64_t i = 0; i < s.pack_block; ++i) probs[r * w + col0 - c0 + t + i] *= g.scale;
        tb = s.pack_block;
        continue;
      }
      if (fast && count - t >= 16) {  // 16 tokens: their logits in one register
        fp8_logits16_rows(s, qrows, code_row(s, b, h, t0 + t),
                          fp8_scales16(s, b, h, t0 + t, g.scale), nr, probs + col0 - c0 + t, w);
        tb = 16;
        continue;
      }
      tb = std::min<int64_t>(TOK, count - t);
      if (int4) tb = std::min<int64_t>(tb, s.pack_block - (t0 + t) % s.pack_block);  // up to the next block
      if (fast && tb == TOK) {
        fp8_logits_rows(s, qrows, fp8_rows(s, b, h, t0 + t, k), k, nr, block);
      } else {
        for (int64_t i = 0; i < tb; ++i) load_row(s, b, h, t0 + t + i, &X[i * g.Dk], work);
        std::fill(X + tb * g.Dk, X + TOK * g.Dk, 0.0f);
        logits_rows(qrows, X, g.Dk, nr, block);
      }
      for (int64_t r = 0; r < nr; ++r)
        for (int64_t i = 0; i < tb; ++i) probs[r * w + col0 - c0 + t + i] = block[r * TOK + i] * g.scale;
    }
  });
  // softcap, visibility, the range's max and sum
  for (int64_t r = 0; r < nr; ++r) {
    float* lr = probs + r * w;
    const int64_t qi = (r0 + r) % g.Q;
    if (g.cap > 0.0f)
      for (int64_t c = 0; c < w; ++c) lr[c] = std::tanh(lr[c] / g.cap) * g.cap;
    if (g.vrow)
      for (int64_t c = c0; c < std::min(c1, g.tail); ++c) lr[c - c0] = g.vrow[c] ? lr[c - c0] : neg_inf;
    for (int64_t c = std::max(c0, g.tail); c < c1; ++c) {  // the tail: causal among itself, each query sees itself
      const int64_t k = c - g.tail;
      const bool seen = ((g.vrow ? g.vrow[c] : true) && k <= qi) || k == qi;
      if (!seen) lr[c - c0] = neg_inf;
    }
    float mr = g.sinkp ? g.sinkp[h * g.groups + (r0 + r) / g.Q] : neg_inf;
    {
      v16 mv = splat(mr);
      int64_t c = 0;
      for (; c + 16 <= w; c += 16) {
        const v16 x = load16(lr + c);
        mv = vmax(x, mv);
      }
      float lanes[16];
      std::memcpy(lanes, &mv, sizeof lanes);
      for (int j = 0; j < 16; ++j) mr = lanes[j] > mr ? lanes[j] : mr;
      for (; c < w; ++c) mr = lr[c] > mr ? lr[c] : mr;
    }
    m[r] = mr;
    if (mr == neg_inf) {  // nothing visible in the range
      for (int64_t c = 0; c < w; ++c) lr[c] = 0.0f;
      l[r] = 0.0f;
      continue;
    }
    v16 part = {};
    int64_t c = 0;
    for (; c + 16 <= w; c += 16) {
      const v16 e = exp16_nonpositive(load16(lr + c) - mr);
      store16(lr + c, e);
      part += e;
    }
    float sum = hsum(part);
    for (; c < w; ++c) {
      lr[c] = exp_nonpositive(lr[c] - mr);
      sum += lr[c];
    }
    l[r] = sum;
  }
  // values: accumulate the decoded rows with their weights exp(logit - m), TOK tokens at a time
  std::fill(acc, acc + nr * g.dv, 0.0f);
  for_columns(g.vs, c0, c1, [&](const Segment& s, int64_t t0, int64_t count, int64_t col0) {
    const bool fast = fp8_fast(s), int4 = int4_values_fast(s);
    float k[TOK];
    for (int64_t t = 0, tb = 0; t < count; t += tb) {
      if (int4 && (t0 + t) % s.pack_block == 0 && count - t >= s.pack_block) {  // a whole block
        int4_value_block(s, b, h, t0 + t, probs + col0 - c0 + t, w, nr, acc, sc.int4w);
        tb = s.pack_block;
        continue;
      }
      if (fast && count - t >= 16) {  // 16 tokens: weights = probabilities x scales, skipped when all are zero
        const v16 k = fp8_scales16(s, b, h, t0 + t, 1.0f);
        v16 any = {};
        for (int64_t r = 0; r < nr; ++r) {
          const v16 wr = load16(probs + r * w + col0 - c0 + t) * k;
          store16(&sc.w16[r * 16], wr);
          any = any + ones_where_nonzero(wr);
        }
        if (hsum(any) != 0.0f)
          fp8_accumulate_rows<16>(s, sc.w16.data(), code_row(s, b, h, t0 + t), nr, acc);
        tb = 16;
        continue;
      }
      tb = std::min<int64_t>(TOK, count - t);
      if (int4) tb = std::min<int64_t>(tb, s.pack_block - (t0 + t) % s.pack_block);
      bool seen = false;
      for (int64_t r = 0; r < nr; ++r)
        for (int64_t i = 0; i < TOK; ++i) {
          const float p = i < tb ? probs[r * w + col0 - c0 + t + i] : 0.0f;
          block[r * TOK + i] = p;
          seen |= p != 0.0f;
        }
      if (!seen) continue;
      if (fast && tb == TOK) {  // the tokens' scales go into their weights, once per token
        const uint8_t* p = fp8_rows(s, b, h, t0 + t, k);
        for (int64_t r = 0; r < nr; ++r)
          for (int i = 0; i < TOK; ++i) block[r * TOK + i] *= k[i];
        fp8_accumulate_rows<TOK>(s, block, p, nr, acc);
        continue;
      }
      for (int64_t i = 0; i < tb; ++i) load_row(s, b, h, t0 + t + i, &X[i * g.dv], work);
      std::fill(X + tb * g.dv, X + TOK * g.dv, 0.0f);
      accumulate_rows(block, X, g.dv, nr, acc);
    }
  });
}

// Columns per range when one (batch row, KV head, tile) is split over its columns (flash-decoding): only for long
// contexts and few such units, and from the shapes alone, so a result never depends on the thread count. A range
// spans a multiple of SPLIT_ALIGN columns and of every segment's packing block, so that its edges fall on the register
// routes' 16-token groups and on whole INT4 blocks: an edge inside a block sent up to a block's tokens on each side
// through decoded rows (KIVI's kernel alone at 8K: 8.5 -> 7.2 ms once aligned).
constexpr int64_t SPLIT_MIN = 512;   // columns of a range at least
constexpr int64_t SPLIT_UNITS = 32;  // split while (batch rows x KV heads x tiles) is below this
constexpr int64_t SPLIT_ALIGN = 64;

int64_t range_columns(int64_t n, int64_t units, int64_t forced, const std::vector<Segment>& ks,
                      const std::vector<Segment>& vs) {
  if (forced > 0) return forced;
  if (units >= SPLIT_UNITS || n < 2 * SPLIT_MIN) return std::max<int64_t>(n, 1);
  int64_t align = SPLIT_ALIGN;
  for (const auto* segs : {&ks, &vs})
    for (const Segment& s : *segs) align = std::lcm(align, std::max<int64_t>(s.pack_block, 1));
  const int64_t ranges = std::min<int64_t>((SPLIT_UNITS + units - 1) / units, n / SPLIT_MIN);
  return ((n + ranges - 1) / ranges + align - 1) / align * align;
}

}  // namespace

std::vector<at::Tensor> decode_attention(
    const at::Tensor& query,                                   // float32 [B, Hq, q, Dk], contiguous
    const std::vector<std::optional<at::Tensor>>& k_tensors,   // per segment: codes, scale, zero, bias
    const std::vector<int64_t>& k_meta,
    const std::vector<std::optional<at::Tensor>>& v_tensors,
    const std::vector<int64_t>& v_meta,
    int64_t dv,
    const std::optional<at::Tensor>& valid,                    // bool [B, Hkv or 1, n]
    double scaling, int64_t causal_tail, double softcap,       // softcap <= 0: none
    const std::optional<at::Tensor>& sinks,                    // float32 [Hq]
    bool column_scores,
    const std::optional<at::Tensor>& query_weight,             // float32 [B, q]
    int64_t kv_heads,
    int64_t split_columns,                                     // columns per range; 0: chosen by size
    const std::optional<at::Tensor>& query_rotation) {         // float32 [Dk, Dk]: attend with query @ it
  TORCH_CHECK(query.dtype() == at::kFloat && query.is_contiguous() && query.dim() == 4,
              "hf_kvcache cpu_decode: query must be contiguous float32 [B, Hq, q, Dk]");
  const int64_t B = query.size(0), Hq = query.size(1), Q = query.size(2), Dk = query.size(3);
  const int64_t groups = Hq / kv_heads, rows = groups * Q;
  std::vector<at::Tensor> keep;  // scales, zero points or bias converted to float32 for this call
  const std::vector<Segment> ks = segments(k_tensors, k_meta, Dk, keep), vs = segments(v_tensors, v_meta, dv, keep);
  int64_t n = 0;
  for (const Segment& s : ks) n += s.len;
  auto out = at::zeros({B, Hq, Q, dv}, query.options());
  at::Tensor scores = column_scores ? at::zeros({B, Hq, n}, query.options()) : at::Tensor();
  const float* qp = query.data_ptr<float>();
  std::vector<float> rotated;
  if (query_rotation) {  // the cache stores its keys rotated (key_rotation): q . k is (q R) . (k R)
    TORCH_CHECK(query_rotation->dtype() == at::kFloat && query_rotation->is_contiguous() &&
                    query_rotation->dim() == 2 && query_rotation->size(0) == Dk && query_rotation->size(1) == Dk,
                "hf_kvcache cpu_decode: query_rotation must be contiguous float32 [Dk, Dk]");
    const float* R = query_rotation->data_ptr<float>();
    rotated.assign(B * Hq * Q * Dk, 0.0f);
    for (int64_t row = 0; row < B * Hq * Q; ++row)  // out[j] = sum_i q[i] R[i][j], i in order
      for (int64_t i = 0; i < Dk; ++i) {
        const float qi = qp[row * Dk + i];
        for (int64_t j = 0; j < Dk; ++j) rotated[row * Dk + j] += qi * R[i * Dk + j];
      }
    qp = rotated.data();
  }
  float* op = out.data_ptr<float>();
  float* sp = column_scores ? scores.data_ptr<float>() : nullptr;
  const bool* vp = valid ? valid->data_ptr<bool>() : nullptr;
  const int64_t v_b = valid ? valid->stride(0) : 0, v_h = valid && valid->size(1) > 1 ? valid->stride(1) : 0;
  const float* sinkp = sinks ? sinks->data_ptr<float>() : nullptr;
  const float* wp = query_weight ? query_weight->data_ptr<float>() : nullptr;
  const int64_t tiles = (rows + TILE - 1) / TILE;
  const int64_t units = B * kv_heads * tiles;                  // (batch row, KV head, tile of query rows)
  // ranges only without column scores (their probabilities would have to be kept for the merge: TILE x n per unit)
  const int64_t span = column_scores ? std::max<int64_t>(n, 1) : range_columns(n, units, split_columns, ks, vs);
  const int64_t nranges = std::max<int64_t>(1, (n + span - 1) / span);
  const int64_t tile_rows = std::min(rows, TILE);
  std::vector<float> M(units * nranges * tile_rows), L(units * nranges * tile_rows);  // each range's m, l, acc
  std::vector<float> ACC(units * nranges * tile_rows * dv);
  const Range g{ks, vs, Dk, dv, n - causal_tail, Q, groups, nullptr, sinkp, static_cast<float>(scaling),
                static_cast<float>(softcap)};
  const float neg_inf = -std::numeric_limits<float>::infinity();

  // out = sum_i e^(m_i - m) acc_i / (sum_i e^(m_i - m) l_i + e^(sink - m)) over the unit's ranges i; with one range
  // (the only case with column scores) `probs` holds its exp(logit - m) rows, [nr][n]
  auto merge = [&](int64_t unit, const float* probs, float* factor) {
    const int64_t b = unit / (kv_heads * tiles), h = unit / tiles % kv_heads, r0 = unit % tiles * TILE;
    const int64_t nr = std::min(TILE, rows - r0);
    for (int64_t r = 0; r < nr; ++r) {
      const int64_t head = h * groups + (r0 + r) / Q, qi = (r0 + r) % Q;
      float m = neg_inf;
      for (int64_t i = 0; i < nranges; ++i) m = std::max(m, M[(unit * nranges + i) * tile_rows + r]);
      if (m == neg_inf) continue;  // nothing visible: zero output and scores
      float denom = sinkp ? exp_nonpositive(sinkp[head] - m) : 0.0f;
      for (int64_t i = 0; i < nranges; ++i) {
        const int64_t at = (unit * nranges + i) * tile_rows + r;
        factor[i] = M[at] == neg_inf ? 0.0f : exp_nonpositive(M[at] - m);
        denom += factor[i] * L[at];
      }
      const float inv = 1.0f / denom;
      float* o = op + ((b * Hq + head) * Q + qi) * dv;
      for (int64_t i = 0; i < nranges; ++i) {
        const float k = factor[i] * inv;
        const float* a = &ACC[((unit * nranges + i) * tile_rows + r) * dv];
        if (k != 0.0f)
          for (int64_t d = 0; d < dv; ++d) o[d] += k * a[d];
      }
      if (sp) {
        const float k = (wp ? wp[b * Q + qi] : 1.0f) * factor[0] * inv;
        float* srow = sp + (b * Hq + head) * n;
        const float* pr = probs + r * n;
        for (int64_t c = 0; c < n; ++c) srow[c] += k * pr[c];
      }
    }
  };

  at::parallel_for(0, units * nranges, 1, [&](int64_t begin, int64_t end) {
    Scratch sc(tile_rows, Dk, std::max(Dk, dv));
    std::vector<float> probs(tile_rows * std::min(span, n)), factor(nranges);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t unit = job / nranges, range = job % nranges;
      const int64_t b = unit / (kv_heads * tiles), h = unit / tiles % kv_heads, r0 = unit % tiles * TILE;
      const int64_t nr = std::min(TILE, rows - r0), c0 = range * span, c1 = std::min(n, c0 + span);
      for (int64_t r = 0; r < nr; ++r) {  // query head h * groups + (r0 + r) / Q, query (r0 + r) % Q
        const int64_t head = h * groups + (r0 + r) / Q, qi = (r0 + r) % Q;
        std::memcpy(&sc.qrows[r * Dk], qp + ((b * Hq + head) * Q + qi) * Dk, Dk * sizeof(float));
      }
      Range mine = g;
      mine.vrow = vp ? vp + b * v_b + h * v_h : nullptr;
      attend_range(mine, b, h, r0, nr, c0, c1, probs.data(), &M[job * tile_rows], &L[job * tile_rows],
                   &ACC[job * tile_rows * dv], sc);
      if (nranges == 1) merge(unit, probs.data(), factor.data());
    }
  });
  if (nranges > 1)
    at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> factor(nranges);
      for (int64_t unit = begin; unit < end; ++unit) merge(unit, nullptr, factor.data());
    });
  return {out, scores};
}

namespace {

// Tokens [t0, t0 + len) of a segment with one scale (and zero point) row per token and no token packing (a paged
// record): the same segment, its codes and per-token fields moved on by t0 rows.
Segment shifted(const Segment& s, int64_t t0, int64_t len) {
  Segment out = s;
  out.len = len;
  out.codes = s.codes + t0 * s.c_n * code_bytes(s);
  for (Strided* f : {&out.scale, &out.zero}) {
    if (f->p) f->p += t0 * f->n;
    else if (f->q) f->q += t0 * f->n;
  }
  return out;
}

// One job of paged_attention: (request, KV head, tile of query rows, range of columns)
struct PagedJob {
  int64_t request, h, r0, range, nranges, span, first;  // span: columns per range; first: the unit's range 0
};

}  // namespace

// Continuous batching's packed batch, attended request by request straight from the pages (no dequantized copy):
// request r has queries [cu_q[r], cu_q[r+1]) of the packed query and keys at the physical rows
// read_index[cu_k[r] : cu_k[r+1]] of the pages, its new tokens last (causal among themselves). A request whose query
// is its whole key range (its first forward: a prompt, or the first chunk of one) attends to its own new tokens
// unquantized, the rows [cu_q[r], cu_q[r+1]) of `fresh` (segment 1 of the key / value tensors; segment 0 is the
// pages). Each run of consecutive physical rows (a page, or pages that happen to follow each other) is one segment,
// so the register routes read 16 tokens at a time within a page. Work is split as decode_attention's: (request, KV
// head, tile of query rows), columns in ranges for long requests when the batch has few such units.
at::Tensor paged_attention(
    const at::Tensor& query,                                   // float32 [Hq, N, Dk], contiguous
    const std::vector<std::optional<at::Tensor>>& k_tensors,   // two segments: the pages' codes, the new tokens
    const std::vector<int64_t>& k_meta,
    const std::vector<std::optional<at::Tensor>>& v_tensors,
    const std::vector<int64_t>& v_meta,
    int64_t dv,
    const at::Tensor& cu_q, const at::Tensor& cu_k,           // int64 [R + 1]
    const at::Tensor& read_index,                              // int64 [cu_k[R]] (empty when all are first)
    double scaling, double softcap,                            // softcap <= 0: none
    const std::optional<at::Tensor>& sinks,                    // float32 [Hq]
    int64_t kv_heads,
    int64_t split_columns,                                     // columns per range; 0: chosen by size
    const std::optional<at::Tensor>& query_rotation) {         // float32 [Dk, Dk]: attend with query @ it
  TORCH_CHECK(query.dtype() == at::kFloat && query.is_contiguous() && query.dim() == 3,
              "hf_kvcache paged_attention: query must be contiguous float32 [Hq, N, Dk]");
  for (const at::Tensor* t : {&cu_q, &cu_k, &read_index})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1,
                "hf_kvcache paged_attention: cu_q, cu_k and read_index must be contiguous int64 vectors");
  TORCH_CHECK(cu_q.size(0) == cu_k.size(0) && cu_q.size(0) >= 1,
              "hf_kvcache paged_attention: cu_q and cu_k must have one entry per request plus one");
  const int64_t Hq = query.size(0), N = query.size(1), Dk = query.size(2);
  const int64_t groups = Hq / kv_heads;
  std::vector<at::Tensor> keep;
  const std::vector<Segment> kt = segments(k_tensors, k_meta, Dk, keep), vt = segments(v_tensors, v_meta, dv, keep);
  TORCH_CHECK(kt.size() == 2 && vt.size() == 2, "hf_kvcache paged_attention: two key and two value segments");
  for (const auto* segs : {&kt, &vt})
    for (const Segment& s : *segs)
      TORCH_CHECK(s.s_tok == 1 && !(s.per_byte > 1 && s.pack == PACK_TOKEN),
                  "hf_kvcache paged_attention: pages need one scale row per token and no token packing");
  const int64_t R = cu_q.size(0) - 1;
  const int64_t* qc = cu_q.data_ptr<int64_t>();
  const int64_t* kc = cu_k.data_ptr<int64_t>();
  const int64_t* idx = read_index.data_ptr<int64_t>();
  const int64_t pages_rows = kt[0].len, total_k = read_index.size(0);

  // each request's segments: runs of consecutive rows of the pages, or its new tokens
  std::vector<std::vector<Segment>> ks(R), vs(R);
  std::vector<int64_t> n_of(R, 0), q_of(R, 0);
  int64_t units = 0;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t q0 = qc[r], q = qc[r + 1] - q0, k0 = kc[r], n = kc[r + 1] - k0;
    TORCH_CHECK(q >= 0 && n >= q && q0 + q <= N && k0 >= 0 && (q == n || k0 + n <= total_k),
                "hf_kvcache paged_attention: request ", r, " has ", q, " queries from ", q0, " and ", n,
                " keys from ", k0, " (queries ", N, ", read rows ", total_k, ")");
    q_of[r] = q;
    n_of[r] = n;
    if (q == 0) continue;
    if (q == n) {  // first forward: its own tokens, unquantized
      ks[r].push_back(shifted(kt[1], q0, q));
      vs[r].push_back(shifted(vt[1], q0, q));
    } else {
      for (int64_t i = 0; i < n;) {
        int64_t j = i + 1;
        while (j < n && idx[k0 + j] == idx[k0 + j - 1] + 1) ++j;
        const int64_t row = idx[k0 + i];
        TORCH_CHECK(row >= 0 && row + (j - i) <= pages_rows, "hf_kvcache paged_attention: read index ", row,
                    " outside the pages' ", pages_rows, " rows");
        ks[r].push_back(shifted(kt[0], row, j - i));
        vs[r].push_back(shifted(vt[0], row, j - i));
        i = j;
      }
    }
    units += kv_heads * ((groups * q + TILE - 1) / TILE);
  }
  std::vector<PagedJob> jobs;
  int64_t span_max = 1;
  for (int64_t r = 0; r < R; ++r) {
    if (q_of[r] == 0) continue;
    const int64_t rows = groups * q_of[r], n = n_of[r];
    const int64_t span = range_columns(n, units, split_columns, ks[r], vs[r]);
    const int64_t nranges = std::max<int64_t>(1, (n + span - 1) / span);
    span_max = std::max(span_max, std::min(span, n));
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t r0 = 0; r0 < rows; r0 += TILE) {
        const int64_t first = static_cast<int64_t>(jobs.size());
        for (int64_t i = 0; i < nranges; ++i) jobs.push_back({r, h, r0, i, nranges, span, first});
      }
  }
  auto out = at::zeros({Hq, N, dv}, query.options());
  const float* qp = query.data_ptr<float>();
  std::vector<float> rotated;
  if (query_rotation) {  // pages store keys rotated (key_rotation): q . k is (q R) . (k R)
    TORCH_CHECK(query_rotation->dtype() == at::kFloat && query_rotation->is_contiguous() &&
                    query_rotation->dim() == 2 && query_rotation->size(0) == Dk && query_rotation->size(1) == Dk,
                "hf_kvcache paged_attention: query_rotation must be contiguous float32 [Dk, Dk]");
    const float* Rm = query_rotation->data_ptr<float>();
    rotated.assign(Hq * N * Dk, 0.0f);
    at::parallel_for(0, Hq * N, 64, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row)
        for (int64_t i = 0; i < Dk; ++i) {
          const float qi = qp[row * Dk + i];
          for (int64_t j = 0; j < Dk; ++j) rotated[row * Dk + j] += qi * Rm[i * Dk + j];
        }
    });
    qp = rotated.data();
  }
  float* op = out.data_ptr<float>();
  const float* sinkp = sinks ? sinks->data_ptr<float>() : nullptr;
  const float scale = static_cast<float>(scaling), cap = static_cast<float>(softcap);
  const int64_t J = static_cast<int64_t>(jobs.size());
  std::vector<float> M(J * TILE), L(J * TILE), ACC(J * TILE * dv);
  const float neg_inf = -std::numeric_limits<float>::infinity();

  // out = sum_i e^(m_i - m) acc_i / (sum_i e^(m_i - m) l_i + e^(sink - m)) over the unit's ranges
  auto merge = [&](const PagedJob& u, float* factor) {
    const int64_t Q = q_of[u.request], rows = groups * Q, nr = std::min(TILE, rows - u.r0);
    for (int64_t r = 0; r < nr; ++r) {
      const int64_t head = u.h * groups + (u.r0 + r) / Q, qi = (u.r0 + r) % Q;
      float m = neg_inf;
      for (int64_t i = 0; i < u.nranges; ++i) m = std::max(m, M[(u.first + i) * TILE + r]);
      if (m == neg_inf) continue;
      float denom = sinkp ? exp_nonpositive(sinkp[head] - m) : 0.0f;
      for (int64_t i = 0; i < u.nranges; ++i) {
        const int64_t at = (u.first + i) * TILE + r;
        factor[i] = M[at] == neg_inf ? 0.0f : exp_nonpositive(M[at] - m);
        denom += factor[i] * L[at];
      }
      const float inv = 1.0f / denom;
      float* o = op + (head * N + qc[u.request] + qi) * dv;
      for (int64_t i = 0; i < u.nranges; ++i) {
        const float k = factor[i] * inv;
        const float* a = &ACC[((u.first + i) * TILE + r) * dv];
        if (k != 0.0f)
          for (int64_t d = 0; d < dv; ++d) o[d] += k * a[d];
      }
    }
  };

  at::parallel_for(0, J, 1, [&](int64_t begin, int64_t end) {
    Scratch sc(TILE, Dk, std::max(Dk, dv));
    std::vector<float> probs(TILE * span_max), factor(1);
    for (int64_t j = begin; j < end; ++j) {
      const PagedJob& u = jobs[j];
      const int64_t Q = q_of[u.request], n = n_of[u.request], rows = groups * Q;
      const int64_t nr = std::min(TILE, rows - u.r0);
      const int64_t c0 = u.range * u.span, c1 = std::min(n, c0 + u.span);
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t head = u.h * groups + (u.r0 + r) / Q, qi = (u.r0 + r) % Q;
        std::memcpy(&sc.qrows[r * Dk], qp + (head * N + qc[u.request] + qi) * Dk, Dk * sizeof(float));
      }
      const Range g{ks[u.request], vs[u.request], Dk, dv, n - Q, Q, groups, nullptr, sinkp, scale, cap};
      attend_range(g, 0, u.h, u.r0, nr, c0, c1, probs.data(), &M[j * TILE], &L[j * TILE], &ACC[j * TILE * dv], sc);
      if (u.nranges == 1) merge(u, factor.data());
    }
  });
  std::vector<int64_t> split_units;
  for (int64_t j = 0; j < J; ++j)
    if (jobs[j].nranges > 1 && jobs[j].range == 0) split_units.push_back(j);
  if (!split_units.empty())
    at::parallel_for(0, static_cast<int64_t>(split_units.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const PagedJob& u = jobs[split_units[i]];
        std::vector<float> factor(u.nranges);
        merge(u, factor.data());
      }
    });
  return out;
}

// (cpu_encode.cpp, compiled into the same extension)
bool fp8_write_tokens(torch::Tensor keys, c10::optional<torch::Tensor> values, torch::Tensor data,
                      torch::Tensor scale, int64_t slot, int64_t fmt, int64_t group, double fmax, double up);

bool tensors_finite(torch::Tensor keys, c10::optional<torch::Tensor> values);

// (cpu_rope.cpp)
void rotate_sinks(torch::Tensor keys, torch::Tensor target, torch::Tensor oldest, torch::Tensor shift,
                  c10::optional<torch::Tensor> has_other, torch::Tensor inv_freq, bool interleaved);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "Softmax attention over quantized key/value segments (CPU)");
  m.def("paged_attention", &paged_attention, "Attention of a continuous-batching batch straight from paged codes (CPU)");
  m.def("fp8_write_tokens", &fp8_write_tokens, "A decode step's tokens quantized into FP8 slot buffers (CPU)");
  m.def("tensors_finite", &tensors_finite, "Whether every element of keys (and values) is finite (CPU)");
  m.def("rotate_sinks", &rotate_sinks, "Attention sinks re-rotated into a store's sink slots (CPU)");
}

// int4 weights (quant/int4.py's layout: (N, K / 2) bytes, column 2j in the low nibble of byte j; a scale per group
// of G columns, (N, K / G) bfloat16; zero points as (N, ceil(K / G / 2)) nibbles, or 8 when symmetric), read as
// they are stored: y = x @ W^T at a handful of rows (decode), and rows of W dequantized to bfloat16 (the tiles a
// larger batch multiplies with the bf16 GEMM).
//
// The product splits x into its even and odd columns once per call, so a byte's two nibbles meet their inputs
// without shuffles, and sums per group sum_i q_i x_i; then y = sum_g scale_g (sum_i q_i x_i - zero_g sum_i x_i).
// Three ways, the first the CPU has:
// - AVX512-VNNI, groups of 128+ columns: x quantized per group to int8 (absmax / 127, as vLLM's CPU int4 path
//   via IPEX's INT8 low-precision mode and llama.cpp's Q8 activations do), 64 nibble x int8 products per
//   vpdpbusd, one float conversion per group. A decode step is then bound by memory, not arithmetic (bf16
//   products of the nibbles ran ~2x slower than the bytes arrive on this project's 2-core CPU).
// - AVX512-BF16, groups of 64: a nibble q becomes the bfloat16 of 128 + q by one OR (0x4300 | q: exact in
//   bfloat16's 8-bit significand), 32 per vdpbf16ps against x in bfloat16; 128 sum_i x_i comes off with the zero.
// - any CPU: the nibbles widen to float32 and meet float32 x.
#include "common.h"

#include <type_traits>

namespace {

constexpr int kMaxRows = 8;
// Bytes ahead in the same weight row the fp8 products prefetch (A/B at 14336x4096 here: 1460 us against 1623 us
// for the next block's rows; the int4 products prefetch the next block's rows: 825 us against 873 us).
constexpr int64_t kPrefetchAhead = 1024;

// f(std::integral_constant<int, m>) for 1 <= m <= kMaxRows: a decode product's input rows as a template argument.
template <typename F>
void with_rows(int64_t m, const F& f) {
  switch (m) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

// Weight rows a decode product streams side by side for M inputs: R x M accumulators, each x chunk loaded once.
constexpr int rows_at_once(int m) { return m == 1 ? 8 : m == 2 ? 4 : m <= 4 ? 2 : 1; }

// y (M, n) in bfloat16 from the products of every block of rows_at_once(M) rows, on every thread: full(row0, out)
// fills out[R][M] for rows row0..row0+R-1; one(row, out) a single row (the last ones, fewer than R).
template <int M, typename Full, typename One>
void for_row_blocks(int64_t n, c10::BFloat16* y, const Full& full, const One& one) {
  constexpr int R = rows_at_once(M);
  parallel_chunks((n + R - 1) / R, 4, [&](auto next) {
    int64_t begin, end;
    float out[R][M];
    while (next(begin, end)) {
      for (int64_t block = begin; block < end; ++block) {
        const int64_t row0 = block * R;
        const int rows = static_cast<int>(std::min<int64_t>(R, n - row0));
        if (rows == R) {
          full(row0, out);
        } else {
          for (int r = 0; r < rows; ++r) one(row0 + r, &out[r]);
        }
        for (int r = 0; r < rows; ++r)
          for (int m = 0; m < M; ++m) y[m * n + row0 + r] = static_cast<c10::BFloat16>(out[r][m]);
      }
    }
  });
}

struct Int4Weight {
  const uint8_t* w;         // (N, K / 2)
  const c10::BFloat16* s;   // (N, groups)
  const uint8_t* z;         // (N, zero_bytes) or nullptr: 8
  int64_t n, k, group, groups, zero_bytes;

  float scale(int64_t row, int64_t g) const { return static_cast<float>(s[row * groups + g]); }
  float zero(int64_t row, int64_t g) const {
    if (z == nullptr) return 8.f;
    const uint8_t b = z[row * zero_bytes + g / 2];
    return static_cast<float>(g % 2 ? b >> 4 : b & 0xF);
  }
};

// x's even and odd columns, (M, K / 2) each, and each group's sum of x, (M, groups), in float32 and bfloat16;
// with `int8`, also quantized per group: int8 columns, each group's scale and sum of its int8 values.
struct SplitInput {
  std::vector<float> even, odd, group_sum;
  std::vector<c10::BFloat16> even_bf16, odd_bf16;
  std::vector<int8_t> even_i8, odd_i8;
  std::vector<float> scale_i8;
  std::vector<int32_t> sum_i8;

  SplitInput(const c10::BFloat16* x, int64_t m, int64_t k, int64_t group, bool int8) {
    const int64_t half = k / 2, groups = k / group;
    even.resize(m * half);
    odd.resize(m * half);
    even_bf16.resize(m * half);
    odd_bf16.resize(m * half);
    group_sum.assign(m * groups, 0.f);
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t j = 0; j < half; ++j) {
        const c10::BFloat16 a = x[r * k + 2 * j], b = x[r * k + 2 * j + 1];
        even_bf16[r * half + j] = a;
        odd_bf16[r * half + j] = b;
        even[r * half + j] = static_cast<float>(a);
        odd[r * half + j] = static_cast<float>(b);
        group_sum[r * groups + (2 * j) / group] += static_cast<float>(a) + static_cast<float>(b);
      }
    }
    if (int8) quantize(m, half, group / 2, groups);
  }

  void quantize(int64_t m, int64_t half, int64_t per_group, int64_t groups) {
    even_i8.resize(m * half);
    odd_i8.resize(m * half);
    scale_i8.assign(m * groups, 0.f);
    sum_i8.assign(m * groups, 0);
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t begin = r * half + g * per_group, end = begin + per_group;
        float absmax = 0.f;
        for (int64_t j = begin; j < end; ++j) absmax = std::max({absmax, std::fabs(even[j]), std::fabs(odd[j])});
        const float scale = absmax / 127.f, inverse = absmax > 0.f ? 127.f / absmax : 0.f;
        int32_t sum = 0;
        for (int64_t j = begin; j < end; ++j) {
          even_i8[j] = static_cast<int8_t>(std::nearbyint(even[j] * inverse));
          odd_i8[j] = static_cast<int8_t>(std::nearbyint(odd[j] * inverse));
          sum += even_i8[j] + odd_i8[j];
        }
        scale_i8[r * groups + g] = scale;
        sum_i8[r * groups + g] = sum;
      }
    }
  }
};

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kHasVnni = true;
// R output rows at once, x in int8 (SplitInput::quantize): per group, 64 nibbles x int8 per vpdpbusd (low and high
// nibbles against x's even and odd columns), the int32 sums scaled by scale_g * x_scale_g into float32.
template <int R, int M>
void int4_rows_vnni(const Int4Weight& W, const SplitInput& in, int64_t row0, float (*out)[M]) {
  const int64_t half = W.k / 2, bytes_per_group = W.group / 2, groups = W.groups;
  const __m512i low_mask = _mm512_set1_epi8(0x0F);
  // Per row and input: scale_g * x_scale_g for every group, and the zero points' share, sum_g of that times
  // zero_g * sum of the group's int8 x (loops over groups the compiler vectorizes, out of the byte loop).
  thread_local std::vector<float> factors;
  factors.resize(static_cast<size_t>(R * M * groups));
  float correction[R][M];
  for (int r = 0; r < R; ++r) {
    for (int m = 0; m < M; ++m) {
      float* f = factors.data() + (r * M + m) * groups;
      const float* xs = in.scale_i8.data() + m * groups;
      const int32_t* xsum = in.sum_i8.data() + m * groups;
      float corr = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        f[g] = W.scale(row0 + r, g) * xs[g];
        corr += f[g] * W.zero(row0 + r, g) * static_cast<float>(xsum[g]);
      }
      correction[r][m] = corr;
    }
  }
  __m512 total[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) total[r][m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i acc[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_si512();
    for (int64_t c = g * bytes_per_group; c < (g + 1) * bytes_per_group; c += 64) {
      __m512i xe[M], xo[M];
      for (int m = 0; m < M; ++m) {
        xe[m] = _mm512_loadu_si512(in.even_i8.data() + m * half + c);
        xo[m] = _mm512_loadu_si512(in.odd_i8.data() + m * half + c);
      }
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = W.w + (row0 + r) * half + c;
        _mm_prefetch(reinterpret_cast<const char*>(p + R * half), _MM_HINT_T0);  // the next block's rows
        const __m512i bytes = _mm512_loadu_si512(p);
        const __m512i lo = _mm512_and_si512(bytes, low_mask);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low_mask);
        for (int m = 0; m < M; ++m) acc[r][m] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[r][m], lo, xe[m]), hi, xo[m]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m)
        total[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][m]), _mm512_set1_ps(factors[(r * M + m) * groups + g]),
                                      total[r][m]);
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) out[r][m] = _mm512_reduce_add_ps(total[r][m]) - correction[r][m];
}
#else
constexpr bool kHasVnni = false;
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// R output rows at once (their weights streamed side by side, each x chunk loaded once for all R): per row
// sum_g scale_g * sum_i (128 + q_i) x_i - sum_g scale_g (128 + zero_g) sum_g x, via vdpbf16ps. Low and high
// nibbles accumulate apart, so R x M x 2 independent chains hide the dot product's latency.
template <int R, int M>
void int4_rows_bf16dot(const Int4Weight& W, const SplitInput& in, int64_t row0, float (*out)[M]) {
  const int64_t half = W.k / 2, bytes_per_group = W.group / 2;
  const __m512i low_mask = _mm512_set1_epi16(0x0F), bias = _mm512_set1_epi16(0x4300);
  __m512 total[R][M];
  float correction[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) total[r][m] = _mm512_setzero_ps(), correction[r][m] = 0.f;
  for (int64_t g = 0; g < W.groups; ++g) {
    __m512 acc_lo[R][M], acc_hi[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc_lo[r][m] = _mm512_setzero_ps(), acc_hi[r][m] = _mm512_setzero_ps();
    for (int64_t c = g * bytes_per_group; c < (g + 1) * bytes_per_group; c += 32) {
      __m512bh xe[M], xo[M];
      for (int m = 0; m < M; ++m) {
        xe[m] = (__m512bh)_mm512_loadu_si512(in.even_bf16.data() + m * half + c);
        xo[m] = (__m512bh)_mm512_loadu_si512(in.odd_bf16.data() + m * half + c);
      }
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = W.w + (row0 + r) * half + c;
        if (c % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(p + R * half), _MM_HINT_T0);
        const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
        const __m512bh lo = (__m512bh)_mm512_ternarylogic_epi32(words, low_mask, bias, 0xEA);  // (a & b) | c
        const __m512bh hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(words, 4), bias);
        for (int m = 0; m < M; ++m) {
          acc_lo[r][m] = _mm512_dpbf16_ps(acc_lo[r][m], lo, xe[m]);
          acc_hi[r][m] = _mm512_dpbf16_ps(acc_hi[r][m], hi, xo[m]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const float s = W.scale(row0 + r, g), offset = s * (128.f + W.zero(row0 + r, g));
      for (int m = 0; m < M; ++m) {
        total[r][m] = _mm512_fmadd_ps(_mm512_add_ps(acc_lo[r][m], acc_hi[r][m]), _mm512_set1_ps(s), total[r][m]);
        correction[r][m] += offset * in.group_sum[m * W.groups + g];
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) out[r][m] = _mm512_reduce_add_ps(total[r][m]) - correction[r][m];
}
#endif

// The same in float32 vectors (any CPU): 32 columns (16 bytes) at a time.
template <int M>
void int4_row_float(const Int4Weight& W, const SplitInput& in, int64_t row, float* out) {
  typedef uint8_t u8x16 __attribute__((vector_size(16)));
  const int64_t half = W.k / 2, bytes_per_group = W.group / 2;
  const uint8_t* wrow = W.w + row * half;
  float result[M] = {};
  for (int64_t g = 0; g < W.groups; ++g) {
    f32x16 acc[M] = {};
    for (int64_t c = g * bytes_per_group; c < (g + 1) * bytes_per_group; c += 16) {
      u8x16 b;
      std::memcpy(&b, wrow + c, sizeof b);
      const f32x16 lo = __builtin_convertvector(b & 0x0F, f32x16), hi = __builtin_convertvector(b >> 4, f32x16);
      for (int m = 0; m < M; ++m) acc[m] += lo * load16(in.even.data() + m * half + c) + hi * load16(in.odd.data() + m * half + c);
    }
    const float s = W.scale(row, g), z = W.zero(row, g);
    for (int m = 0; m < M; ++m) result[m] += s * (sum16(acc[m]) - z * in.group_sum[m * W.groups + g]);
  }
  for (int m = 0; m < M; ++m) out[m] = result[m];
}

// Which product int4_gemv runs for a weight in groups of `group` columns (see the top of the file).
enum class Int4Path { kVnni, kBf16Dot, kFloat };

Int4Path int4_path(int64_t group) {
  if (kHasVnni && group % 128 == 0) return Int4Path::kVnni;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (group % 64 == 0) return Int4Path::kBf16Dot;
#endif
  return Int4Path::kFloat;
}

// R rows from row0 by `path`.
template <int R, int M>
void int4_block(const Int4Weight& W, const SplitInput& in, Int4Path path, int64_t row0, float (*out)[M]) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (path == Int4Path::kVnni) return int4_rows_vnni<R, M>(W, in, row0, out);
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (path == Int4Path::kBf16Dot) return int4_rows_bf16dot<R, M>(W, in, row0, out);
#endif
  for (int r = 0; r < R; ++r) int4_row_float<M>(W, in, row0 + r, out[r]);
}

template <int M>
void int4_gemv_rows(const Int4Weight& W, const SplitInput& in, Int4Path path, c10::BFloat16* y) {
  for_row_blocks<M>(W.n, y, [&](int64_t row0, float (*out)[M]) { int4_block<rows_at_once(M), M>(W, in, path, row0, out); },
                    [&](int64_t row, float (*out)[M]) { int4_block<1, M>(W, in, path, row, out); });
}

Int4Weight int4_weight(const at::Tensor& weight, const at::Tensor& scale, const c10::optional<at::Tensor>& zero) {
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2 && weight.is_contiguous(),
              "int4 weight must be contiguous (N, K / 2) uint8");
  TORCH_CHECK(scale.scalar_type() == at::kBFloat16 && scale.dim() == 2 && scale.is_contiguous() &&
              scale.size(0) == weight.size(0), "int4 scales must be contiguous (N, groups) bfloat16");
  const int64_t k = weight.size(1) * 2, groups = scale.size(1);
  TORCH_CHECK(groups > 0 && k % groups == 0 && (k / groups) % 32 == 0, "int4 groups must be whole multiples of 32 columns");
  Int4Weight W{weight.data_ptr<uint8_t>(), scale.data_ptr<c10::BFloat16>(), nullptr, weight.size(0), k, k / groups,
               groups, 0};
  if (zero.has_value()) {
    TORCH_CHECK(zero->scalar_type() == at::kByte && zero->is_contiguous() && zero->size(0) == W.n &&
                zero->size(1) == (groups + 1) / 2, "int4 zero points must be contiguous (N, ceil(groups / 2)) uint8");
    W.z = zero->data_ptr<uint8_t>();
    W.zero_bytes = zero->size(1);
  }
  return W;
}

}  // namespace

// x: (M, K) bfloat16, 1 <= M <= 8. Returns (M, N) bfloat16.
at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                     const c10::optional<at::Tensor>& zero) {
  const Int4Weight W = int4_weight(weight, scale, zero);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(1) == W.k && x.size(0) >= 1 &&
              x.size(0) <= kMaxRows, "x must be (M, K) bfloat16 with 1 <= M <= 8");
  const at::Tensor xc = x.contiguous();
  const Int4Path path = int4_path(W.group);
  const SplitInput in(xc.data_ptr<c10::BFloat16>(), x.size(0), W.k, W.group, path == Int4Path::kVnni);
  at::Tensor y = at::empty({x.size(0), W.n}, x.options());
  auto* yp = y.data_ptr<c10::BFloat16>();
  with_rows(x.size(0), [&](auto rows) { int4_gemv_rows<decltype(rows)::value>(W, in, path, yp); });
  return y;
}

// Which int4_gemv product this build runs for groups of `group` columns: "vnni" (x in int8), "bf16dot" or "float".
std::string int4_gemv_path(int64_t group) {
  switch (int4_path(group)) {
    case Int4Path::kVnni: return "vnni";
    case Int4Path::kBf16Dot: return "bf16dot";
    default: return "float";
  }
}

// Rows start:end of the weight, dequantized to bfloat16: (end - start, K), each value round((q - zero) * scale).
at::Tensor int4_dequantize(const at::Tensor& weight, const at::Tensor& scale, const c10::optional<at::Tensor>& zero,
                           int64_t start, int64_t end) {
  const Int4Weight W = int4_weight(weight, scale, zero);
  TORCH_CHECK(0 <= start && start <= end && end <= W.n, "rows out of range");
  at::Tensor out = at::empty({end - start, W.k}, scale.options());
  auto* o = out.data_ptr<c10::BFloat16>();
  typedef uint8_t u8x16 __attribute__((vector_size(16)));
  typedef uint16_t u16x32 __attribute__((vector_size(64)));
  const int64_t half = W.k / 2, bytes_per_group = W.group / 2;
  parallel_chunks(end - start, 8, [&](auto next) {
    int64_t begin, stop;
    while (next(begin, stop)) {
      for (int64_t r = begin; r < stop; ++r) {
        const int64_t row = start + r;
        for (int64_t g = 0; g < W.groups; ++g) {
          const float s = W.scale(row, g), z = W.zero(row, g);
          for (int64_t c = g * bytes_per_group; c < (g + 1) * bytes_per_group; c += 16) {
            u8x16 b;
            std::memcpy(&b, W.w + row * half + c, sizeof b);
            const f32x16 lo = (__builtin_convertvector(b & 0x0F, f32x16) - z) * s;
            const f32x16 hi = (__builtin_convertvector(b >> 4, f32x16) - z) * s;
            c10::BFloat16 lo16[16], hi16[16];
            store16(lo16, lo);
            store16(hi16, hi);
            u16x16 a, h;
            std::memcpy(&a, lo16, sizeof a);
            std::memcpy(&h, hi16, sizeof h);
            const u16x32 pairs = __builtin_shufflevector(a, h, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                         8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
            std::memcpy(o + r * W.k + 2 * c, &pairs, sizeof pairs);
          }
        }
      }
    }
  });
  return out;
}

// ---- fp8 (e4m3) weights: quant/fp8.py's layout, (N, K) bytes with float32 scales per row ((N,)) or per block of
// bn x bk ((ceil(N / bn), ceil(K / bk))). A byte becomes the float16 of value * 2^-8 by integer ops (e4m3's 4-bit
// exponent and 3-bit mantissa moved under float16's, subnormals included: exact), then float32 (F16C), and meets
// float32 x; the 2^8 goes into the scale.
namespace {

struct Fp8Weight {
  const uint8_t* w;  // (N, K)
  const float* s;
  int64_t n, k, block_n, block_k, scale_cols;  // block_k = k, block_n = 1: one scale per row

  float scale(int64_t row, int64_t g) const { return s[(row / block_n) * scale_cols + g] * 256.f; }
};

inline float fp8_to_float_over_256(uint8_t b) {
  return static_cast<float>(c10::Half(static_cast<uint16_t>(((b & 0x7F) << 7) | ((b & 0x80) << 8)),
                                      c10::Half::from_bits()));
}

// 16 e4m3 bytes -> 16 floats of value * 2^-8.
inline f32x16 fp8x16_to_float(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i magnitude = _mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(0x3F80));
  const __m256i sign = _mm256_and_si256(_mm256_slli_epi16(b, 8), _mm256_set1_epi16(static_cast<int16_t>(0x8000)));
  const __m512 v = _mm512_cvtph_ps(_mm256_or_si256(magnitude, sign));
  f32x16 out;
  std::memcpy(&out, &v, sizeof out);
  return out;
#else
  float tmp[16];
  for (int i = 0; i < 16; ++i) tmp[i] = fp8_to_float_over_256(p[i]);
  return load16(tmp);
#endif
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// With AVX512-BF16: a byte sign-extended to 16 bits and shifted left by 4 is, masked with 0x87F0, the bfloat16 of
// value * 2^-120 (e4m3's exponent and mantissa under bfloat16's, the sign on top): exact for every normal value and
// zero; a subnormal e4m3 (|value| < 2^-6, under 1/28000 of the format's range) becomes a bfloat16 denormal, which
// vdpbf16ps reads as zero. 32 of them per vdpbf16ps against x in bfloat16; the 2^120 goes into the scale.
template <int R, int M>
void fp8_rows_bf16dot(const Fp8Weight& W, const c10::BFloat16* x, int64_t row0, float (*out)[M]) {
  const int64_t groups = (W.k + W.block_k - 1) / W.block_k;
  const __m512i mask = _mm512_set1_epi16(static_cast<int16_t>(0x87F0));
  const float unscale = 0x1p120f;
  float result[R][M] = {};
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t c0 = g * W.block_k, c1 = std::min(W.k, c0 + W.block_k);
    __m512 acc[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
    int64_t c = c0;
    for (; c + 32 <= c1; c += 32) {
      __m512bh xs[M];
      for (int m = 0; m < M; ++m) xs[m] = (__m512bh)_mm512_loadu_si512(x + m * W.k + c);
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = W.w + (row0 + r) * W.k + c;
        if (c % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchAhead), _MM_HINT_T0);
        const __m512i wide = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
        const __m512bh wv = (__m512bh)_mm512_and_si512(_mm512_slli_epi16(wide, 4), mask);
        for (int m = 0; m < M; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv, xs[m]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const float s = W.scale(row0 + r, g) / 256.f;  // (W.scale carries the float16 path's 2^8)
      for (int m = 0; m < M; ++m) {
        float tail = 0.f;  // (a K not in whole 32s: the exact float16 route)
        for (int64_t t = c; t < c1; ++t)
          tail += fp8_to_float_over_256(W.w[(row0 + r) * W.k + t]) * 256.f * static_cast<float>(x[m * W.k + t]);
        result[r][m] += s * (_mm512_reduce_add_ps(acc[r][m]) * unscale + tail);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) out[r][m] = result[r][m];
}
constexpr bool kFp8Bf16Dot = true;
#else
constexpr bool kFp8Bf16Dot = false;
#endif

template <int R, int M>
void fp8_rows(const Fp8Weight& W, const float* x, int64_t row0, float (*out)[M]) {
  const int64_t groups = (W.k + W.block_k - 1) / W.block_k;
  float result[R][M] = {};
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t c0 = g * W.block_k, c1 = std::min(W.k, c0 + W.block_k);
    f32x16 acc[R][M] = {};
    int64_t c = c0;
    for (; c + 16 <= c1; c += 16) {
      f32x16 xs[M];
      for (int m = 0; m < M; ++m) xs[m] = load16(x + m * W.k + c);
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = W.w + (row0 + r) * W.k + c;
        if (c % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchAhead), _MM_HINT_T0);
        const f32x16 wv = fp8x16_to_float(p);
        for (int m = 0; m < M; ++m) acc[r][m] += wv * xs[m];
      }
    }
    for (int r = 0; r < R; ++r) {
      const float s = W.scale(row0 + r, g);
      for (int m = 0; m < M; ++m) {
        float sum = sum16(acc[r][m]);
        for (int64_t t = c; t < c1; ++t) sum += fp8_to_float_over_256(W.w[(row0 + r) * W.k + t]) * x[m * W.k + t];
        result[r][m] += s * sum;
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) out[r][m] = result[r][m];
}

// R rows from row0: the bf16 dot products where the CPU has them, else float32 (x in both forms).
template <int R, int M>
void fp8_block(const Fp8Weight& W, const float* x, const c10::BFloat16* x16, int64_t row0, float (*out)[M]) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  return fp8_rows_bf16dot<R, M>(W, x16, row0, out);
#endif
  fp8_rows<R, M>(W, x, row0, out);
}

template <int M>
void fp8_gemv_rows(const Fp8Weight& W, const float* x, const c10::BFloat16* x16, c10::BFloat16* y) {
  for_row_blocks<M>(W.n, y, [&](int64_t row0, float (*out)[M]) { fp8_block<rows_at_once(M), M>(W, x, x16, row0, out); },
                    [&](int64_t row, float (*out)[M]) { fp8_block<1, M>(W, x, x16, row, out); });
}

Fp8Weight fp8_weight(const at::Tensor& weight, const at::Tensor& scale, int64_t block_n, int64_t block_k) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat8_e4m3fn && weight.dim() == 2 && weight.is_contiguous(),
              "fp8 weight must be contiguous (N, K) float8_e4m3fn");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous(), "fp8 scales must be contiguous float32");
  const int64_t n = weight.size(0), k = weight.size(1);
  if (block_k <= 0) {
    TORCH_CHECK(scale.numel() == n, "per-row fp8 scales must be (N,)");
    return {reinterpret_cast<const uint8_t*>(weight.data_ptr()), scale.data_ptr<float>(), n, k, 1, k, 1};
  }
  const int64_t rows = (n + block_n - 1) / block_n, cols = (k + block_k - 1) / block_k;
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == rows && scale.size(1) == cols, "fp8 block scales must be "
              "(ceil(N / bn), ceil(K / bk))");
  return {reinterpret_cast<const uint8_t*>(weight.data_ptr()), scale.data_ptr<float>(), n, k, block_n, block_k, cols};
}

}  // namespace

// x: (M, K) bfloat16, 1 <= M <= 8; block_k <= 0: per-row scales. Returns (M, N) bfloat16.
at::Tensor fp8_gemv(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, int64_t block_n,
                    int64_t block_k) {
  const Fp8Weight W = fp8_weight(weight, scale, block_n, block_k);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(1) == W.k && x.size(0) >= 1 &&
              x.size(0) <= kMaxRows, "x must be (M, K) bfloat16 with 1 <= M <= 8");
  const at::Tensor x16 = x.contiguous();
  const at::Tensor xf = kFp8Bf16Dot ? x16 : x.to(at::kFloat).contiguous();  // (float32 x: the float32 route's)
  const float* xp = kFp8Bf16Dot ? nullptr : xf.data_ptr<float>();
  const auto* xb = x16.data_ptr<c10::BFloat16>();
  at::Tensor y = at::empty({x.size(0), W.n}, x.options());
  auto* yp = y.data_ptr<c10::BFloat16>();
  with_rows(x.size(0), [&](auto rows) { fp8_gemv_rows<decltype(rows)::value>(W, xp, xb, yp); });
  return y;
}

// Which fp8_gemv product this build runs: "bf16dot" (subnormal e4m3 read as zero) or "float" (exact).
std::string fp8_gemv_path() { return kFp8Bf16Dot ? "bf16dot" : "float"; }

// Rows start:end of an fp8 weight dequantized to bfloat16: round(value * scale), as the reference does.
at::Tensor fp8_dequantize(const at::Tensor& weight, const at::Tensor& scale, int64_t block_n, int64_t block_k,
                          int64_t start, int64_t end) {
  const Fp8Weight W = fp8_weight(weight, scale, block_n, block_k);
  TORCH_CHECK(0 <= start && start <= end && end <= W.n, "rows out of range");
  at::Tensor out = at::empty({end - start, W.k}, weight.options().dtype(at::kBFloat16));
  auto* o = out.data_ptr<c10::BFloat16>();
  parallel_chunks(end - start, 8, [&](auto next) {
    int64_t begin, stop;
    while (next(begin, stop)) {
      for (int64_t r = begin; r < stop; ++r) {
        const int64_t row = start + r;
        for (int64_t c0 = 0; c0 < W.k; c0 += W.block_k) {
          const int64_t c1 = std::min(W.k, c0 + W.block_k);
          const float s = W.scale(row, c0 / W.block_k);
          int64_t c = c0;
          for (; c + 16 <= c1; c += 16) store16(o + r * W.k + c, fp8x16_to_float(W.w + row * W.k + c) * s);
          for (; c < c1; ++c) o[r * W.k + c] = static_cast<c10::BFloat16>(fp8_to_float_over_256(W.w[row * W.k + c]) * s);
        }
      }
    }
  });
  return out;
}

// ---- MXFP4 (gpt-oss' experts: quant/mxfp4.py): (N, K / 2) bytes of E2M1 codes, the low nibble first, and (N, K / 32)
// E8M0 scale bytes, 2^(byte - 127) per 32 values. Decode products read them as stored: x's even and odd columns
// apart (as int4's), each code's value from a 16-entry table, summed per block of 32 and scaled.
namespace {

constexpr float kE2M1[16] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

inline float e8m0(uint8_t byte) { return std::ldexp(1.f, static_cast<int>(byte) - 127); }

// One row against M inputs: 16 bytes (one block of 32 values) at a time.
template <int M>
void mxfp4_row(const uint8_t* w, const uint8_t* s, const float* even, const float* odd, int64_t half, float* out) {
  float result[M] = {};
  for (int64_t c = 0, block = 0; c < half; c += 16, ++block) {
    float lo[16], hi[16];
    for (int i = 0; i < 16; ++i) lo[i] = kE2M1[w[c + i] & 0xF], hi[i] = kE2M1[w[c + i] >> 4];
    const f32x16 l = load16(lo), h = load16(hi);
    const float scale = e8m0(s[block]);
    for (int m = 0; m < M; ++m) result[m] += scale * sum16(l * load16(even + m * half + c) + h * load16(odd + m * half + c));
  }
  for (int m = 0; m < M; ++m) out[m] = result[m];
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr bool kMxfp4Bf16Dot = true;
// R rows with AVX512-BF16: 32 bytes (two blocks) at a time; the codes' bfloat16 values from a 32-word table
// (vpermw), their products with x's even / odd columns by vdpbf16ps into a fresh accumulator whose lanes 0-7 hold
// the first block's sums and 8-15 the second's, then scaled per lane into the total.
template <int R, int M>
void mxfp4_rows_bf16dot(const uint8_t* w, const uint8_t* s, const c10::BFloat16* even, const c10::BFloat16* odd,
                        int64_t half, int64_t row0, float (*out)[M]) {
  alignas(64) uint16_t table[32];
  for (int i = 0; i < 32; ++i) table[i] = c10::BFloat16(kE2M1[i % 16]).x;
  const __m512i values = _mm512_load_si512(table), low_mask = _mm512_set1_epi16(0x0F);
  const int64_t blocks = half / 16;
  __m512 total[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) total[r][m] = _mm512_setzero_ps();
  for (int64_t c = 0; c < half; c += 32) {
    __m512bh xe[M], xo[M];
    for (int m = 0; m < M; ++m) {
      xe[m] = (__m512bh)_mm512_loadu_si512(even + m * half + c);
      xo[m] = (__m512bh)_mm512_loadu_si512(odd + m * half + c);
    }
    for (int r = 0; r < R; ++r) {
      const uint8_t* p = w + (row0 + r) * half + c;
      _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchAhead), _MM_HINT_T0);
      const __m512i codes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      const __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(codes, low_mask), values);
      const __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(codes, 4), values);
      const uint8_t* sb = s + (row0 + r) * blocks + c / 16;
      const __m512 scale = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(e8m0(sb[0])), _mm512_set1_ps(e8m0(sb[1])));
      for (int m = 0; m < M; ++m) {
        const __m512 sums = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), lo, xe[m]), hi, xo[m]);
        total[r][m] = _mm512_fmadd_ps(sums, scale, total[r][m]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) out[r][m] = _mm512_reduce_add_ps(total[r][m]);
}
#else
constexpr bool kMxfp4Bf16Dot = false;
#endif

}  // namespace

// x: (M, K) bfloat16, 1 <= M <= 8; blocks (N, K / 2) and scales (N, K / 32) uint8. Returns (M, N) bfloat16.
at::Tensor mxfp4_gemv(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& scales) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous() &&
              scales.scalar_type() == at::kByte && scales.dim() == 2 && scales.is_contiguous() &&
              scales.size(0) == blocks.size(0) && blocks.size(1) == scales.size(1) * 16,
              "MXFP4 weights must be contiguous (N, K / 2) codes and (N, K / 32) scales, uint8");
  const int64_t n = blocks.size(0), k = blocks.size(1) * 2, half = k / 2;
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(1) == k && x.size(0) >= 1 &&
              x.size(0) <= kMaxRows, "x must be (M, K) bfloat16 with 1 <= M <= 8");
  const at::Tensor xc = x.contiguous();
  const SplitInput in(xc.data_ptr<c10::BFloat16>(), x.size(0), k, 32, false);
  const auto* w = blocks.data_ptr<uint8_t>();
  const auto* s = scales.data_ptr<uint8_t>();
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  auto* yp = y.data_ptr<c10::BFloat16>();
  const bool bf16dot = kMxfp4Bf16Dot && half % 32 == 0;
  with_rows(x.size(0), [&](auto rows) {
    constexpr int M = decltype(rows)::value;
    auto one = [&](int64_t row, float (*out)[M]) {
      mxfp4_row<M>(w + row * half, s + row * (half / 16), in.even.data(), in.odd.data(), half, out[0]);
    };
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if (bf16dot) {
      for_row_blocks<M>(n, yp, [&](int64_t row0, float (*out)[M]) {
        mxfp4_rows_bf16dot<rows_at_once(M), M>(w, s, in.even_bf16.data(), in.odd_bf16.data(), half, row0, out);
      }, [&](int64_t row, float (*out)[M]) {
        mxfp4_rows_bf16dot<1, M>(w, s, in.even_bf16.data(), in.odd_bf16.data(), half, row, out);
      });
      return;
    }
#endif
    for_row_blocks<M>(n, yp, [&](int64_t row0, float (*out)[M]) {
      for (int r = 0; r < rows_at_once(M); ++r) one(row0 + r, &out[r]);
    }, one);
  });
  (void)bf16dot;
  return y;
}

// The prefill side: (N, K) bfloat16 weights from MXFP4 codes and scales (exact: each value is an E2M1 value times a
// power of two), per block of 32 a 16-entry table of its scaled values, every code one lookup.
at::Tensor mxfp4_dequantize(const at::Tensor& blocks, const at::Tensor& scales) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous() &&
              scales.scalar_type() == at::kByte && scales.dim() == 2 && scales.is_contiguous() &&
              scales.size(0) == blocks.size(0) && blocks.size(1) == scales.size(1) * 16,
              "MXFP4 weights must be contiguous (N, K / 2) codes and (N, K / 32) scales, uint8");
  const int64_t n = blocks.size(0), half = blocks.size(1), num_blocks = scales.size(1);
  at::Tensor out = at::empty({n, 2 * half}, blocks.options().dtype(at::kBFloat16));
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  const auto* w = blocks.data_ptr<uint8_t>();
  const auto* s = scales.data_ptr<uint8_t>();
  parallel_chunks(n, 8, [&](const auto& next) {
    int64_t begin, stop;
    while (next(begin, stop)) {
      for (int64_t row = begin; row < stop; ++row) {
        for (int64_t b = 0; b < num_blocks; ++b) {
          uint16_t table[16];
          const float scale = e8m0(s[row * num_blocks + b]);
          for (int i = 0; i < 16; ++i) table[i] = c10::BFloat16(kE2M1[i] * scale).x;
          const uint8_t* codes = w + row * half + b * 16;
          uint16_t* dst = o + row * 2 * half + b * 32;
          for (int i = 0; i < 16; ++i) dst[2 * i] = table[codes[i] & 0xF], dst[2 * i + 1] = table[codes[i] >> 4];
        }
      }
    }
  });
  return out;
}

// Helpers shared by the kernels: 16-float vectors (GCC's vector extensions, so the same source
// compiles to whatever -march=native offers), loads and stores of float32 / bfloat16 / float16 rows,
// and rounding to a dtype's precision (so a fused kernel rounds where the PyTorch ops it replaces do).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

// AMX tiles and AVX512-BF16 dot products where this build's -march=native has them.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PAGEDLLM_HAS_AMX 1
#else
#define PAGEDLLM_HAS_AMX 0
#endif

namespace {

// 16 floats as one value (one AVX-512 register, two AVX2 ones): GCC's vector extensions, so the same
// source compiles to whatever -march=native offers.
typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline f32x16 load16(const c10::BFloat16* p) {
  // bfloat16 is the top half of a float32: widen and shift.
  u16x16 h;
  std::memcpy(&h, p, sizeof h);
  u32x16 w = __builtin_convertvector(h, u32x16) << 16;
  f32x16 v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}
inline f32x16 load16(const c10::Half* p) {
  float tmp[16];
  for (int i = 0; i < 16; ++i) tmp[i] = static_cast<float>(p[i]);
  return load16(tmp);
}
inline void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof v); }
inline void store16(c10::BFloat16* p, f32x16 v) {
  // Round to nearest even, as c10::BFloat16(float) does for finite values.
  u32x16 bits;
  std::memcpy(&bits, &v, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  u16x16 h = __builtin_convertvector(bits >> 16, u16x16);
  std::memcpy(p, &h, sizeof h);
}
inline void store16(c10::Half* p, f32x16 v) {
  for (int i = 0; i < 16; ++i) p[i] = static_cast<c10::Half>(v[i]);
}
inline float sum16(f32x16 v) {
  f32x8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  f32x4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// The sums of 16 vectors at once: lane j of the result is sum16(v[j]). A butterfly of shuffles and
// adds, 15 of each pair, where 16 separate sum16 calls take ~8 operations apiece.
inline f32x16 sum16x16(const f32x16* v) {
  f32x16 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {
    a[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int i = 0; i < 4; ++i) {
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
  for (int i = 0; i < 2; ++i) {
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  }
  return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// exp of 16 floats: 2^k * p(r), x = k ln2 + r, |r| <= ln2 / 2, p a degree-6 polynomial (relative error
// ~2e-7, as libm's expf). Past log(FLT_MAX) the result is +inf; below -87 it stays e^-87 (a normal
// float: subnormal results are ~10x slower on x86): nothing next to the 1 that softmax adds it to, or
// the 1 of silu's 1 + e^-x.
inline f32x16 exp16(f32x16 x) {
  const f32x16 lo = f32x16{} - 87.f, hi = f32x16{} + 88.f;
  const auto overflow = x > 88.72283935546875f;  // past log(FLT_MAX): +inf, as expf gives
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const f32x16 k = __builtin_convertvector(__builtin_convertvector(x * 1.44269504088896341f + 0.5f - (x < 0.f ? 1.f : 0.f), i32x16), f32x16);
  const f32x16 r = (x - k * 0.693359375f) + k * 2.12194440e-4f;
  f32x16 p = f32x16{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const i32x16 bits = (__builtin_convertvector(k, i32x16) + 127) << 23;
  f32x16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  const f32x16 inf = f32x16{} + std::numeric_limits<float>::infinity();
  return overflow ? inf : p * scale;
}

// Runs worker(next) on every thread, where next(begin, end) hands out the next `grain` of n items
// (false when none are left): whichever thread is free takes the next chunk. ATen's parallel_for
// splits a range evenly up front, and on a shared machine one core can run at a third of the other's
// speed for seconds at a time (another tenant on its hyperthread sibling): an even split then makes
// both wait for the slow one. worker does its per-thread set-up (AMX tile config) around the loop.
template <typename Worker>
void parallel_chunks(int64_t n, int64_t grain, const Worker& worker) {
  grain = std::max<int64_t>(grain, 1);
  std::atomic<int64_t> next_item{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), (n + grain - 1) / grain);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    worker([&](int64_t& begin, int64_t& end) {
      begin = next_item.fetch_add(grain, std::memory_order_relaxed);
      end = std::min(n, begin + grain);
      return begin < n;
    });
  });
}

inline float round_to(float x, float) { return x; }
inline float round_to(float x, c10::BFloat16) { return static_cast<float>(static_cast<c10::BFloat16>(x)); }
inline float round_to(float x, c10::Half) { return static_cast<float>(static_cast<c10::Half>(x)); }

inline f32x16 round_to(f32x16 v, float) { return v; }
inline f32x16 round_to(f32x16 v, c10::BFloat16) {
  u32x16 bits;
  std::memcpy(&bits, &v, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  bits &= 0xFFFF0000u;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}
inline f32x16 round_to(f32x16 v, c10::Half) {
  for (int i = 0; i < 16; ++i) v[i] = round_to(v[i], c10::Half());
  return v;
}

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

#if PAGEDLLM_HAS_AMX
// AMX tile set-up shared by packed_linear.cpp and decode_attention.cpp.
bool request_amx() {
  // Linux hands out the 8 KB tile register state only to processes that ask for it.
  static const bool granted = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}
#endif

// PAGEDLLM_CPU_ISA below amx turns AMX off (model_executor/cpu_isa.py, through set_amx_allowed): the
// kernels then take the paths of a CPU without it.
std::atomic<bool> amx_allowed{true};

// The AMX paths run: this build has them, the OS granted the tiles and nothing turned them off.
bool amx_enabled() {
#if PAGEDLLM_HAS_AMX
  return amx_allowed.load(std::memory_order_relaxed) && request_amx();
#else
  return false;
#endif
}

#if PAGEDLLM_HAS_AMX

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile the kernels use is 16 rows x 64 bytes: C tiles (16 x 16 fp32), bf16 operand tiles
// (16 rows x 32 values, or 16 K pairs x 16 columns x 2).
void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}
#endif  // PAGEDLLM_HAS_AMX

// What both paged attention kernels ask of q (tokens, heads, dim) and the caches (kv_heads, slots, dim), and
// their sinks: None, or (heads,) logits, returned as float32 (an undefined tensor for None).
inline at::Tensor check_paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                        int64_t block_size, int64_t window, const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "q and the caches must be 3-D");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "the KV cache must be in the query's dtype");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(2) == 1 && v_cache.stride(2) == 1, "rows must be contiguous");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(q.size(2) == k_cache.size(2) && v_cache.sizes() == k_cache.sizes(), "q, K and V share one head size");
  TORCH_CHECK(block_size >= 1, "block_size must be >= 1");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none)");
  if (!sinks.has_value()) return at::Tensor();
  TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == q.size(1), "sinks must be (heads,)");
  return sinks->to(at::kFloat).contiguous();
}

}  // namespace

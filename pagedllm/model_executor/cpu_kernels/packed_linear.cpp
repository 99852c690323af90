// Linear layers over a bfloat16 weight packed once for the CPU's matrix units (AMX tiles and
// AVX512-BF16 dot products, or AVX2 FMAs), one layout for every batch size.
//
// Layout: a (N, K) weight becomes (N/16, K/2, 16, 2): column block nb holds, for each pair of K, its 16
// output columns' two values side by side. That is the "VNNI" operand that TDPBF16PS (AMX) and
// VDPBF16PS (AVX-512) both read, and each column block is one contiguous run of memory:
//   - few rows (decode at small batch): every 64-byte load is 16 columns x one K pair, used for all
//     rows; four column blocks in flight keep four independent streams for the prefetchers. This reads
//     the weight at the machine's memory bandwidth, where oneDNN's GEMV reads at ~60% of it.
//   - more rows: AMX tiles, weight tiles prefetched a few tiles ahead. Up to 32 rows every row tile is
//     multiplied by each weight tile as it arrives (the weight is read once); 33-64 rows, 32 x 32 output
//     blocks in two row passes; beyond that, 32 x 32 output blocks over row bands that stay in cache.
// The embedding of a tied LM head reads its rows back out of the same packed weight.
// On CPUs with neither (AVX2 + FMA only, e.g. AMD Zen 3) the same layout feeds fp32 FMAs, the bf16
// widened in registers (the fma_* functions below).
#include "common.h"

namespace {

constexpr int64_t kColumnBlock = 16;  // output columns per packed block (an AMX tile's width in fp32)
constexpr int64_t kTileK = 32;        // K elements per tile (64 bytes of bf16)
constexpr int64_t kDotMaxRows = 4;    // up to this many rows the AVX-512 dot product path runs
constexpr int64_t kRowBand = 256;     // rows per band (their x tiles stay in L2) beyond 64 rows
constexpr int64_t kPrefetchTiles = 4; // how far ahead weight tiles are prefetched
constexpr int64_t kChunkBytes = 512 << 10;  // weight bytes per chunk of work handed to a thread (longer
                                            // runs stream faster: 6 Linears + LM head at 64 rows, 473 vs
                                            // 443 GFLOP/s against 128 KB chunks; 1 MB 481, 256 KB 461)

// Items per chunk when each item reads `item_bytes` of the weight.
inline int64_t chunk_items(int64_t item_bytes) { return std::max<int64_t>(1, kChunkBytes / item_bytes); }

// 16 fp32 sums (+ bias) rounded to bf16 at out.
inline void store_columns(const float* sums, const float* bias, c10::BFloat16* out) {
  f32x16 v = load16(sums);
  if (bias != nullptr) v += load16(bias);
  store16(out, v);
}

// SiLU(gate) * up from a gate block's and its up block's 16 sums, rounded where F.silu(gate) * up
// rounds in bfloat16 (gate and up as the Linear's outputs, the SiLU, the product): the same bits as
// silu_and_mul over the Linear's output.
inline void store_silu_mul(const float* gate_sums, const float* up_sums, const float* bias, c10::BFloat16* out) {
  f32x16 gate = load16(gate_sums), up = load16(up_sums);
  if (bias != nullptr) {
    gate += load16(bias);
    up += load16(bias + 16);
  }
  gate = round_to(gate, c10::BFloat16());
  up = round_to(up, c10::BFloat16());
  store16(out, round_to(gate / (1.f + exp16(-gate)), c10::BFloat16()) * up);
}

// Where the outputs of column block nb go. A plain Linear writes each block's 16 columns; with
// kSiluMul the weight's blocks alternate gate, up (_pack_for_amx in layers.py) and the pair (2j, 2j+1)
// becomes output columns 16j .. 16j + 15.
template <bool kSiluMul>
struct Output {
  c10::BFloat16* y;
  int64_t n_out;  // output row stride
  const float* bias;

  // sums: 16 floats for block nb, followed (kSiluMul, nb even) by its up block's at next.
  void store(const float* sums, const float* next, int64_t row, int64_t nb) const {
    const float* b = bias == nullptr ? nullptr : bias + nb * kColumnBlock;
    if constexpr (kSiluMul) {
      store_silu_mul(sums, next, b, y + row * n_out + nb / 2 * kColumnBlock);
    } else {
      store_columns(sums, b, y + row * n_out + nb * kColumnBlock);
    }
  }
};

#if PAGEDLLM_HAS_AMX

inline void prefetch_weight_tile(const uint16_t* tile) {
  const char* p = reinterpret_cast<const char*>(tile);
  for (int i = 0; i < 1024; i += 64) _mm_prefetch(p + i, _MM_HINT_T0);
}

// The rows row0 .. (those below m) of 16 x 16 C tiles stored row-major: c for block nb (and, with
// kSiluMul, c_up for block nb + 1).
template <bool kSiluMul>
inline void store_tile(const Output<kSiluMul>& out, const float* c, const float* c_up, int64_t row0, int64_t m,
                       int64_t nb) {
  for (int64_t r = 0; r < 16 && row0 + r < m; ++r)
    out.store(c + r * 16, c_up == nullptr ? nullptr : c_up + r * 16, row0 + r, nb);
}

template <int M, bool kSiluMul>
void dot_rows(const uint32_t* x, int64_t kp, const uint16_t* w, const Output<kSiluMul>& out, int64_t n_blocks) {
  // Column blocks at once: independent sums and streams (an even count: gate / up pairs stay together).
  constexpr int kBlocks = M == 1 ? 4 : 2;
  parallel_chunks((n_blocks + kBlocks - 1) / kBlocks, chunk_items(kBlocks * kp * 64), [&](const auto& next) {
    int64_t begin, end;
    while (next(begin, end)) {
      for (int64_t group = begin; group < end; ++group) {
        const int64_t nb0 = group * kBlocks;
        const int blocks = static_cast<int>(std::min<int64_t>(kBlocks, n_blocks - nb0));
        const uint16_t* base = w + nb0 * kp * 32;
        __m512 acc[kBlocks][M];
        for (int b = 0; b < kBlocks; ++b)
          for (int r = 0; r < M; ++r) acc[b][r] = _mm512_setzero_ps();
        if (blocks == kBlocks) {
          for (int64_t i = 0; i < kp; ++i) {
            __m512bh xs[M];
            for (int r = 0; r < M; ++r) xs[r] = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * kp + i]));
            for (int b = 0; b < kBlocks; ++b) {
              const __m512bh wv = (__m512bh)_mm512_loadu_si512(base + (b * kp + i) * 32);
              for (int r = 0; r < M; ++r) acc[b][r] = _mm512_dpbf16_ps(acc[b][r], xs[r], wv);
            }
          }
        } else {  // the last, partial group
          for (int b = 0; b < blocks; ++b)
            for (int64_t i = 0; i < kp; ++i) {
              const __m512bh wv = (__m512bh)_mm512_loadu_si512(base + (b * kp + i) * 32);
              for (int r = 0; r < M; ++r)
                acc[b][r] = _mm512_dpbf16_ps(acc[b][r], (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * kp + i])), wv);
            }
        }
        for (int b = 0; b < blocks; b += kSiluMul ? 2 : 1) {
          for (int r = 0; r < M; ++r) {
            alignas(64) float sums[2][16];
            _mm512_store_ps(sums[0], acc[b][r]);
            if (kSiluMul) _mm512_store_ps(sums[1], acc[b + 1][r]);
            out.store(sums[0], sums[1], r, nb0 + b);
          }
        }
      }
    }
  });
}

// A column block's sums waiting in C buffers to be written out (+ bias, rounded, SiLU * up): done a few
// rows at a time between the next block's tile instructions, so the vector work of the output runs
// while the matrix unit multiplies instead of after it (AMX and AVX-512 execute side by side).
template <bool kSiluMul>
struct PendingBlock {
  const float (*c)[16 * 16] = nullptr;     // MT C tiles, row-major
  const float (*c_up)[16 * 16] = nullptr;  // kSiluMul: the up block's
  int64_t nb = -1, rows = 0, done = 0, row0 = 0;

  // Writes rows done .. upto (capped at rows).
  void write(const Output<kSiluMul>& out, int64_t upto) {
    if (nb < 0) return;
    for (upto = std::min(upto, rows); done < upto; ++done)
      out.store(c[done / 16] + done % 16 * 16, kSiluMul ? c_up[done / 16] + done % 16 * 16 : nullptr, row0 + done,
                nb);
  }
};

// One 32 x 32 output block over all of k into C tiles 0-3 (0 / 1: the 16 rows at a0 times column
// blocks b0 / b1; 2 / 3: the next 16 rows), x tiles 4-5, weight tiles 6-7. `from_memory` prefetches
// the weight ahead; `each_step()` runs after every k step.
template <typename Step>
inline void multiply_32x32(const c10::BFloat16* a0, int64_t k, const uint16_t* b0, const uint16_t* b1, bool two_rows,
                           bool two_cols, bool from_memory, const Step& each_step) {
  const int64_t x_stride = k * 2;
  const c10::BFloat16* a1 = a0 + 16 * k;
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t kk = 0; kk < k; kk += kTileK) {
    if (from_memory) {
      prefetch_weight_tile(b0 + (kk + kPrefetchTiles * kTileK) * 16);
      if (two_cols) prefetch_weight_tile(b1 + (kk + kPrefetchTiles * kTileK) * 16);
    }
    _tile_loadd(6, b0 + kk * 16, 64);
    _tile_loadd(4, a0 + kk, x_stride);
    _tile_dpbf16ps(0, 4, 6);
    if (two_cols) { _tile_loadd(7, b1 + kk * 16, 64); _tile_dpbf16ps(1, 4, 7); }
    if (two_rows) {
      _tile_loadd(5, a1 + kk, x_stride);
      _tile_dpbf16ps(2, 5, 6);
      if (two_cols) _tile_dpbf16ps(3, 5, 7);
    }
    each_step();
  }
}

// 33-64 rows: 32 x 32 output blocks (2 row tiles x a pair of column blocks, one tile load per multiply
// where one row tile per column block needs 1.25), two row passes over each pair (the second reads the
// weight from cache), each pass's output written during the next pass's multiplies. Batch-64 decode
// steps, both paths alternating in one engine (67 fast-state rounds): median 98.2 against 102.7 ms.
template <bool kSiluMul>
void amx_pairs(const c10::BFloat16* x, int64_t m_pad, int64_t k, const uint16_t* w, const Output<kSiluMul>& out,
               int64_t m, int64_t n_blocks) {
  const int64_t kp = k / 2, steps = k / kTileK;
  const int64_t n_pairs = (n_blocks + 1) / 2;
  const int64_t per_step = (32 + steps - 1) / steps;
  parallel_chunks(n_pairs, chunk_items(2 * kp * 64), [&](const auto& next) {
    configure_tiles();
    alignas(64) float c[2][2][2][16 * 16];  // [buffer][block of the pair][row tile]
    PendingBlock<kSiluMul> pend[2];
    int buf = 0;
    auto write_some = [&](int64_t more) {
      pend[0].write(out, pend[0].done + more);
      if (!kSiluMul) pend[1].write(out, pend[1].done + more);
    };
    int64_t begin, end;
    while (next(begin, end)) {
      for (int64_t pair = begin; pair < end; ++pair) {
        const int64_t nb0 = pair * 2;
        const bool two_cols = nb0 + 1 < n_blocks;
        const uint16_t* b0 = w + nb0 * kp * 32;
        const uint16_t* b1 = b0 + kp * 32;
        for (int64_t m0 = 0; m0 < m_pad; m0 += 32) {
          const bool two_rows = m0 + 16 < m_pad;
          multiply_32x32(x + m0 * k, k, b0, b1, two_rows, two_cols, m0 == 0, [&] { write_some(per_step); });
          _tile_stored(0, c[buf][0][0], 64); _tile_stored(1, c[buf][1][0], 64);
          _tile_stored(2, c[buf][0][1], 64); _tile_stored(3, c[buf][1][1], 64);
          write_some(64);
          const int64_t rows = std::max<int64_t>(0, std::min<int64_t>(32, m - m0));
          if (kSiluMul) {
            pend[0] = {c[buf][0], c[buf][1], nb0, rows, 0, m0};
          } else {
            pend[0] = {c[buf][0], nullptr, nb0, rows, 0, m0};
            pend[1] = two_cols ? PendingBlock<kSiluMul>{c[buf][1], nullptr, nb0 + 1, rows, 0, m0}
                               : PendingBlock<kSiluMul>{};
          }
          buf ^= 1;
        }
      }
    }
    write_some(64);
    _tile_release();
  });
}

// Up to 32 rows (MT row tiles, x zero-padded to MT * 16 rows): one column block at a time, each
// weight tile (tile 6) loaded once and multiplied by every x tile (4 and 5 in turn) into C tiles
// 0..MT-1 (MT <= 2). Each k step also writes `per_step` rows of the previous block's output.
template <int MT, bool kSiluMul>
inline void multiply_column_block(const c10::BFloat16* x, int64_t k, const uint16_t* b, float (*c)[16 * 16],
                                  PendingBlock<kSiluMul>& pending, const Output<kSiluMul>& out, int64_t per_step) {
  const int64_t x_stride = k * 2;
  _tile_zero(0);
  if (MT > 1) _tile_zero(1);
  for (int64_t kk = 0; kk < k; kk += kTileK) {
    prefetch_weight_tile(b + (kk + kPrefetchTiles * kTileK) * 16);  // may run past the end: harmless
    _tile_loadd(6, b + kk * 16, 64);
    _tile_loadd(4, x + kk, x_stride);
    _tile_dpbf16ps(0, 4, 6);
    if (MT > 1) { _tile_loadd(5, x + 16 * k + kk, x_stride); _tile_dpbf16ps(1, 5, 6); }
    pending.write(out, pending.done + per_step);
  }
  _tile_stored(0, c[0], 64);
  if (MT > 1) _tile_stored(1, c[1], 64);
}

template <int MT, bool kSiluMul>
void amx_column_blocks(const c10::BFloat16* x, int64_t k, const uint16_t* w, const Output<kSiluMul>& out, int64_t m,
                       int64_t n_blocks) {
  const int64_t kp = k / 2;
  constexpr int kStep = kSiluMul ? 2 : 1;  // a gate block and its up block together
  // The previous block's m rows spread over this block's k / 32 (x kStep) steps.
  const int64_t per_step = (m + kStep * (k / kTileK) - 1) / (kStep * (k / kTileK));
  parallel_chunks(n_blocks / kStep, chunk_items(kStep * kp * 64), [&](const auto& next) {
    configure_tiles();
    alignas(64) float c[2][2][2][16 * 16];  // [double buffer][block, its up block][row tile]
    PendingBlock<kSiluMul> pending;
    int buf = 0;
    int64_t begin, end;
    while (next(begin, end)) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t nb = i * kStep;
        multiply_column_block<MT>(x, k, w + nb * kp * 32, c[buf][0], pending, out, per_step);
        if (kSiluMul) multiply_column_block<MT>(x, k, w + (nb + 1) * kp * 32, c[buf][1], pending, out, per_step);
        pending.write(out, m);  // whatever the steps left
        pending = {c[buf][0], c[buf][1], nb, m, 0};
        buf ^= 1;
      }
    }
    pending.write(out, m);
    _tile_release();
  });
}

// More rows (x zero-padded to m_pad, a multiple of 16): 32 x 32 output blocks, C tiles 0-3 (2 row
// tiles x 2 column blocks), x tiles 4-5, weight tiles 6-7. Rows go in bands of kRowBand, so a band's
// x stays in cache while the weight streams past it; the threads take (band, column pair) items band
// by band, so they work on the same band at a time.
template <bool kSiluMul>
void amx_row_bands(const c10::BFloat16* x, int64_t m_pad, int64_t k, const uint16_t* w, const Output<kSiluMul>& out,
                   int64_t m, int64_t n_blocks) {
  const int64_t kp = k / 2;
  const int64_t n_pairs = (n_blocks + 1) / 2, n_bands = (m_pad + kRowBand - 1) / kRowBand;
  parallel_chunks(n_bands * n_pairs, chunk_items(2 * kp * 64), [&](const auto& next) {
    configure_tiles();
    alignas(64) float c[4][16 * 16];
    int64_t begin, end;
    while (next(begin, end)) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t band = item / n_pairs * kRowBand, pair = item % n_pairs;
        const int64_t band_end = std::min(m_pad, band + kRowBand);
        const int64_t nb0 = pair * 2;
        const bool two_cols = nb0 + 1 < n_blocks;
        const uint16_t* b0 = w + nb0 * kp * 32;
        const uint16_t* b1 = b0 + kp * 32;
        for (int64_t m0 = band; m0 < band_end; m0 += 32) {
          const bool two_rows = m0 + 16 < band_end;
          // The first pass over these columns reads them from memory.
          multiply_32x32(x + m0 * k, k, b0, b1, two_rows, two_cols, m0 == band, [] {});
          _tile_stored(0, c[0], 64); _tile_stored(1, c[1], 64);
          _tile_stored(2, c[2], 64); _tile_stored(3, c[3], 64);
          if (kSiluMul) {  // (nb0, nb0 + 1) is a gate block and its up block
            store_tile(out, c[0], c[1], m0, m, nb0);
            if (two_rows) store_tile(out, c[2], c[3], m0 + 16, m, nb0);
          } else {
            for (int nt = 0; nt < (two_cols ? 2 : 1); ++nt) {
              store_tile(out, c[nt], nullptr, m0, m, nb0 + nt);
              if (two_rows) store_tile(out, c[2 + nt], nullptr, m0 + 16, m, nb0 + nt);
            }
          }
        }
      }
    }
    _tile_release();
  });
}

#endif  // PAGEDLLM_HAS_AMX

// ---- Without bf16 arithmetic (AVX2 + FMA, e.g. AMD Zen 3): the same packed weight, read in bf16 ----
// Each 64-byte load of a column block holds 16 columns x one K pair as 32-bit words (even K in the low
// half, odd K in the high half): a shift and a mask make them two vectors of fp32 (bf16 is the top half
// of an fp32), multiplied by the rows' broadcast x in fp32 FMAs. The weight is never written back as
// fp32 (what F.linear's fp32 route needs: a converted copy per call), and at few rows it streams at
// memory bandwidth, where PyTorch's bf16 product on such a CPU is a scalar fallback.
#if defined(__FMA__) && defined(__AVX2__)
#define PAGEDLLM_HAS_FMA_LINEAR 1
#else
#define PAGEDLLM_HAS_FMA_LINEAR 0
#endif

#if PAGEDLLM_HAS_FMA_LINEAR
typedef uint32_t u32x8 __attribute__((vector_size(32)));

// Register tiles (rows x column blocks), 24 layers of Qwen2.5-0.5B's Linears, 2-core Zen 3: from 5 rows
// 4 x 2 (64 rows: 137 GFLOP/s; 6 x 1: 122, 5 x 1: 131, 3 x 2: 138, within noise of 4 x 2); 4 rows
// 4 x 2 (28-31 ms; 4 x 1: 46-48, 2 x 2: 39); 2-3 rows x 4 blocks (2 x 2, 3 x 2: ~1 ms slower).
constexpr int kFmaRowTile = 4;
constexpr int64_t kFmaRowBand = 128;    // rows whose fp32 x stays in cache while a column group streams

// sums[r][b * 16 + c] (row stride sums_stride) = rows 0..M-1 of x (fp32, row stride x_stride) times
// column blocks 0..B-1 at w, over all kp K pairs. M x B x 2 accumulators of 8 lanes.
template <int M, int B>
inline void fma_tile(const float* x, int64_t x_stride, const uint32_t* w, int64_t kp, float* sums,
                     int64_t sums_stride) {
  f32x8 acc[M][B][2];
  for (int r = 0; r < M; ++r)
    for (int b = 0; b < B; ++b) acc[r][b][0] = acc[r][b][1] = f32x8{};
  for (int64_t i = 0; i < kp; ++i) {
    for (int b = 0; b < B; ++b) {
      for (int h = 0; h < 2; ++h) {
        u32x8 v;
        std::memcpy(&v, w + (b * kp + i) * 16 + h * 8, sizeof v);
        const f32x8 even = (f32x8)(v << 16), odd = (f32x8)(v & 0xFFFF0000u);
        for (int r = 0; r < M; ++r) acc[r][b][h] += even * x[r * x_stride + 2 * i] + odd * x[r * x_stride + 2 * i + 1];
      }
    }
  }
  for (int r = 0; r < M; ++r)
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < 2; ++h) std::memcpy(sums + r * sums_stride + b * 16 + h * 8, &acc[r][b][h], sizeof(f32x8));
}

// A tile of 1-4 rows and one column block: the ragged end of a row band, or a group's last blocks.
inline void fma_tile_rows(int rows, const float* x, int64_t x_stride, const uint32_t* w, int64_t kp, float* sums,
                          int64_t sums_stride) {
  switch (rows) {
    case 1: fma_tile<1, 1>(x, x_stride, w, kp, sums, sums_stride); break;
    case 2: fma_tile<2, 1>(x, x_stride, w, kp, sums, sums_stride); break;
    case 3: fma_tile<3, 1>(x, x_stride, w, kp, sums, sums_stride); break;
    default: fma_tile<4, 1>(x, x_stride, w, kp, sums, sums_stride); break;
  }
}

// x (m, k) fp32 times the packed weight: work items are (row band, group of G column blocks), each
// band's rows in tiles of MR rows x B blocks (the weight group read from cache after the first tile).
// G is at least 2 so a gate block and its up block (kSiluMul) are stored together.
template <int MR, int B, bool kSiluMul>
void fma_product(const float* x, int64_t m, int64_t k, const uint32_t* w, const Output<kSiluMul>& out,
                 int64_t n_blocks) {
  static_assert(MR <= 4, "fma_tile_rows takes the ragged ends: up to 4 rows");
  constexpr int G = B < 2 ? 2 : B;
  const int64_t kp = k / 2, n_groups = (n_blocks + G - 1) / G, n_bands = (m + kFmaRowBand - 1) / kFmaRowBand;
  const int64_t items = n_bands * n_groups;
  // Few rows: the weight streams, chunks sized by bytes; more: compute-bound, ~8 chunks per thread.
  const int64_t grain = m <= 4 ? chunk_items(G * kp * 64)
                               : std::max<int64_t>(1, items / (8 * at::get_num_threads()));
  parallel_chunks(items, grain, [&](const auto& next) {
    alignas(64) float sums[MR][G * 16];
    int64_t begin, end;
    while (next(begin, end)) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t band = item / n_groups, nb0 = item % n_groups * G;
        const int blocks = static_cast<int>(std::min<int64_t>(G, n_blocks - nb0));
        const int64_t band_end = std::min(m, (band + 1) * kFmaRowBand);
        for (int64_t r0 = band * kFmaRowBand; r0 < band_end; r0 += MR) {
          const int rows = static_cast<int>(std::min<int64_t>(MR, band_end - r0));
          for (int b = 0; b < blocks; b += B) {
            const uint32_t* wb = w + (nb0 + b) * kp * 16;
            if (rows == MR && b + B <= blocks) {
              fma_tile<MR, B>(x + r0 * k, k, wb, kp, &sums[0][b * 16], G * 16);
            } else {
              for (int bb = b; bb < std::min(b + B, blocks); ++bb)
                fma_tile_rows(rows, x + r0 * k, k, wb + (bb - b) * kp * 16, kp, &sums[0][bb * 16], G * 16);
            }
          }
          for (int r = 0; r < rows; ++r)
            for (int b = 0; b < blocks; b += kSiluMul ? 2 : 1)
              out.store(&sums[r][b * 16], kSiluMul ? &sums[r][(b + 1) * 16] : nullptr, r0 + r, nb0 + b);
        }
      }
    }
  });
}

template <bool kSiluMul>
void fma_multiply(const at::Tensor& x, int64_t m, int64_t k, const uint16_t* w16, const Output<kSiluMul>& out,
                  int64_t n_blocks) {
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  const auto* w = reinterpret_cast<const uint32_t*>(w16);
  switch (m) {  // few rows: every row in one tile (the weight read once), enough blocks for 8+ sums
    case 1: fma_product<1, 4>(xp, m, k, w, out, n_blocks); break;
    case 2: fma_product<2, 4>(xp, m, k, w, out, n_blocks); break;
    case 3: fma_product<3, 4>(xp, m, k, w, out, n_blocks); break;
    case 4: fma_product<4, 2>(xp, m, k, w, out, n_blocks); break;
    default: fma_product<kFmaRowTile, 2>(xp, m, k, w, out, n_blocks); break;
  }
}
#endif  // PAGEDLLM_HAS_FMA_LINEAR

void check_packed(const at::Tensor& packed) {
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 && packed.size(2) == kColumnBlock &&
                  packed.size(3) == 2 && packed.size(1) % (kTileK / 2) == 0 && packed.is_contiguous(),
              "packed must be a weight from pack_linear_weight: contiguous bfloat16 (N/16, K/2, 16, 2)");
}

}  // namespace

// True when this build has the AMX / AVX512-BF16 kernels, the OS lets this process use AMX tiles and
// set_amx_allowed has not turned them off.
bool packed_linear_supported() { return amx_enabled(); }

// Whether packed products may use AMX (true at load); false: they take the AVX2 / FMA path.
void set_amx_allowed(bool allowed) { amx_allowed.store(allowed, std::memory_order_relaxed); }

// What this machine and build can do, whatever set_amx_allowed says: the AMX kernels and the tiles.
bool amx_available() {
#if PAGEDLLM_HAS_AMX
  return request_amx();
#else
  return false;
#endif
}

// True when this build has the AVX2 / FMA path (used where packed_linear_supported() is false).
bool packed_linear_fma_supported() { return PAGEDLLM_HAS_FMA_LINEAR; }

// weight: (N, K) bfloat16 with N % 16 == 0 and K % 32 == 0 -> the packed (N/16, K/2, 16, 2) layout.
at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 && weight.size(0) % kColumnBlock == 0 &&
                  weight.size(1) % kTileK == 0,
              "pack_linear_weight takes a bfloat16 (N, K) weight with N % 16 == 0 and K % 32 == 0, got ",
              weight.scalar_type(), " ", weight.sizes());
  const int64_t n = weight.size(0), k = weight.size(1);
  return weight.contiguous().view({n / kColumnBlock, kColumnBlock, k / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

namespace {

#if PAGEDLLM_HAS_AMX
// Picks the path by row count; x: (m, k) contiguous.
template <bool kSiluMul>
void multiply(const at::Tensor& x, int64_t m, int64_t k, const uint16_t* w, const Output<kSiluMul>& out,
              int64_t n_blocks) {
  if (m <= kDotMaxRows) {
    const auto* x32 = reinterpret_cast<const uint32_t*>(x.data_ptr<c10::BFloat16>());
    switch (m) {
      case 1: dot_rows<1>(x32, k / 2, w, out, n_blocks); break;
      case 2: dot_rows<2>(x32, k / 2, w, out, n_blocks); break;
      case 3: dot_rows<3>(x32, k / 2, w, out, n_blocks); break;
      default: dot_rows<4>(x32, k / 2, w, out, n_blocks); break;
    }
    return;
  }
  const int64_t m_pad = (m + 15) / 16 * 16;
  at::Tensor x_pad = x;
  if (m_pad != m) {  // tiles load 16 rows: zero rows fill the last one
    x_pad = at::zeros({m_pad, k}, x.options());
    x_pad.narrow(0, 0, m).copy_(x);
  }
  const auto* xp = x_pad.data_ptr<c10::BFloat16>();
  switch (m_pad / 16) {
    case 1: amx_column_blocks<1>(xp, k, w, out, m, n_blocks); break;
    case 2: amx_column_blocks<2>(xp, k, w, out, m, n_blocks); break;
    case 3:
    case 4: amx_pairs(xp, m_pad, k, w, out, m, n_blocks); break;
    default: amx_row_bands(xp, m_pad, k, w, out, m, n_blocks); break;
  }
}
#endif

template <bool kSiluMul>
at::Tensor packed_product(const at::Tensor& x_in, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  const bool amx = packed_linear_supported();
  TORCH_CHECK(amx || packed_linear_fma_supported(),
              "packed_linear needs AMX and AVX512-BF16, or AVX2 and FMA (see packed_linear_supported)");
  check_packed(packed);
  const int64_t n_blocks = packed.size(0), n = n_blocks * kColumnBlock, k = packed.size(1) * 2;
  TORCH_CHECK(!kSiluMul || n_blocks % 2 == 0, "a gate / up weight has an even number of 16-column blocks");
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && x_in.dim() >= 1 && x_in.size(-1) == k,
              "x must be bfloat16 (..., ", k, "), got ", x_in.scalar_type(), " ", x_in.sizes());
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous(),
                "bias must be a contiguous float32 (", n, ",) vector");
    bp = bias->data_ptr<float>();
  }
  const at::Tensor x = x_in.contiguous();
  const int64_t m = x.numel() / k, n_out = kSiluMul ? n / 2 : n;
  auto out_shape = x.sizes().vec();
  out_shape.back() = n_out;
  at::Tensor y = at::empty(out_shape, x.options());
  if (m == 0) return y;
  const Output<kSiluMul> out{y.data_ptr<c10::BFloat16>(), n_out, bp};
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>());
#if PAGEDLLM_HAS_AMX
  if (amx) {
    multiply(x.view({m, k}), m, k, w, out, n_blocks);
    return y;
  }
#endif
#if PAGEDLLM_HAS_FMA_LINEAR
  fma_multiply(x.view({m, k}), m, k, w, out, n_blocks);
#endif
  return y;
}

}  // namespace

// y = x @ W^T + bias for x (..., K) bfloat16, the packed W, bias None or (N,) float32. Returns (..., N) bfloat16.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  return packed_product<false>(x, packed, bias);
}

// SiLU(gate) * up of an MLP's gate / up Linear in one pass: `packed` holds the weight with its gate and
// up 16-row blocks alternating (gate rows 0-15, up rows 0-15, gate rows 16-31, ...; bias alike).
// Returns (..., N / 2), the same bits as silu_and_mul(packed_linear(...)) in the plain order.
at::Tensor packed_linear_silu_mul(const at::Tensor& x, const at::Tensor& packed,
                                  const c10::optional<at::Tensor>& bias) {
  return packed_product<true>(x, packed, bias);
}

// The rows of the weight that `packed` was made from, for token ids (any shape): an embedding that
// shares its table with a packed LM head. Returns ids.shape + (K,) bfloat16.
at::Tensor packed_embedding(const at::Tensor& ids_in, const at::Tensor& packed) {
  check_packed(packed);
  TORCH_CHECK(ids_in.scalar_type() == at::kLong || ids_in.scalar_type() == at::kInt, "ids must be int64 or int32");
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  const int64_t n = packed.size(0) * kColumnBlock, kp = packed.size(1), count = ids.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < count; ++t)
    TORCH_CHECK(id[t] >= 0 && id[t] < n, "token id ", id[t], " is out of range for an embedding of ", n, " rows");
  auto out_shape = ids.sizes().vec();
  out_shape.push_back(kp * 2);
  at::Tensor out = at::empty(out_shape, packed.options());
  const auto* w = reinterpret_cast<const uint32_t*>(packed.data_ptr<c10::BFloat16>());
  auto* o = reinterpret_cast<uint32_t*>(out.data_ptr<c10::BFloat16>());
  at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint32_t* column = w + (id[t] / kColumnBlock) * kp * kColumnBlock + id[t] % kColumnBlock;
      for (int64_t i = 0; i < kp; ++i) o[t * kp + i] = column[i * kColumnBlock];  // one K pair per 64 bytes
    }
  });
  return out;
}

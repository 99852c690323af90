// Decode attention straight from the paged, head-major KV cache: one query per sequence, its keys
// read block by block through the block table, no gathered copy of K/V. Parallel over (sequence, KV
// head), one item at a time to whichever thread is free; the query heads that share a KV head (GQA)
// read each key and value row once.
// Scores, softmax and the weighted sum of values are computed in float32; the output is rounded once.
// A sliding window (gpt-oss, Mistral) starts the keys at len - window (the tiles before it are not read; a
// tile's keys before it are masked); attention sinks (gpt-oss) add exp(sink) of each query head to its
// softmax's denominator (the sink joins the maximum, as transformers concatenates it to the scores).
// In bfloat16 on a CPU with AMX (block size a multiple of 16, head size a multiple of 32), the scores
// take the matrix unit: each 16 keys of a block are one tile read straight from the cache, multiplied
// by the group's queries laid out as the VNNI operand; the products are exact in float32, the sums
// in another order than the vector path's.
#include "common.h"

#include <type_traits>

namespace {

#if PAGEDLLM_HAS_AMX
// The group's queries as TDPBF16PS's second operand: chunk c of 32 dims is 16 rows (dim pairs) x 16
// columns (query heads) x 2; heads past the group stay 0. qt holds NC / 2 such 1 KB tiles.
template <int NC>
void queries_as_tiles(const c10::BFloat16* q, int64_t q_head, int64_t group, uint32_t (*qt)[16][16]) {
  std::memset(qt, 0, NC / 2 * sizeof(*qt));
  for (int64_t g = 0; g < group; ++g) {
    const auto* pairs = reinterpret_cast<const uint32_t*>(q + g * q_head);  // one dim pair per word
    for (int i = 0; i < NC * 8; ++i) qt[i / 16][i % 16][g] = pairs[i];
  }
}

// 16 keys' scores against every head of the group: scores[j * 16 + g] = k_j . q_g, where k_j is the
// j-th of 16 consecutive cache rows from `keys` (rows `k_slot` elements apart).
template <int NC>
inline void score_tile(const c10::BFloat16* keys, int64_t k_slot, const uint32_t (*qt)[16][16], float* scores) {
  _tile_zero(0);
  for (int c = 0; c < NC / 2; ++c) {
    _tile_loadd(1, keys + 32 * c, k_slot * 2);
    _tile_loadd(2, qt[c], 64);
    _tile_dpbf16ps(0, 1, 2);
  }
  _tile_stored(0, scores, 64);
}
#endif

// NC: head_dim / 16, a constant so a key or value row stays in registers.
template <typename T, int NC>
void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_table, const at::Tensor& key_lens, double scale,
                      int64_t block_size, int64_t window, const float* sinks, at::Tensor& out) {
  constexpr int64_t dim = NC * 16;
  const int64_t num_seqs = q.size(0), num_heads = q.size(1);
  const int64_t num_kv_heads = k_cache.size(0);
  const int64_t group = num_heads / num_kv_heads;
  const T* q_data = q.data_ptr<T>();
  const T* k_data = k_cache.data_ptr<T>();
  const T* v_data = v_cache.data_ptr<T>();
  T* out_data = out.data_ptr<T>();
  const int64_t q_seq = q.stride(0), q_head = q.stride(1);
  const int64_t k_head = k_cache.stride(0), k_slot = k_cache.stride(1);
  const int64_t v_head = v_cache.stride(0), v_slot = v_cache.stride(1);
  const int64_t o_seq = out.stride(0), o_head = out.stride(1);
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t table_stride = block_table.stride(0);
  const int64_t* lens = key_lens.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);
  const int shift = (block_size & (block_size - 1)) == 0 ? __builtin_ctzll(block_size) : -1;
  auto prefetch_row = [](const T* row) {
    const char* bytes = reinterpret_cast<const char*>(row);
    for (int64_t off = 0; off < dim * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(bytes + off, 0, 3);
  };

#if PAGEDLLM_HAS_AMX
  const bool use_amx = std::is_same_v<T, c10::BFloat16> && NC % 2 == 0 && group <= 16 && block_size % 16 == 0 &&
                       amx_enabled();
#else
  constexpr bool use_amx = false;
#endif

  parallel_chunks(num_seqs * num_kv_heads, 1, [&](const auto& next) {
    std::vector<f32x16> query(group * NC), acc(group * NC), tile(16 * NC);
    std::vector<float> scores, inv_total(group), row_max(group);
#if PAGEDLLM_HAS_AMX
    alignas(64) uint32_t qt[NC / 2 > 0 ? NC / 2 : 1][16][16];
    if (use_amx) configure_tiles();
#endif
    int64_t first, end;
    while (next(first, end)) for (int64_t item = first; item < end; ++item) {
      const int64_t seq = item / num_kv_heads, kv = item % num_kv_heads;
      const int64_t n = lens[seq];
      const int64_t first = window > 0 ? std::max<int64_t>(0, n - window) : 0;  // the first key the query sees
      const int64_t first_tile = first / 16 * 16;  // tiles start there (16-key tiles lie inside a block)
      const int64_t* blocks = table + seq * table_stride;
      // Slot of key s: a shift and a mask for a power-of-two block size (a division costs ~40 cycles).
      auto slot_of = [&](int64_t s) {
        return shift >= 0 ? (blocks[s >> shift] << shift) | (s & (block_size - 1))
                          : blocks[s / block_size] * block_size + s % block_size;
      };
      const int64_t padded = (n + 15) / 16 * 16;
      const T* k_base = k_data + kv * k_head;
      // probs[g * p_head + s * p_key]: head g's softmax numerator for key s (inv_total[g] normalises).
      int64_t p_head = padded, p_key = 1;
#if PAGEDLLM_HAS_AMX
      if constexpr (std::is_same_v<T, c10::BFloat16>) if (use_amx) {
        scores.resize(padded * 16);  // key-major: 16 lanes = the group's heads
        queries_as_tiles<NC>(q_data + seq * q_seq + kv * group * q_head, q_head, group, qt);
        for (int64_t s0 = first_tile; s0 < n; s0 += 16) {
          for (int64_t s = s0 == first_tile ? s0 + 16 : s0 + 32; s < std::min<int64_t>(s0 + 48, n); ++s) {
            prefetch_row(k_base + slot_of(s) * k_slot);
          }
          score_tile<NC>(k_base + slot_of(s0) * k_slot, k_slot, qt, scores.data() + s0 * 16);
        }
        f32x16 mx = f32x16{} - std::numeric_limits<float>::infinity(), sum{}, sink = mx;
        if (sinks != nullptr) {
          for (int64_t g = 0; g < group; ++g) sink[g] = sinks[kv * group + g];
          mx = sink;
        }
        for (int64_t s = first; s < n; ++s) {
          const f32x16 v = load16(scores.data() + s * 16) * fscale;
          store16(scores.data() + s * 16, v);
          mx = v > mx ? v : mx;
        }
        for (int64_t s = first; s < n; ++s) {
          const f32x16 e = exp16(load16(scores.data() + s * 16) - mx);
          store16(scores.data() + s * 16, e);
          sum += e;
        }
        if (sinks != nullptr) sum += exp16(sink - mx);
        for (int64_t g = 0; g < group; ++g) inv_total[g] = 1.f / sum[g];
        p_head = 1;
        p_key = 16;
      }
#endif
      if (p_key == 1) {  // the vector path (no AMX, other dtypes and shapes)
        scores.resize(group * padded);
        for (int64_t g = 0; g < group; ++g) {
          const T* src = q_data + seq * q_seq + (kv * group + g) * q_head;
          for (int c = 0; c < NC; ++c) query[g * NC + c] = load16(src + 16 * c) * fscale;
        }
        // Scores, 16 keys at a time: their rows are converted once into a float tile (L1-resident), then
        // each query head of the group takes 16 dot products, reduced together by sum16x16.
        std::fill(row_max.begin(), row_max.end(), -std::numeric_limits<float>::infinity());
        for (int64_t s0 = first_tile; s0 < n; s0 += 16) {
          const int keys = static_cast<int>(std::min<int64_t>(16, n - s0));
          const int skipped = static_cast<int>(std::max<int64_t>(0, first - s0));  // before the window
          // Rows two tiles ahead sit in other blocks, anywhere in the pool: start loading them now (the
          // hardware prefetcher only follows the block it is in). 64 x 2048 keys: 13.4 -> 8.5 ms.
          for (int64_t s = s0 == first_tile ? s0 + 16 : s0 + 32; s < std::min<int64_t>(s0 + 48, n); ++s) {
            prefetch_row(k_base + slot_of(s) * k_slot);
          }
          for (int j = 0; j < keys; ++j) {
            const T* src = k_base + slot_of(s0 + j) * k_slot;
            for (int c = 0; c < NC; ++c) tile[j * NC + c] = load16(src + 16 * c);
          }
          for (int j = keys; j < 16; ++j) {
            for (int c = 0; c < NC; ++c) tile[j * NC + c] = f32x16{};
          }
          for (int64_t g = 0; g < group; ++g) {
            const f32x16* qg = query.data() + g * NC;
            f32x16 dots[16];
            for (int j = 0; j < 16; ++j) {
              f32x16 dot = qg[0] * tile[j * NC];
              for (int c = 1; c < NC; ++c) dot += qg[c] * tile[j * NC + c];
              dots[j] = dot;
            }
            f32x16 block = sum16x16(dots);
            for (int j = 0; j < skipped; ++j) block[j] = -std::numeric_limits<float>::infinity();  // before the window
            for (int j = keys; j < 16; ++j) block[j] = -std::numeric_limits<float>::infinity();  // past the last key
            std::memcpy(scores.data() + g * padded + s0, &block, sizeof block);
            float mx = row_max[g];
            for (int j = 0; j < keys; ++j) mx = std::max(mx, block[j]);
            row_max[g] = mx;
          }
        }
        for (int64_t g = 0; g < group; ++g) {
          float* sg = scores.data() + g * padded;
          const float sink = sinks != nullptr ? sinks[kv * group + g] : -std::numeric_limits<float>::infinity();
          const float mx = std::max(row_max[g], sink);
          f32x16 sum{};
          for (int64_t s = first_tile; s < padded; s += 16) {
            f32x16 e = exp16(load16(sg + s) - mx);
            if (s + 16 > n) {
              for (int64_t i = n - s; i < 16; ++i) e[i] = 0.f;  // past the last key
            }
            for (int64_t i = 0; i < first - s && i < 16; ++i) e[i] = 0.f;  // before the window
            std::memcpy(sg + s, &e, sizeof e);
            sum += e;
          }
          inv_total[g] = 1.f / (sum16(sum) + (sinks != nullptr ? std::exp(sink - mx) : 0.f));
        }
      }
      // Weighted sum of values, each value row read once.
      for (auto& a : acc) a = f32x16{};
      const T* v_base = v_data + kv * v_head;
      for (int64_t s = first; s < std::min<int64_t>(first + 32, n); ++s) prefetch_row(v_base + slot_of(s) * v_slot);
      for (int64_t s = first; s < n; ++s) {
        if (s + 32 < n) prefetch_row(v_base + slot_of(s + 32) * v_slot);
        const T* src = v_base + slot_of(s) * v_slot;
        f32x16 row[NC];
        for (int c = 0; c < NC; ++c) row[c] = load16(src + 16 * c);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * p_head + s * p_key];
          f32x16* ag = acc.data() + g * NC;
          for (int c = 0; c < NC; ++c) ag[c] += p * row[c];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* dst = out_data + seq * o_seq + (kv * group + g) * o_head;
        const f32x16* ag = acc.data() + g * NC;
        for (int c = 0; c < NC; ++c) store16(dst + 16 * c, ag[c] * inv_total[g]);
      }
    }
#if PAGEDLLM_HAS_AMX
    if (use_amx) _tile_release();
#endif
  });
}

template <typename T>
void dispatch_head_dim(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_table, const at::Tensor& key_lens, double scale,
                       int64_t block_size, int64_t window, const float* sinks, at::Tensor& out) {
#define PAGEDLLM_DECODE(NC) \
  decode_attention<T, NC>(q, k_cache, v_cache, block_table, key_lens, scale, block_size, window, sinks, out)
  switch (q.size(2)) {
    case 32: return PAGEDLLM_DECODE(2);
    case 64: return PAGEDLLM_DECODE(4);
    case 80: return PAGEDLLM_DECODE(5);
    case 96: return PAGEDLLM_DECODE(6);
    case 128: return PAGEDLLM_DECODE(8);
    case 256: return PAGEDLLM_DECODE(16);
    default: TORCH_CHECK(false, "head_dim ", q.size(2), " is not one of 32, 64, 80, 96, 128, 256");
  }
#undef PAGEDLLM_DECODE
}

}  // namespace

// q: (seqs, heads, dim); k_cache, v_cache: (kv_heads, slots, dim), rows contiguous; block_table:
// (seqs, blocks) int64; key_lens: (seqs,) int64, keys 0 .. len-1 of each sequence are attended to, or with
// window > 0 the last `window` of them; sinks: None or (heads,) logits added to each softmax's denominator.
// Returns (seqs, heads, dim) in q's dtype.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_table, const at::Tensor& key_lens, double scale,
                                  int64_t block_size, int64_t window, const c10::optional<at::Tensor>& sinks) {
  const at::Tensor sink_logits = check_paged_attention(q, k_cache, v_cache, block_size, window, sinks);
  TORCH_CHECK(block_table.scalar_type() == at::kLong && key_lens.scalar_type() == at::kLong,
              "block_table and key_lens must be int64");
  TORCH_CHECK(block_table.stride(1) == 1 && key_lens.is_contiguous(), "index tensors must be contiguous");
  TORCH_CHECK(key_lens.size(0) == q.size(0) && block_table.size(0) == q.size(0), "one row per sequence");
  const float* sink_data = sink_logits.defined() ? sink_logits.data_ptr<float>() : nullptr;
  // Every read goes through these: keep them inside the cache (a few hundred integers to look at).
  const int64_t num_blocks = k_cache.size(1) / block_size, width = block_table.size(1);
  const int64_t* lens = key_lens.data_ptr<int64_t>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  for (int64_t b = 0; b < q.size(0); ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= width * block_size, "sequence ", b, " has ", lens[b],
                " keys; its block table holds 1 .. ", width * block_size);
    for (int64_t j = 0; j < (lens[b] + block_size - 1) / block_size; ++j) {
      const int64_t block = table[b * block_table.stride(0) + j];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block ", block, " is outside the KV cache (", num_blocks,
                  " blocks)");
    }
  }
  at::Tensor out = at::empty_like(q, at::MemoryFormat::Contiguous);
  switch (q.scalar_type()) {
    case at::kFloat:
      dispatch_head_dim<float>(q, k_cache, v_cache, block_table, key_lens, scale, block_size, window, sink_data, out);
      break;
    case at::kBFloat16:
      dispatch_head_dim<c10::BFloat16>(q, k_cache, v_cache, block_table, key_lens, scale, block_size, window,
                                      sink_data, out);
      break;
    case at::kHalf:
      dispatch_head_dim<c10::Half>(q, k_cache, v_cache, block_table, key_lens, scale, block_size, window, sink_data,
                                  out);
      break;
    default:
      TORCH_CHECK(false, "unsupported dtype ", q.scalar_type());
  }
  return out;
}

// Stores this step's keys and values into the head-major caches: k, v (tokens, kv_heads, dim), rows
// contiguous (strided views of the QKV product are fine); k_cache, v_cache (kv_heads, slots, dim) in
// the same dtype; slots (tokens,) int64. One row copy per token and head: what index_copy_ along the
// slot dimension does, without its per-call set-up (two calls per layer per step).
void write_kv_cache(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& k,
                    const at::Tensor& v) {
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.dim() == 3 && k.dim() == 3 && v.dim() == 3, "caches and k, v must be 3-D");
  TORCH_CHECK(k_cache.device().is_cpu() && v_cache.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "CPU tensors only");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "k, v and the caches must share one dtype");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k.sizes() == v.sizes(), "K and V alike");
  TORCH_CHECK(k.size(1) == k_cache.size(0) && k.size(2) == k_cache.size(2),
              "k is (tokens, kv_heads, dim) of the cache");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k_cache.stride(2) == 1 && v_cache.stride(2) == 1,
              "rows must be contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == k.size(0) &&
                  slots.is_contiguous(),
              "slots must be a contiguous int64 (tokens,) vector");
  const int64_t tokens = k.size(0), heads = k.size(1), num_slots = k_cache.size(1);
  const int64_t row_bytes = k.size(2) * k.element_size();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "slot ", slot[t], " is outside the KV cache (", num_slots,
                " slots)");
  const int64_t elt = k.element_size();
  for (const auto& [src, dst] : {std::pair<const at::Tensor*, at::Tensor*>{&k, &k_cache}, {&v, &v_cache}}) {
    const char* s = static_cast<const char*>(src->data_ptr());
    char* d = static_cast<char*>(dst->data_ptr());
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t h = 0; h < heads; ++h)
        std::memcpy(d + (h * dst->stride(0) + slot[t] * dst->stride(1)) * elt,
                    s + (t * src->stride(0) + h * src->stride(1)) * elt, row_bytes);
  }
}

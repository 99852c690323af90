// Prefill attention straight from the paged, head-major KV cache: each request's queries (a prompt, or a chunk
// of one after earlier chunks or a cached prefix) attend causally to that request's keys 0 .. their position,
// read block by block through the block table (this step's K/V are already written), with no mask, padding or
// gathered copy of K/V. Work item: 16 consecutive queries of one request and one KV head, with every query head
// of the group (GQA), whichever thread is free taking the next. Flash-style: keys 16 at a time, a running
// maximum and sum per query, the weighted sum of values rescaled as the maximum grows.
// Queries sit in the vector lanes (16 tokens), so a score tile is 16 keys x dim broadcast FMAs with no
// horizontal sums; scores, softmax and the weighted sum of values are in float32, the output rounded once.
// A sliding window starts each query's keys at position - window + 1 (keys before the earliest query's window
// are not read: their blocks may be back in the pool); sinks add exp(sink) of each query head to its softmax's
// denominator (the running maximum starts at the sink).
#include "common.h"

namespace {

constexpr int64_t kTokens = 16;  // queries per work item: one vector lane each

template <typename T, int NC>
void prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_table, const int64_t* q_offsets, const int64_t* q_counts,
                       const int64_t* first_positions, int64_t num_requests, double scale, int64_t block_size,
                       int64_t window, const float* sinks, at::Tensor& out) {
  constexpr int64_t dim = NC * 16;
  const int64_t num_heads = q.size(1), num_kv_heads = k_cache.size(0);
  const int64_t group = num_heads / num_kv_heads;
  const T* q_data = q.data_ptr<T>();
  const T* k_data = k_cache.data_ptr<T>();
  const T* v_data = v_cache.data_ptr<T>();
  T* out_data = out.data_ptr<T>();
  const int64_t q_tok = q.stride(0), q_head = q.stride(1);
  const int64_t k_head = k_cache.stride(0), k_slot = k_cache.stride(1);
  const int64_t v_head = v_cache.stride(0), v_slot = v_cache.stride(1);
  const int64_t o_tok = out.stride(0), o_head = out.stride(1);
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t table_stride = block_table.stride(0);
  const float fscale = static_cast<float>(scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();

  // Work items, the longest first (later query blocks see more keys), so no thread is left with one at the end.
  std::vector<std::pair<int64_t, int64_t>> query_blocks;  // (request, first query of the block)
  for (int64_t r = 0; r < num_requests; ++r)
    for (int64_t t0 = 0; t0 < q_counts[r]; t0 += kTokens) query_blocks.emplace_back(r, t0);
  std::stable_sort(query_blocks.begin(), query_blocks.end(), [&](const auto& a, const auto& b) {
    return first_positions[a.first] + a.second > first_positions[b.first] + b.second;
  });

  parallel_chunks(static_cast<int64_t>(query_blocks.size()) * num_kv_heads, 1, [&](const auto& next) {
    std::vector<f32x16> qt(group * dim);               // qt[g * dim + d]: lane t = query t's dim d, scaled
    std::vector<f32x16> acc(group * kTokens * NC);     // acc[(g * 16 + t) * NC + c]: query t's weighted values
    std::vector<f32x16> row_max(group), row_sum(group);
    std::vector<float> keys(kTokens * dim), values(kTokens * dim);
    alignas(64) float probs[kTokens][kTokens];         // probs[j][t]: key j's weight for query t
    int64_t first, end;
    while (next(first, end)) for (int64_t item = first; item < end; ++item) {
      const auto [r, t0] = query_blocks[item / num_kv_heads];
      const int64_t kv = item % num_kv_heads;
      const int64_t nt = std::min<int64_t>(kTokens, q_counts[r] - t0);
      const int64_t p0 = first_positions[r] + t0;  // the block's first query's position
      const int64_t key_end = p0 + nt;             // keys 0 .. the last query's position
      const int64_t key_first = window > 0 ? std::max<int64_t>(0, p0 - window + 1) : 0;
      const int64_t* blocks = table + r * table_stride;
      auto slot_of = [&](int64_t s) { return blocks[s / block_size] * block_size + s % block_size; };
      f32x16 positions;
      for (int t = 0; t < kTokens; ++t) positions[t] = static_cast<float>(p0 + t);

      for (int64_t g = 0; g < group; ++g) {
        const int64_t head = kv * group + g;
        for (int64_t d = 0; d < dim; ++d) qt[g * dim + d] = f32x16{};
        for (int64_t t = 0; t < nt; ++t) {
          const T* src = q_data + (q_offsets[r] + t0 + t) * q_tok + head * q_head;
          for (int64_t d = 0; d < dim; ++d) qt[g * dim + d][t] = to_float(src[d]) * fscale;
        }
        const float sink = sinks != nullptr ? sinks[head] : neg_inf;
        row_max[g] = f32x16{} + sink;
        row_sum[g] = f32x16{} + (sinks != nullptr ? 1.f : 0.f);  // the sink's own exp(sink - max)
      }
      std::fill(acc.begin(), acc.end(), f32x16{});

      for (int64_t s0 = key_first; s0 < key_end; s0 += kTokens) {
        const int64_t nk = std::min<int64_t>(kTokens, key_end - s0);
        for (int64_t j = 0; j < nk; ++j) {
          const T* k_row = k_data + kv * k_head + slot_of(s0 + j) * k_slot;
          const T* v_row = v_data + kv * v_head + slot_of(s0 + j) * v_slot;
          for (int c = 0; c < NC; ++c) {
            store16(keys.data() + j * dim + 16 * c, load16(k_row + 16 * c));
            store16(values.data() + j * dim + 16 * c, load16(v_row + 16 * c));
          }
        }
        std::fill(values.begin() + nk * dim, values.end(), 0.f);  // a last, partial tile: zero weight, zero rows
        for (int64_t g = 0; g < group; ++g) {
          f32x16 scores[kTokens];
          for (int64_t j = 0; j < kTokens; ++j) scores[j] = f32x16{};
          const f32x16* qg = qt.data() + g * dim;
          if (nk == kTokens) {  // a whole tile: loops of known length, the 16 scores held in registers
            for (int64_t d = 0; d < dim; ++d) {
              const f32x16 qd = qg[d];
              for (int64_t j = 0; j < kTokens; ++j) scores[j] += qd * keys[j * dim + d];
            }
          } else {
            for (int64_t d = 0; d < dim; ++d) {
              const f32x16 qd = qg[d];
              for (int64_t j = 0; j < nk; ++j) scores[j] += qd * keys[j * dim + d];
            }
          }
          f32x16 mx = row_max[g];
          for (int64_t j = 0; j < nk; ++j) {
            const float key = static_cast<float>(s0 + j);
            auto visible = key <= positions;  // causal
            if (window > 0) visible = visible & (key > positions - static_cast<float>(window));
            scores[j] = visible ? scores[j] : f32x16{} + neg_inf;
            mx = scores[j] > mx ? scores[j] : mx;
          }
          // Lanes with no visible key yet keep max -inf: their scale stays 1 (nothing to rescale), no NaN.
          const auto none_yet = mx == neg_inf;
          const f32x16 alpha = none_yet ? f32x16{} + 1.f : exp16(row_max[g] - mx);
          f32x16 total = row_sum[g] * alpha;
          for (int64_t j = 0; j < nk; ++j) {
            const auto hidden = scores[j] == neg_inf;
            const f32x16 p = hidden ? f32x16{} : exp16(scores[j] - mx);
            total += p;
            store16(probs[j], p);
          }
          for (int64_t j = nk; j < kTokens; ++j) store16(probs[j], f32x16{});
          row_sum[g] = total;
          row_max[g] = mx;
          for (int64_t t = 0; t < nt; ++t) {
            f32x16* a = acc.data() + (g * kTokens + t) * NC;
            f32x16 r_acc[NC];
            for (int c = 0; c < NC; ++c) r_acc[c] = a[c] * alpha[t];
            // A whole tile's loop of known length (past nk the weights and value rows are 0).
            for (int64_t j = 0; j < kTokens; ++j) {
              const float p = probs[j][t];
              const float* v = values.data() + j * dim;
              for (int c = 0; c < NC; ++c) r_acc[c] += p * load16(v + 16 * c);
            }
            for (int c = 0; c < NC; ++c) a[c] = r_acc[c];
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        const f32x16 inv = 1.f / row_sum[g];
        for (int64_t t = 0; t < nt; ++t) {
          T* dst = out_data + (q_offsets[r] + t0 + t) * o_tok + (kv * group + g) * o_head;
          const f32x16* a = acc.data() + (g * kTokens + t) * NC;
          for (int c = 0; c < NC; ++c) store16(dst + 16 * c, a[c] * inv[t]);
        }
      }
    }
  });
}

}  // namespace

// q: (tokens, heads, dim), rows contiguous; request r's queries are q[q_offsets[r] .. + q_counts[r]], at
// positions first_positions[r] ...; k_cache, v_cache: (kv_heads, slots, dim) holding every key up to each
// query; block_table: (requests, blocks) int64; window > 0: each query sees its last `window` keys; sinks: None
// or (heads,). Returns (tokens, heads, dim) in q's dtype (rows of no request are left unset).
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_table, const at::Tensor& q_offsets,
                                   const at::Tensor& q_counts, const at::Tensor& first_positions, double scale,
                                   int64_t block_size, int64_t window, const c10::optional<at::Tensor>& sinks) {
  const at::Tensor sink_logits = check_paged_attention(q, k_cache, v_cache, block_size, window, sinks);
  const int64_t num_requests = block_table.size(0);
  for (const at::Tensor* t : {&block_table, &q_offsets, &q_counts, &first_positions})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "index tensors must be contiguous int64");
  TORCH_CHECK(q_offsets.numel() == num_requests && q_counts.numel() == num_requests &&
                  first_positions.numel() == num_requests,
              "one offset, count and first position per block table row");
  const int64_t* offsets = q_offsets.data_ptr<int64_t>();
  const int64_t* counts = q_counts.data_ptr<int64_t>();
  const int64_t* starts = first_positions.data_ptr<int64_t>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t num_blocks = k_cache.size(1) / block_size, width = block_table.size(1);
  for (int64_t r = 0; r < num_requests; ++r) {  // every read goes through these: keep them inside the cache
    TORCH_CHECK(counts[r] >= 0 && offsets[r] >= 0 && offsets[r] + counts[r] <= q.size(0) && starts[r] >= 0,
                "request ", r, "'s queries ", offsets[r], " + ", counts[r], " are outside q (", q.size(0), " rows)");
    const int64_t keys = starts[r] + counts[r];
    TORCH_CHECK(keys <= width * block_size, "request ", r, " has ", keys, " keys; its block table holds ",
                width * block_size);
    const int64_t first_key = window > 0 ? std::max<int64_t>(0, starts[r] - window + 1) : 0;
    for (int64_t j = first_key / block_size; j < (keys + block_size - 1) / block_size; ++j) {
      const int64_t block = table[r * width + j];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block ", block, " is outside the KV cache (", num_blocks,
                  " blocks)");
    }
  }
  at::Tensor out = at::empty_like(q, at::MemoryFormat::Contiguous);
  const float* sink_data = sink_logits.defined() ? sink_logits.data_ptr<float>() : nullptr;
  auto run = [&](auto tag) {
    using T = decltype(tag);
#define PAGEDLLM_PREFILL(NC)                                                                                    \
  prefill_attention<T, NC>(q, k_cache, v_cache, block_table, offsets, counts, starts, num_requests, scale,  \
                           block_size, window, sink_data, out)
    switch (q.size(2)) {
      case 32: return PAGEDLLM_PREFILL(2);
      case 64: return PAGEDLLM_PREFILL(4);
      case 80: return PAGEDLLM_PREFILL(5);
      case 96: return PAGEDLLM_PREFILL(6);
      case 128: return PAGEDLLM_PREFILL(8);
      case 256: return PAGEDLLM_PREFILL(16);
      default: TORCH_CHECK(false, "head_dim ", q.size(2), " is not one of 32, 64, 80, 96, 128, 256");
    }
#undef PAGEDLLM_PREFILL
  };
  switch (q.scalar_type()) {
    case at::kFloat: run(float()); break;
    case at::kBFloat16: run(c10::BFloat16()); break;
    case at::kHalf: run(c10::Half()); break;
    default: TORCH_CHECK(false, "unsupported dtype ", q.scalar_type());
  }
  return out;
}

// Fused elementwise kernels of the decoder layers: one pass over the data where PyTorch runs 3-6
// kernels, each rounding where the PyTorch ops it replaces round (bfloat16 results are the same
// bits, up to the order of a float32 sum), so a model gives the reference's tokens either way.
#include "common.h"

namespace {

// out = weight * to_dtype(x * rsqrt(mean(x^2) + eps)), x summed with the residual first when given
// (residual <- residual + x, in place): the residual add of one layer fused with the next norm.
template <typename T>
void rms_norm_rows(T* x, T* residual, const T* weight, T* out, int64_t rows, int64_t hidden, int64_t x_stride,
                   int64_t r_stride, int64_t o_stride, float eps) {
  const int64_t vec_end = hidden / 16 * 16;
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> h(hidden);
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * x_stride;
      T* rr = residual ? residual + r * r_stride : nullptr;
      f32x16 sq16{};
      for (int64_t i = 0; i < vec_end; i += 16) {  // the same roundings, 16 at a time
        f32x16 v = load16(xr + i);
        if (rr) {
          v = round_to(load16(rr + i) + v, T());
          store16(rr + i, v);
        }
        store16(h.data() + i, v);
        sq16 += v * v;
      }
      float sq = sum16(sq16);
      for (int64_t i = vec_end; i < hidden; ++i) {
        float v = to_float(xr[i]);
        if (rr) {
          v = round_to(to_float(rr[i]) + v, T());
          rr[i] = static_cast<T>(v);
        }
        h[i] = v;
        sq += v * v;
      }
      const float inv = 1.f / std::sqrt(sq / static_cast<float>(hidden) + eps);
      T* o = out + r * o_stride;
      for (int64_t i = 0; i < vec_end; i += 16) store16(o + i, round_to(load16(h.data() + i) * inv, T()) * load16(weight + i));
      for (int64_t i = vec_end; i < hidden; ++i) {
        o[i] = static_cast<T>(round_to(h[i] * inv, T()) * to_float(weight[i]));
      }
    }
  });
}

// out = to_dtype(silu(gate)) * up for x = [gate | up] (rows, 2 * width), as F.silu(gate) * up.
template <typename T>
void silu_and_mul_rows(const T* x, T* out, int64_t rows, int64_t width, int64_t x_stride) {
  const int64_t vec_end = width / 16 * 16;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * x_stride;
      const T* up = gate + width;
      T* o = out + r * width;
      for (int64_t i = 0; i < vec_end; i += 16) {
        const f32x16 g = load16(gate + i);
        const f32x16 s = round_to(g / (1.f + exp16(-g)), T());
        store16(o + i, s * load16(up + i));
      }
      for (int64_t i = vec_end; i < width; ++i) {
        const float g = to_float(gate[i]);
        o[i] = static_cast<T>(round_to(g / (1.f + std::exp(-g)), T()) * to_float(up[i]));
      }
    }
  });
}

// Neox-style rotary embedding in place on x (tokens, heads, dim): x * cos + rotate_half(x) * sin, the
// tables cast to the dtype first and each product and the sum rounded, as the reference computes it.
template <typename T>
void rotary_rows(T* x, const int64_t* positions, const float* cos, const float* sin, int64_t tokens, int64_t heads,
                 int64_t dim, int64_t t_stride, int64_t h_stride, int64_t table_stride) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> c(dim), s(dim);
    for (int64_t t = begin; t < end; ++t) {
      const float* ct = cos + positions[t] * table_stride;
      const float* st = sin + positions[t] * table_stride;
      for (int64_t i = 0; i < dim; ++i) {
        c[i] = round_to(ct[i], T());
        s[i] = round_to(st[i], T());
      }
      const int64_t vec_end = half / 16 * 16;
      for (int64_t h = 0; h < heads; ++h) {
        T* xh = x + t * t_stride + h * h_stride;
        for (int64_t i = 0; i < vec_end; i += 16) {  // the same roundings, 16 at a time
          const f32x16 a = load16(xh + i), b = load16(xh + i + half);
          const f32x16 c_lo = load16(c.data() + i), c_hi = load16(c.data() + i + half);
          const f32x16 s_lo = load16(s.data() + i), s_hi = load16(s.data() + i + half);
          const T tag{};
          store16(xh + i, round_to(round_to(a * c_lo, tag) - round_to(b * s_lo, tag), tag));
          store16(xh + i + half, round_to(round_to(b * c_hi, tag) + round_to(a * s_hi, tag), tag));
        }
        for (int64_t i = vec_end; i < half; ++i) {
          const float a = to_float(xh[i]), b = to_float(xh[i + half]);
          const float lo = round_to(round_to(a * c[i], T()) - round_to(b * s[i], T()), T());
          const float hi = round_to(round_to(b * c[i + half], T()) + round_to(a * s[i + half], T()), T());
          xh[i] = static_cast<T>(lo);
          xh[i + half] = static_cast<T>(hi);
        }
      }
    }
  });
}

void check_float_or_bf16(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, not ", t.scalar_type());
}

}  // namespace

// x, residual: (rows, hidden) with contiguous rows; weight: (hidden,). Returns the normed rows; with a
// residual, also updates it in place to residual + x (the caller's next residual stream).
at::Tensor rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
                    double eps) {
  check_float_or_bf16(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be (rows, hidden) with contiguous rows");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous() && weight.numel() == x.size(1),
              "weight must be (hidden,) in x's dtype");
  if (residual.has_value()) {
    const at::Tensor& r = residual.value();
    TORCH_CHECK(r.sizes() == x.sizes() && r.scalar_type() == x.scalar_type() && r.stride(1) == 1,
                "residual must match x");
  }
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  auto run = [&](auto tag) {
    using T = decltype(tag);
    T* r = residual.has_value() ? residual.value().data_ptr<T>() : nullptr;
    rms_norm_rows<T>(x.data_ptr<T>(), r, weight.data_ptr<T>(), out.data_ptr<T>(), x.size(0), x.size(1), x.stride(0),
                     residual.has_value() ? residual.value().stride(0) : 0, out.stride(0), static_cast<float>(eps));
  };
  if (x.scalar_type() == at::kFloat) run(float()); else run(c10::BFloat16());
  return out;
}

// x: (rows, 2 * width), rows contiguous. Returns (rows, width).
at::Tensor silu_and_mul(const at::Tensor& x) {
  check_float_or_bf16(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0, "x must be (rows, 2 * width)");
  const int64_t width = x.size(1) / 2;
  at::Tensor out = at::empty({x.size(0), width}, x.options());
  auto run = [&](auto tag) {
    using T = decltype(tag);
    silu_and_mul_rows<T>(x.data_ptr<T>(), out.data_ptr<T>(), x.size(0), width, x.stride(0));
  };
  if (x.scalar_type() == at::kFloat) run(float()); else run(c10::BFloat16());
  return out;
}

// x: (tokens, heads, dim), last dim contiguous, rotated in place; positions: (tokens,) int64; cos, sin:
// (max_positions, dim) float32 tables.
void rotary_embedding(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin) {
  check_float_or_bf16(x, "x");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "x must be (tokens, heads, even dim)");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == x.size(0),
              "positions must be (tokens,) int64");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous() && cos.size(1) == x.size(2) && sin.sizes() == cos.sizes(),
              "cos and sin must be (positions, dim) float32");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.numel(); ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "position ", pos[t], " is outside the rotary table (0 .. ",
                cos.size(0) - 1, ")");
  }
  auto run = [&](auto tag) {
    using T = decltype(tag);
    rotary_rows<T>(x.data_ptr<T>(), positions.data_ptr<int64_t>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                   x.size(0), x.size(1), x.size(2), x.stride(0), x.stride(1), cos.stride(0));
  };
  if (x.scalar_type() == at::kFloat) run(float()); else run(c10::BFloat16());
}

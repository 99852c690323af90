// Matrix-vector products for decode at a handful of rows: y = x @ W^T with W (N, K) a plain
// row-major bfloat16 weight, read once, as a stream, by both cores. Each thread takes a band of
// output rows and walks four weight rows at a time (four independent streams for the prefetchers);
// every weight chunk loaded is used for all M input rows. Accumulates in float32, rounds once.
#include "common.h"

namespace {

template <int M>
void gemv_rows(const c10::BFloat16* w, const float* x, c10::BFloat16* y, int64_t n_rows, int64_t k, int64_t y_stride) {
  const int64_t k_vec = k / 16 * 16;
  at::parallel_for(0, (n_rows + 3) / 4, 16, [&](int64_t begin, int64_t end) {
    for (int64_t quad = begin; quad < end; ++quad) {
      const int64_t n0 = quad * 4;
      const int rows = static_cast<int>(std::min<int64_t>(4, n_rows - n0));
      f32x16 acc[4][M] = {};
      for (int64_t i = 0; i < k_vec; i += 16) {
        f32x16 xs[M];
        for (int m = 0; m < M; ++m) xs[m] = load16(x + m * k + i);
        for (int r = 0; r < rows; ++r) {
          const f32x16 wv = load16(w + (n0 + r) * k + i);
          for (int m = 0; m < M; ++m) acc[r][m] += wv * xs[m];
        }
      }
      for (int r = 0; r < rows; ++r) {
        for (int m = 0; m < M; ++m) {
          float sum = sum16(acc[r][m]);
          for (int64_t i = k_vec; i < k; ++i) sum += to_float(w[(n0 + r) * k + i]) * x[m * k + i];
          y[m * y_stride + n0 + r] = static_cast<c10::BFloat16>(sum);
        }
      }
    }
  });
}

}  // namespace

// x: (M, K) with 1 <= M <= 4; weight: (N, K) bfloat16, contiguous. Returns (M, N) bfloat16.
at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 && weight.is_contiguous(),
              "weight must be a contiguous (N, K) bfloat16 matrix");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == weight.size(1) && x.size(0) >= 1 && x.size(0) <= 4,
              "x must be (M, K) with 1 <= M <= 4");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({x.size(0), weight.size(0)}, x.options().dtype(at::kBFloat16));
  const auto* w = weight.data_ptr<c10::BFloat16>();
  const float* xp = xf.data_ptr<float>();
  auto* yp = y.data_ptr<c10::BFloat16>();
  const int64_t n = weight.size(0), k = weight.size(1);
  switch (x.size(0)) {
    case 1: gemv_rows<1>(w, xp, yp, n, k, n); break;
    case 2: gemv_rows<2>(w, xp, yp, n, k, n); break;
    case 3: gemv_rows<3>(w, xp, yp, n, k, n); break;
    default: gemv_rows<4>(w, xp, yp, n, k, n); break;
  }
  return y;
}

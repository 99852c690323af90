// Python bindings of the kernels, in their own translation unit: pybind11 and PyTorch's type casters (~15 s to
// compile) build beside the kernels (ATen only), on another core, instead of PyTorch's whole C++ API in one unit.
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_table, const at::Tensor& key_lens, double scale,
                                  int64_t block_size, int64_t window, const c10::optional<at::Tensor>& sinks);
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_table, const at::Tensor& q_offsets,
                                   const at::Tensor& q_counts, const at::Tensor& first_positions, double scale,
                                   int64_t block_size, int64_t window, const c10::optional<at::Tensor>& sinks);
void write_kv_cache(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& k,
                    const at::Tensor& v);
at::Tensor rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
                    double eps);
at::Tensor silu_and_mul(const at::Tensor& x);
void rotary_embedding(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& weight);
bool packed_linear_supported();
bool packed_linear_fma_supported();
void set_amx_allowed(bool allowed);
bool amx_available();
at::Tensor pack_linear_weight(const at::Tensor& weight);
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias);
at::Tensor packed_linear_silu_mul(const at::Tensor& x, const at::Tensor& packed,
                                  const c10::optional<at::Tensor>& bias);
at::Tensor packed_embedding(const at::Tensor& ids_in, const at::Tensor& packed);
at::Tensor argmax_rows(const at::Tensor& x);
at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                     const c10::optional<at::Tensor>& zero);
std::string int4_gemv_path(int64_t group);
at::Tensor fp8_gemv(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, int64_t block_n,
                    int64_t block_k);
std::string fp8_gemv_path();
at::Tensor mxfp4_gemv(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& scales);
at::Tensor mxfp4_dequantize(const at::Tensor& blocks, const at::Tensor& scales);
at::Tensor fp8_dequantize(const at::Tensor& weight, const at::Tensor& scale, int64_t block_n, int64_t block_k,
                          int64_t start, int64_t end);
at::Tensor int4_dequantize(const at::Tensor& weight, const at::Tensor& scale, const c10::optional<at::Tensor>& zero,
                           int64_t start, int64_t end);

#define PAGEDLLM_DEF(name) m.def(#name, torch::wrap_pybind_function(name), #name)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  PAGEDLLM_DEF(paged_decode_attention);
  PAGEDLLM_DEF(paged_prefill_attention);
  PAGEDLLM_DEF(write_kv_cache);
  PAGEDLLM_DEF(rms_norm);
  PAGEDLLM_DEF(silu_and_mul);
  PAGEDLLM_DEF(rotary_embedding);
  PAGEDLLM_DEF(gemv_bf16);
  PAGEDLLM_DEF(packed_linear_supported);
  PAGEDLLM_DEF(packed_linear_fma_supported);
  PAGEDLLM_DEF(set_amx_allowed);
  PAGEDLLM_DEF(amx_available);
  PAGEDLLM_DEF(pack_linear_weight);
  PAGEDLLM_DEF(packed_linear);
  PAGEDLLM_DEF(packed_linear_silu_mul);
  PAGEDLLM_DEF(packed_embedding);
  PAGEDLLM_DEF(argmax_rows);
  PAGEDLLM_DEF(int4_gemv);
  PAGEDLLM_DEF(int4_dequantize);
  PAGEDLLM_DEF(int4_gemv_path);
  PAGEDLLM_DEF(fp8_gemv);
  PAGEDLLM_DEF(fp8_dequantize);
  PAGEDLLM_DEF(fp8_gemv_path);
  PAGEDLLM_DEF(mxfp4_gemv);
  PAGEDLLM_DEF(mxfp4_dequantize);
}

// Declarations of Mesa's quantizer ops and the argument checks both backends share.
#pragma once
#include <torch/extension.h>

namespace mesa {

inline void check_group_args(const char* op, int64_t numel, int64_t groups, int64_t inner) {
  TORCH_CHECK(groups > 0, "mesa ", op, ": groups must be positive, got ", groups);
  TORCH_CHECK(inner > 0, "mesa ", op, ": inner must be positive, got ", inner);
  TORCH_CHECK(numel % (groups * inner) == 0, "mesa ", op, ": numel ", numel,
              " is not a multiple of groups*inner = ", groups, "*", inner);
}

inline void check_bits(const char* op, int64_t bits) {
  TORCH_CHECK(bits == 1 || bits == 2 || bits == 4 || bits == 8, "mesa ", op,
              ": bits must be 1, 2, 4 or 8, got ", bits);
}

inline void check_params(const char* op, const at::Tensor& a, const at::Tensor& b, int64_t groups,
                         const at::Device& dev) {
  for (const at::Tensor* t : {&a, &b}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat, "mesa ", op, ": scale/shift must be float32");
    TORCH_CHECK(t->is_contiguous() && t->numel() == groups, "mesa ", op,
                ": scale/shift must be contiguous with ", groups, " elements, got ", t->numel());
    TORCH_CHECK(t->device() == dev, "mesa ", op, ": scale/shift must be on ", dev);
  }
}

inline void check_quantize_args(const at::Tensor& x, const at::Tensor& inv, const at::Tensor& shift,
                                int64_t bits, int64_t groups, int64_t inner) {
  TORCH_CHECK(x.is_contiguous(), "mesa quantize: x must be contiguous");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kHalf ||
                  x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kDouble,
              "mesa quantize: x must be float64/32/16 or bfloat16, got ", x.scalar_type());
  check_bits("quantize", bits);
  check_group_args("quantize", x.numel(), groups, inner);
  check_params("quantize", inv, shift, groups, x.device());
}

// packed holds the codes of numel elements at `bits` bits, in (outer, groups, inner) groups.
inline void check_packed_args(const char* op, const at::Tensor& packed, int64_t bits,
                              int64_t groups, int64_t inner, int64_t numel) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "mesa ", op, ": packed must be a contiguous uint8 tensor");
  check_bits(op, bits);
  check_group_args(op, numel, groups, inner);
  const int64_t per = 8 / bits;
  TORCH_CHECK(packed.numel() == (numel + per - 1) / per, "mesa ", op, ": packed has ",
              packed.numel(), " bytes, expected ", (numel + per - 1) / per, " for ", numel,
              " elements at ", bits, " bits");
}

inline void check_dequantize_args(const at::Tensor& packed, const at::Tensor& step,
                                  const at::Tensor& shift, int64_t bits, int64_t groups,
                                  int64_t inner, int64_t numel) {
  check_packed_args("dequantize", packed, bits, groups, inner, numel);
  check_params("dequantize", step, shift, groups, packed.device());
}

at::Tensor quantize_cpu(const at::Tensor& x, const at::Tensor& inv, const at::Tensor& shift,
                        int64_t bits, int64_t groups, int64_t inner, int64_t seed, bool stochastic);
at::Tensor dequantize_cpu(const at::Tensor& packed, const at::Tensor& step, const at::Tensor& shift,
                          int64_t bits, int64_t groups, int64_t inner, int64_t numel,
                          at::ScalarType dtype);
at::Tensor dequantize_out_cpu(const at::Tensor& packed, const at::Tensor& step,
                              const at::Tensor& shift, int64_t bits, int64_t groups, int64_t inner,
                              at::Tensor out);
at::Tensor lut_apply_out_cpu(const at::Tensor& packed, const at::Tensor& table, int64_t bits,
                             int64_t groups, int64_t inner, at::Tensor out,
                             const std::optional<at::Tensor>& mul);
at::Tensor levels_cpu(const at::Tensor& step, const at::Tensor& shift, int64_t bits,
                      at::ScalarType dtype);
at::Tensor group_minmax_cpu(const at::Tensor& x, int64_t groups, int64_t inner);
at::Tensor range_update_cpu(const at::Tensor& x, int64_t groups, int64_t inner, at::Tensor clip_val,
                            at::Tensor shift, at::Tensor iteration, double decay,
                            double one_minus_decay, bool batch_mode, int64_t bits,
                            bool update);
std::tuple<at::Tensor, at::Tensor, at::Tensor, bool, at::Tensor> quantize_step_cpu(
    const at::Tensor& x, int64_t groups, int64_t inner, at::Tensor clip_val, at::Tensor shift,
    at::Tensor iteration, double decay, double one_minus_decay, bool batch_mode, int64_t bits,
    bool update, int64_t seed_prefix, at::Tensor draws, bool stochastic, bool mark_nonfinite,
    bool prefix_of_mix, const std::optional<at::Tensor>& row_mean,
    const std::optional<at::Tensor>& row_rstd);
int64_t generator_fingerprint_cpu();

#ifdef MESA_WITH_CUDA
at::Tensor quantize_cuda(const at::Tensor& x, const at::Tensor& inv, const at::Tensor& shift,
                         int64_t bits, int64_t groups, int64_t inner, int64_t seed, bool stochastic);
at::Tensor dequantize_cuda(const at::Tensor& packed, const at::Tensor& step, const at::Tensor& shift,
                           int64_t bits, int64_t groups, int64_t inner, int64_t numel,
                           at::ScalarType dtype);
at::Tensor group_minmax_cuda(const at::Tensor& x, int64_t groups, int64_t inner);
#endif

}  // namespace mesa

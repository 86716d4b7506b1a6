// Declarations of Mesa's quantizer ops and the argument checks both backends share.
#pragma once
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

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

// The running-range state of one quantizer: clip_val/shift float32 (G,), iteration float32 (1,),
// all on `dev`; range_mode one of kRangeEma/kRangeBatch/kRangeUnion (quant_math.h).
inline void check_range_args(const char* op, const at::Tensor& clip_val, const at::Tensor& shift,
                             const at::Tensor& iteration, int64_t groups, int64_t range_mode,
                             const at::Device& dev) {
  for (const at::Tensor* t : {&clip_val, &shift}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == groups &&
                    t->device() == dev,
                "mesa ", op, ": clip_val/shift must be contiguous float32 tensors of ", groups,
                " elements on ", dev);
  }
  TORCH_CHECK(iteration.scalar_type() == at::kFloat && iteration.numel() == 1 &&
                  iteration.device() == dev,
              "mesa ", op, ": iteration must be a float32 tensor of 1 element on ", dev);
  TORCH_CHECK(range_mode >= 0 && range_mode <= 2, "mesa ", op,
              ": range_mode must be 0 (ema), 1 (batch) or 2 (union), got ", range_mode);
}

// (row_len, row_stride) of x when its elements can be read in logical (row-major) order as
// p + (e / row_len) * row_stride + e % row_len and every group segment of `inner` elements lies
// inside one row: a contiguous x is one row; a tensor whose last dim is contiguous and whose
// leading dims collapse to one stride (q, k, v sliced out of a fused qkv projection) is read in
// place, without a copy. False otherwise (the caller then makes x contiguous).
inline bool row_layout(const at::Tensor& x, int64_t inner, int64_t* row_len, int64_t* row_stride) {
  const int64_t n = x.numel();
  if (x.is_contiguous()) {
    *row_len = *row_stride = std::max<int64_t>(n, 1);
    return true;
  }
  const int64_t nd = x.dim();
  if (nd < 2 || x.stride(nd - 1) != 1) return false;
  const int64_t len = x.size(nd - 1);
  int64_t stride = -1, expect = -1;  // walk the leading dims from the innermost outwards
  for (int64_t d = nd - 2; d >= 0; --d) {
    if (x.size(d) == 1) continue;
    if (stride < 0) {
      stride = x.stride(d);
      expect = stride * x.size(d);
    } else {
      if (x.stride(d) != expect) return false;
      expect *= x.size(d);
    }
  }
  if (stride < 0) stride = len;  // a single row
  if (stride < len || len % inner != 0) return false;
  *row_len = len;
  *row_stride = stride;
  return true;
}

// x itself when row_layout can read it for groups of `inner` elements, else a contiguous copy.
inline at::Tensor readable(const at::Tensor& x, int64_t inner, int64_t* row_len,
                           int64_t* row_stride) {
  if (row_layout(x, inner, row_len, row_stride)) return x;
  at::Tensor c = x.contiguous();
  *row_len = *row_stride = std::max<int64_t>(c.numel(), 1);
  return c;
}

// The row length of a LayerNorm's statistics for quantize_step (row_mean/row_rstd: contiguous
// float32 on x's device, one value per row of x, each row a whole number of groups of `inner`);
// 0 when none are given.
inline int64_t row_norm_len(const char* op, const at::Tensor& x, int64_t inner,
                            const std::optional<at::Tensor>& row_mean,
                            const std::optional<at::Tensor>& row_rstd) {
  if (!(row_mean.has_value() && row_mean->defined())) return 0;
  TORCH_CHECK(row_rstd.has_value() && row_rstd->defined(), "mesa ", op,
              ": row_mean given without row_rstd");
  const int64_t rows = row_mean->numel();
  for (const at::Tensor* t : {&*row_mean, &*row_rstd})
    TORCH_CHECK(t->device() == x.device() && t->scalar_type() == at::kFloat && t->is_contiguous() &&
                    t->numel() == rows && rows > 0 && x.numel() % rows == 0,
                "mesa ", op, ": row_mean/row_rstd must be contiguous float32 tensors on ",
                x.device(), " of one value per row of x");
  TORCH_CHECK(x.scalar_type() != at::kDouble, "mesa ", op,
              ": row normalization takes float32/16 or bfloat16 x");
  const int64_t len = x.numel() / rows;
  TORCH_CHECK(len % inner == 0, "mesa ", op, ": a row of ", len,
              " elements is not a whole number of groups of ", inner);
  return len;
}

// The exact prefix rows a quantize_step / dequantize_out / lut_apply_out call writes (see
// quant_math.h's head_index): `head` contiguous, of `dtype`, on `dev`, shaped (..., P, C), for a
// tensor of `numel` elements with N = numel * P / head.numel() >= P rows of C along dim -2.
// p == nullptr when no head is given.
struct HeadRows {
  void* p = nullptr;
  int64_t n = 0, C = 1, N = 1, P = 1;  // head elements; the tensor's (N, C); rows kept
};

inline HeadRows head_rows(const char* op, const std::optional<at::Tensor>& head, int64_t numel,
                          at::ScalarType dtype, const at::Device& dev) {
  HeadRows r;
  if (!(head.has_value() && head->defined())) return r;
  const at::Tensor& t = *head;
  TORCH_CHECK(t.dim() >= 2 && t.is_contiguous() && t.scalar_type() == dtype && t.device() == dev,
              "mesa ", op, ": head must be a contiguous tensor of ", dtype, " on ", dev,
              " with at least 2 dims");
  if (t.numel() == 0) return r;  // (an empty batch: no rows to write)
  r.P = t.size(-2);
  r.C = t.size(-1);
  r.n = t.numel();
  const int64_t lead_c = r.n / r.P;  // the leading dims times C
  TORCH_CHECK(numel % lead_c == 0 && numel / lead_c >= r.P, "mesa ", op, ": a head of shape ",
              t.sizes(), " is not the first rows along dim -2 of a tensor of ", numel, " elements");
  r.N = numel / lead_c;
  r.p = t.data_ptr();
  return r;
}

// head_rows for quantize_step's x: the head's shape is x.narrow(-2, 0, P)'s; its dtype x's, or
// float32 with row statistics (the head of the stored x-hat).
inline HeadRows head_rows_of(const char* op, const std::optional<at::Tensor>& head,
                             const at::Tensor& x, bool normalized) {
  const HeadRows r = head_rows(op, head, x.numel(), normalized ? at::kFloat : x.scalar_type(),
                               x.device());
  if (r.p == nullptr) return r;
  const int64_t nd = x.dim();
  bool same = head->dim() == nd && nd >= 2 && head->size(nd - 1) == x.size(nd - 1) &&
              head->size(nd - 2) <= x.size(nd - 2);
  for (int64_t d = 0; same && d + 2 < nd; ++d) same = head->size(d) == x.size(d);
  TORCH_CHECK(same, "mesa ", op, ": head of shape ", head->sizes(),
              " is not x.narrow(-2, 0, P) of x of shape ", x.sizes());
  return r;
}

// A contiguous tensor of `dtype` and `sizes` over `base`'s storage from element `offset` (of
// dtype) on, made without a dispatch (a new TensorImpl sharing the storage): the parts of one
// allocation a kernel returns (the codes, the range rows, step and shift).
inline at::Tensor storage_view(const at::Tensor& base, at::ScalarType dtype, int64_t offset,
                               at::IntArrayRef sizes) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(base.storage()), base.key_set(),
                                                   caffe2::TypeMeta::fromScalarType(dtype));
  impl->set_sizes_contiguous(sizes);
  impl->set_storage_offset(offset);
  return at::Tensor(std::move(impl));
}

// ---- the stochastic-rounding seed (= mesa_ops.ops.make_seed), host side ----------------------
inline uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// CRC-32 (zlib's: reflected polynomial 0xEDB88320), a byte at a time; = Python's zlib.crc32.
inline uint32_t crc32_bytes(const uint8_t* p, size_t n) {
  struct Table {
    uint32_t t[256];
    Table() {
      for (uint32_t i = 0; i < 256; ++i) {
        uint32_t c = i;
        for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0xEDB88320u : c >> 1;
        t[i] = c;
      }
    }
  };
  static const Table tab;
  uint32_t c = 0xFFFFFFFFu;
  for (; n > 0; --n, ++p) c = tab.t[(c ^ *p) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

// The seed of one stochastic rounding from the (1,) int64 CPU draw counter `draws` (advanced by
// one when `advance`): splitmix64(prefix ^ draws[0]), 62 bits; prefix is ops.seed_prefix, or with
// prefix_of_mix the salt mix that the generator's fingerprint is hashed with here.
inline int64_t draw_seed(const at::Tensor& draws, uint64_t prefix, bool prefix_of_mix,
                         int64_t fingerprint, bool advance) {
  TORCH_CHECK(draws.device().is_cpu() && draws.scalar_type() == at::kLong && draws.numel() == 1,
              "mesa quantize_step: draws must be a (1,) int64 CPU tensor");
  int64_t* n = draws.data_ptr<int64_t>();
  if (prefix_of_mix) prefix = splitmix64(static_cast<uint64_t>(fingerprint) ^ prefix);
  const int64_t seed = static_cast<int64_t>(splitmix64(prefix ^ static_cast<uint64_t>(*n)) &
                                            ((uint64_t{1} << 62) - 1));
  if (advance) *n += 1;
  return seed;
}

at::Tensor quantize_cpu(const at::Tensor& x, const at::Tensor& inv, const at::Tensor& shift,
                        int64_t bits, int64_t groups, int64_t inner, int64_t seed, bool stochastic);
at::Tensor dequantize_cpu(const at::Tensor& packed, const at::Tensor& step, const at::Tensor& shift,
                          int64_t bits, int64_t groups, int64_t inner, int64_t numel,
                          at::ScalarType dtype);
at::Tensor dequantize_out_cpu(const at::Tensor& packed, const at::Tensor& step,
                              const at::Tensor& shift, int64_t bits, int64_t groups, int64_t inner,
                              at::Tensor out, const std::optional<at::Tensor>& head);
at::Tensor lut_apply_out_cpu(const at::Tensor& packed, const at::Tensor& table, int64_t bits,
                             int64_t groups, int64_t inner, at::Tensor out,
                             const std::optional<at::Tensor>& mul,
                             const std::optional<at::Tensor>& head);
at::Tensor levels_cpu(const at::Tensor& step, const at::Tensor& shift, int64_t bits,
                      at::ScalarType dtype);
at::Tensor group_minmax_cpu(const at::Tensor& x, int64_t groups, int64_t inner);
at::Tensor range_update_cpu(const at::Tensor& x, int64_t groups, int64_t inner, at::Tensor clip_val,
                            at::Tensor shift, at::Tensor iteration, double decay,
                            double one_minus_decay, int64_t range_mode, int64_t bits,
                            bool update);
std::tuple<at::Tensor, at::Tensor, at::Tensor, bool, at::Tensor> quantize_step_cpu(
    const at::Tensor& x, int64_t groups, int64_t inner, at::Tensor clip_val, at::Tensor shift,
    at::Tensor iteration, double decay, double one_minus_decay, int64_t range_mode, int64_t bits,
    bool update, int64_t seed_prefix, at::Tensor draws, bool stochastic, bool mark_nonfinite,
    bool prefix_of_mix, const std::optional<at::Tensor>& row_mean,
    const std::optional<at::Tensor>& row_rstd, const std::optional<at::Tensor>& head);
int64_t generator_fingerprint_cpu();
// quantize_step_cpu without row statistics or head rows, its (4, G) rows in an allocation of their
// own (a torch op's outputs may not share storage: cuda/torch_ops.h): (packed, all finite, rows)
std::tuple<at::Tensor, bool, at::Tensor> quantize_step_cpu_own_rows(
    const at::Tensor& x, int64_t groups, int64_t inner, at::Tensor clip_val, at::Tensor shift,
    at::Tensor iteration, double decay, double one_minus_decay, int64_t range_mode, int64_t bits,
    bool update, int64_t seed_prefix, at::Tensor draws, bool stochastic, bool mark_nonfinite,
    bool prefix_of_mix);

// (packed, step, shift, the host's "all finite" (CPU) or none (CUDA: on the device), (4, G)
// rows, the exact prefix rows or undefined): what a StepPlan's kernel returns (step_plan.h)
using StepResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, std::optional<bool>, at::Tensor, at::Tensor>;
// quantize_step_cpu as a StepPlan calls it (the salt mix as the seed prefix): the exact prefix
// rows (`head_sizes`, empty: none) made in `head_dtype` in the allocation of the rows and codes
StepResult quantize_step_cpu_plan(const at::Tensor& x, int64_t groups, int64_t inner, at::Tensor clip_val,
                                  at::Tensor shift, at::Tensor iteration, double decay, double one_minus_decay,
                                  int64_t range_mode, int64_t bits, bool update, int64_t mix, at::Tensor draws,
                                  bool stochastic, bool mark_nonfinite, const std::optional<at::Tensor>& row_mean,
                                  const std::optional<at::Tensor>& row_rstd, const std::vector<int64_t>& head_sizes,
                                  at::ScalarType head_dtype);

// The layers' gradient math, composites of ATen ops for any device (layer_grads.cpp).
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_backward(
    const at::Tensor& gy, const at::Tensor& x, const at::Tensor& weight, bool affine,
    const std::optional<at::Tensor>& a, const std::optional<at::Tensor>& c, bool need_x,
    bool need_w, bool need_b, at::ScalarType cdt, at::ScalarType x_dtype, at::ScalarType w_dtype,
    at::ScalarType b_dtype);
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward(
    const at::Tensor& gy, const at::Tensor& xh, const at::Tensor& rstd, const at::Tensor& zero,
    const at::Tensor& one, const std::optional<at::Tensor>& w, const std::optional<at::Tensor>& b,
    at::IntArrayRef normalized_shape, bool need_x, bool need_w, bool need_b, bool own_sums,
    at::ScalarType cdt, at::ScalarType x_dtype, at::ScalarType w_dtype, at::ScalarType b_dtype);
at::Tensor gelu_table(const at::Tensor& x, const std::optional<at::Tensor>& grad, const std::string& approximate,
                      at::ScalarType dtype);

#ifdef MESA_WITH_CUDA
// The CUDA kernels (quant_cuda.cu): the CPU ops' twins, same arguments and results, for tensors
// on one CUDA device (under MESA_CUDA_EMULATION: CPU tensors, the kernels run by the emulator of
// cuda_emulation.h). No host synchronisation: quantize_step_cuda returns no host flag (the finite
// row of its (4, G) result stays on the device).
at::Tensor quantize_cuda(const at::Tensor& x, const at::Tensor& inv, const at::Tensor& shift,
                         int64_t bits, int64_t groups, int64_t inner, int64_t seed, bool stochastic);
at::Tensor dequantize_cuda(const at::Tensor& packed, const at::Tensor& step, const at::Tensor& shift,
                           int64_t bits, int64_t groups, int64_t inner, int64_t numel,
                           at::ScalarType dtype);
at::Tensor dequantize_out_cuda(const at::Tensor& packed, const at::Tensor& step,
                               const at::Tensor& shift, int64_t bits, int64_t groups,
                               int64_t inner, at::Tensor out, const std::optional<at::Tensor>& head);
at::Tensor lut_apply_out_cuda(const at::Tensor& packed, const at::Tensor& table, int64_t bits,
                              int64_t groups, int64_t inner, at::Tensor out,
                              const std::optional<at::Tensor>& mul,
                              const std::optional<at::Tensor>& head);
at::Tensor levels_cuda(const at::Tensor& step, const at::Tensor& shift, int64_t bits,
                       at::ScalarType dtype);
at::Tensor group_minmax_cuda(const at::Tensor& x, int64_t groups, int64_t inner);
at::Tensor range_update_cuda(const at::Tensor& x, int64_t groups, int64_t inner,
                             at::Tensor clip_val, at::Tensor shift, at::Tensor iteration,
                             double decay, double one_minus_decay, int64_t range_mode,
                             int64_t bits, bool update);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_step_cuda(
    const at::Tensor& x, int64_t groups, int64_t inner, at::Tensor clip_val, at::Tensor shift,
    at::Tensor iteration, double decay, double one_minus_decay, int64_t range_mode, int64_t bits,
    bool update, int64_t seed_prefix, at::Tensor draws, bool stochastic, bool mark_nonfinite,
    bool prefix_of_mix, const std::optional<at::Tensor>& row_mean,
    const std::optional<at::Tensor>& row_rstd, const std::optional<at::Tensor>& head);
int64_t generator_fingerprint_cuda(int64_t device);

// Several quantize_steps (each call's arguments those of quantize_step_cuda, in order), in one
// launch where they can share one (the q, k and v of an attention: at most kMaxStepJobs of one
// dtype, all with or all without row statistics); each call's result as quantize_step_cuda's.
struct StepArgs {
  at::Tensor x;
  int64_t groups, inner;
  at::Tensor clip_val, shift, iteration;
  double decay, one_minus_decay;
  int64_t range_mode, bits;
  bool update;
  int64_t seed_prefix;
  at::Tensor draws;
  bool stochastic, mark_nonfinite, prefix_of_mix;
  std::optional<at::Tensor> row_mean, row_rstd, head;
};
constexpr int kMaxStepJobs = 3;
std::vector<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>> quantize_step_many_cuda(
    const std::vector<StepArgs>& calls);
// Several dequantize_outs (each call's arguments dequantize_out_cuda's), in one launch where
// their outputs share a dtype (at most kMaxStepJobs); returns the outs.
struct RestoreArgs {
  at::Tensor packed, step, shift;
  int64_t bits, groups, inner;
  at::Tensor out;
  std::optional<at::Tensor> head;
};
std::vector<at::Tensor> dequantize_out_many_cuda(const std::vector<RestoreArgs>& calls);
#endif

}  // namespace mesa

// Mesa's kernels as native torch ops (issue 48, item 2): the C++ kernels of the ops
// mesa::quantize_step, mesa::unpack, mesa::pack and mesa::lut_apply, whose schemas, fake implementations and Python fallback
// mesa_ops/ops.py defines. torch.compile's graphs call them through the dispatcher, without a
// Python frame. They are registered for one dispatch key on request (register_ops, called by
// mesa_ops.ops once this build's kernels are the ones a tensor of that device uses: on CUDA after
// the runtime self-check), never at load time: two builds in one process (the CPU one and the
// CUDA one, which holds the CPU kernels too) must not both claim the CPU key.
#pragma once
#include <torch/extension.h>
#include <torch/library.h>

#include <memory>
#include <string>
#include <tuple>

#include "quant_api.h"

namespace mesa_torch_ops {

// The salt mix of mesa_ops.ops.salt_mix under Mesa's generator base `base`:
// splitmix64(base ^ splitmix64(crc32(salt_name))), as the int64 with the same bits.
inline int64_t salt_mix(int64_t base, const std::string& salt_name) {
  const uint64_t salt = mesa::crc32_bytes(reinterpret_cast<const uint8_t*>(salt_name.data()), salt_name.size());
  return static_cast<int64_t>(mesa::splitmix64(static_cast<uint64_t>(base) ^ mesa::splitmix64(salt)));
}

// A non-finite activation's report by mesa_ops.ops.native_nonfinite(flags, mode, name, shape),
// handed over by register_ops (under the GIL): at once on the CPU (a FloatingPointError or one
// warning, as the eager path), deferred on CUDA (the flags stay on the device). A Python
// exception it raises propagates to the caller.
inline py::object*& nonfinite_callback() {
  static py::object* fn = nullptr;  // (never destroyed: the interpreter may be gone when statics are)
  return fn;
}

inline void report_nonfinite(const at::Tensor& flags, const std::string& mode, const std::string& name,
                             at::IntArrayRef shape) {
  py::object* fn = nonfinite_callback();
  TORCH_CHECK(fn != nullptr && Py_IsInitialized(), "mesa ", name, ": a non-finite activation and no Python to ",
              "report it to (mesa_ops.ops registers the report with the kernels)");
  py::gil_scoped_acquire gil;
  (*fn)(flags, mode, name, shape.vec());
}

// mesa::quantize_step(x, groups, inner, clip_val!, shift!, iteration!, decay, one_minus_decay,
// range_mode, bits, update, base, draws!, stochastic, nonfinite_mode, name, salt_name)
// -> (packed codes, (4, G) rows inv / step / shift / finite; two allocations: a torch op's outputs
// may not share storage): the range update and the codes of a contiguous x in one call, seeded as the eager step (torch's generator state hashed with the
// salt mix of `salt_name` under `base`, and the draw counter, advanced when `update`).
template <bool kCuda>
std::tuple<at::Tensor, at::Tensor> quantize_step(const at::Tensor& x, int64_t groups, int64_t inner,
                                                 at::Tensor clip_val, at::Tensor shift, at::Tensor iteration,
                                                 double decay, double one_minus_decay, int64_t range_mode,
                                                 int64_t bits, bool update, int64_t base, at::Tensor draws,
                                                 bool stochastic, c10::string_view nonfinite_mode,
                                                 c10::string_view name, c10::string_view salt_name) {
  const std::string mode(nonfinite_mode.data(), nonfinite_mode.size());
  const int64_t mix = stochastic ? salt_mix(base, std::string(salt_name.data(), salt_name.size())) : 0;
  at::Tensor packed, rows;
  bool finite = true;
#ifdef MESA_WITH_CUDA
  if constexpr (kCuda) {
    auto r = mesa::quantize_step_cuda(x, groups, inner, clip_val, shift, iteration, decay, one_minus_decay,
                                      range_mode, bits, update, mix, draws, stochastic, mode == "skip",
                                      stochastic, std::nullopt, std::nullopt, std::nullopt);
    packed = std::get<0>(r);
    rows = std::get<3>(r);
    finite = false;  // (not known on the host: deferred)
  }
#endif
  if constexpr (!kCuda) {
    auto r = mesa::quantize_step_cpu_own_rows(x, groups, inner, clip_val, shift, iteration, decay,
                                              one_minus_decay, range_mode, bits, update, mix, draws, stochastic,
                                              mode == "skip", stochastic);
    packed = std::get<0>(r);
    finite = std::get<1>(r);
    rows = std::get<2>(r);
  }
  if (!finite) report_nonfinite(rows[3], mode, std::string(name.data(), name.size()), x.sizes());
  return {packed, rows};
}

// mesa::unpack(packed, step, shift, bits, groups, inner, numel, dtype) -> (numel,) of dtype:
// code * step + shift per group (mesa_ops.ops.dequantize).
template <bool kCuda>
at::Tensor unpack(const at::Tensor& packed, const at::Tensor& step, const at::Tensor& shift, int64_t bits,
                  int64_t groups, int64_t inner, int64_t numel, at::ScalarType dtype) {
#ifdef MESA_WITH_CUDA
  if constexpr (kCuda) return mesa::dequantize_cuda(packed, step, shift, bits, groups, inner, numel, dtype);
#endif
  return mesa::dequantize_cpu(packed, step, shift, bits, groups, inner, numel, dtype);
}

// mesa::pack(x, inv, shift, bits, groups, inner) -> packed codes of a contiguous x rounded to
// nearest (no draw: the ReLU's 1-bit mask).
template <bool kCuda>
at::Tensor pack(const at::Tensor& x, const at::Tensor& inv, const at::Tensor& shift, int64_t bits, int64_t groups,
                int64_t inner) {
#ifdef MESA_WITH_CUDA
  if constexpr (kCuda) return mesa::quantize_cuda(x, inv, shift, bits, groups, inner, 0, false);
#endif
  return mesa::quantize_cpu(x, inv, shift, bits, groups, inner, 0, false);
}

// mesa::lut_apply(packed, table, bits, groups, inner, numel, mul?) -> (numel,) of table's dtype:
// table[group][code] (* mul): a function of a stored tensor through a per-group table (GELU).
template <bool kCuda>
at::Tensor lut_apply(const at::Tensor& packed, const at::Tensor& table, int64_t bits, int64_t groups,
                     int64_t inner, int64_t numel, const std::optional<at::Tensor>& mul) {
  at::Tensor out = at::empty({numel}, packed.options().dtype(table.scalar_type()));
  std::optional<at::Tensor> m;
  if (mul.has_value()) m = mul->contiguous();
#ifdef MESA_WITH_CUDA
  if constexpr (kCuda) return mesa::lut_apply_out_cuda(packed, table.contiguous(), bits, groups, inner, out, m,
                                                       std::nullopt);
#endif
  return mesa::lut_apply_out_cpu(packed, table.contiguous(), bits, groups, inner, out, m, std::nullopt);
}

// The libraries holding this build's kernels of the ops, per key (none: not registered).
inline std::unique_ptr<torch::Library>& library(bool cuda) {
  static std::unique_ptr<torch::Library> cpu_lib, cuda_lib;
  return cuda ? cuda_lib : cpu_lib;
}

// A library holding this build's kernels of the four ops for one dispatch key.
template <bool kCuda>
std::unique_ptr<torch::Library> make_library() {
  auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "mesa",
                                              kCuda ? c10::DispatchKey::CUDA : c10::DispatchKey::CPU, __FILE__,
                                              __LINE__);
  lib->impl("quantize_step", TORCH_FN(quantize_step<kCuda>));
  lib->impl("unpack", TORCH_FN(unpack<kCuda>));
  lib->impl("pack", TORCH_FN(pack<kCuda>));
  lib->impl("lut_apply", TORCH_FN(lut_apply<kCuda>));
  return lib;
}

// Register this build's kernels of the ops for `key` ("cpu" or "cuda", the latter only in a CUDA
// build), with `report` the non-finite report (mesa_ops.ops.native_nonfinite; called with the GIL
// held, from Python); returns false where this build has none for that key.
inline bool register_ops(const std::string& key, py::object report) {
  if (nonfinite_callback() == nullptr) nonfinite_callback() = new py::object(std::move(report));
  if (key == "cpu") {
    if (!library(false)) library(false) = make_library<false>();
    return true;
  }
#if defined(MESA_WITH_CUDA) && !defined(MESA_CUDA_EMULATION)
  if (key == "cuda") {
    if (!library(true)) library(true) = make_library<true>();
    return true;
  }
#endif
  return false;
}

// Withdraw this build's kernels for `key` (the ops' Python fallback runs again).
inline void unregister_ops(const std::string& key) { library(key == "cuda").reset(); }

}  // namespace mesa_torch_ops

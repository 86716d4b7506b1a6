// The one binding file of Mesa's extension: CPU ops always, CUDA ops when built with MESA_WITH_CUDA.
#include <torch/extension.h>

#include "quant_api.h"
#include "step_plan.h"
#include "torch_ops.h"
#if defined(MESA_CUDA_EMULATION)
#include "cuda_emulation.h"
#endif

namespace {
at::ScalarType to_dtype(int64_t code) { return static_cast<at::ScalarType>(code); }

at::ScalarType dtype_of(const py::object& dtype) { return torch::python::detail::py_object_to_dtype(dtype); }

// a contiguous (B, L, H * D) token layout as its (B, H, L, D) heads where heads > 0: the strided
// tensor t.view(B, L, H, D).transpose(1, 2) is, over t's storage, made without a dispatch (a
// restored tensor: no autograd history to keep)
at::Tensor split_heads(const at::Tensor& t, int64_t heads) {
  if (heads <= 0) return t;
  TORCH_CHECK(t.dim() == 3 && t.size(2) % heads == 0 && t.is_contiguous(), "mesa restore: heads=", heads,
              " does not split a contiguous (B, L, H * D) tensor of shape ", t.sizes());
  const int64_t B = t.size(0), L = t.size(1), D = t.size(2) / heads;
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(t.storage()), t.key_set(), t.dtype());
  const int64_t sizes[] = {B, heads, L, D}, strides[] = {L * heads * D, D, heads * D, 1};
  impl->set_sizes_and_strides(at::IntArrayRef(sizes), at::IntArrayRef(strides), t.storage_offset());
  return at::Tensor(std::move(impl));
}

// one call of a *_many op: a sequence of the single op's n arguments
py::sequence call_args(const py::handle& h, size_t n, const char* many, const char* single) {
  const py::sequence t = h.cast<py::sequence>();
  TORCH_CHECK(t.size() == n, "mesa ", many, ": each call is ", single, "'s ", n, " arguments, got ", t.size());
  return t;
}

std::optional<at::Tensor> opt_tensor(const py::handle& h) {
  return h.is_none() ? std::optional<at::Tensor>() : std::optional<at::Tensor>(h.cast<at::Tensor>());
}

// step_plan_<suffix>(kernel)(the plan's arguments): a mesa::StepPlan running `kernel`
template <typename Kernel>
auto make_plan(Kernel kernel) {
  return [kernel](const at::Tensor& x, bool amp16, const std::optional<at::Tensor>& mean,
                  const std::optional<at::Tensor>& rstd, py::object env, int64_t transposed, int64_t groups,
                  int64_t inner, double decay, double one_minus, int64_t range_mode, int64_t bits,
                  bool stochastic, bool mark_nonfinite, std::vector<int64_t> head_shape, py::object stored_dtype,
                  py::object qtensor_type, py::object shape, const at::Tensor& it, const at::Tensor& draws) {
    return mesa::StepPlan(kernel, x, amp16, mean, rstd, std::move(env), transposed, groups, inner, decay,
                          one_minus, range_mode, bits, stochastic, mark_nonfinite, std::move(head_shape),
                          std::move(stored_dtype), std::move(qtensor_type), std::move(shape), it, draws);
  };
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Mesa: packed low-bit activation storage (quantize / dequantize / per-group min-max)";
  py::class_<mesa::StepPlan>(m, "StepPlan", py::module_local())  // (each build of the extension its own)
      .def("__call__", &mesa::StepPlan::call, py::arg("x"), py::arg("clip_val"), py::arg("shift"),
           py::arg("iteration"), py::arg("draws"), py::arg("update"), py::arg("mix"), py::arg("mean"),
           py::arg("rstd"), py::arg("amp16"), py::arg("env"))
      .def("see", &mesa::StepPlan::see, "the state the quantizer left after its Python path");
  m.def("step_plan_cpu", make_plan(&mesa::quantize_step_cpu_plan),
        "the quantizer's one-call step for one input layout on the CPU kernels (mesa::StepPlan)");
  m.def("quantize_cpu", &mesa::quantize_cpu, "quantize a CPU tensor (contiguous or row-strided) to packed codes");
  m.def("dequantize_cpu", [](const at::Tensor& p, const at::Tensor& st, const at::Tensor& sh, int64_t bits,
                             int64_t groups, int64_t inner, int64_t numel, py::object dtype) {
    return mesa::dequantize_cpu(p, st, sh, bits, groups, inner, numel,
                                torch::python::detail::py_object_to_dtype(dtype));
  });
  m.def("dequantize_out_cpu", &mesa::dequantize_out_cpu,
        "dequantize into a contiguous CPU tensor (the exact prefix rows of head over its first rows)",
        py::arg("packed"), py::arg("step"), py::arg("shift"), py::arg("bits"), py::arg("groups"),
        py::arg("inner"), py::arg("out"), py::arg("head") = py::none());
  m.def("restore_cpu", [](const at::Tensor& p, const at::Tensor& st, const at::Tensor& sh, int64_t bits,
                          int64_t groups, int64_t inner, at::IntArrayRef shape, py::object dtype,
                          const std::optional<at::Tensor>& head, int64_t heads) {
    at::Tensor out = at::empty(shape, p.options().dtype(dtype_of(dtype)));
    return split_heads(mesa::dequantize_out_cpu(p, st, sh, bits, groups, inner, out, head), heads);
  }, "dequantize into a new CPU tensor of the given shape and dtype (head: its exact prefix rows)",
        py::arg("packed"), py::arg("step"), py::arg("shift"), py::arg("bits"), py::arg("groups"),
        py::arg("inner"), py::arg("shape"), py::arg("dtype"), py::arg("head") = py::none(), py::arg("heads") = 0);
  m.def("lut_apply_out_cpu", &mesa::lut_apply_out_cpu,
        "out = table[group][code] (* mul): a function of a stored tensor through a per-group table",
        py::arg("packed"), py::arg("table"), py::arg("bits"), py::arg("groups"), py::arg("inner"),
        py::arg("out"), py::arg("mul") = py::none(), py::arg("head") = py::none());
  m.def("levels_cpu", [](const at::Tensor& st, const at::Tensor& sh, int64_t bits, py::object dtype) {
    return mesa::levels_cpu(st, sh, bits, torch::python::detail::py_object_to_dtype(dtype));
  }, "(G, 2^bits) values each group's codes dequantize to");
  m.def("group_minmax_cpu", &mesa::group_minmax_cpu, "per-group (min, max) as a (2, G) float tensor");
  m.def("range_update_cpu", &mesa::range_update_cpu,
        "running-range update in place; returns (4, G): inv, step, shift, finite");
  m.def("quantize_step_cpu", &mesa::quantize_step_cpu,
        "range_update_cpu + quantize_cpu in one call, seeded from a draw counter: (packed, step, shift, all finite, (4, G) rows); "
        "with row_mean/row_rstd (one per row of x) it stores (x - mean) * rstd; with head its first rows along dim -2 exactly",
        py::arg("x"), py::arg("groups"), py::arg("inner"), py::arg("clip_val"), py::arg("shift"),
        py::arg("iteration"), py::arg("decay"), py::arg("one_minus_decay"), py::arg("range_mode"),
        py::arg("bits"), py::arg("update"), py::arg("seed_prefix"), py::arg("draws"),
        py::arg("stochastic"), py::arg("mark_nonfinite"), py::arg("prefix_of_mix") = false,
        py::arg("row_mean") = py::none(), py::arg("row_rstd") = py::none(),
        py::arg("head") = py::none());
  // the layers' gradient math (any device; dtypes as torch.dtype objects, None where unused)
  m.def("linear_backward", [](const at::Tensor& gy, const at::Tensor& x, const at::Tensor& w, bool affine,
                              const std::optional<at::Tensor>& a, const std::optional<at::Tensor>& c,
                              bool need_x, bool need_w, bool need_b, py::object cdt, py::object x_dtype,
                              py::object w_dtype, py::object b_dtype) {
    return mesa::linear_backward(gy, x, w, affine, a, c, need_x, need_w, need_b, dtype_of(cdt),
                                 dtype_of(x_dtype), dtype_of(w_dtype),
                                 b_dtype.is_none() ? at::kFloat : dtype_of(b_dtype));
  }, "functional/linear.py's _Linear.backward after its restore: (gx, gw, gb)");
  m.def("layer_norm_backward", [](const at::Tensor& gy, const at::Tensor& xh, const at::Tensor& rstd,
                                  const at::Tensor& zero, const at::Tensor& one,
                                  const std::optional<at::Tensor>& w, const std::optional<at::Tensor>& b,
                                  std::vector<int64_t> normalized_shape, bool need_x, bool need_w, bool need_b,
                                  bool own_sums, py::object cdt, py::object x_dtype, py::object w_dtype,
                                  py::object b_dtype) {
    return mesa::layer_norm_backward(gy, xh, rstd, zero, one, w, b, normalized_shape, need_x, need_w, need_b,
                                     own_sums, dtype_of(cdt), dtype_of(x_dtype),
                                     w_dtype.is_none() ? at::kFloat : dtype_of(w_dtype),
                                     b_dtype.is_none() ? at::kFloat : dtype_of(b_dtype));
  }, "functional/norm.py's _LayerNorm.backward after its restore: (gx, gw, gb)");
  m.def("gelu_table", [](const at::Tensor& x, const std::optional<at::Tensor>& grad, const std::string& approximate,
                         py::object dtype) { return mesa::gelu_table(x, grad, approximate, dtype_of(dtype)); },
        "GELU of x (with grad: grad * GELU'(x)) in dtype (on the CPU computed in float64)");
  m.def("register_ops", &mesa_torch_ops::register_ops,
        "register this build's kernels of the torch ops mesa::quantize_step / unpack / pack / lut_apply for "
        "'cpu' or 'cuda' with the non-finite report (cuda/torch_ops.h): false where it has none for that key");
  m.def("unregister_ops", &mesa_torch_ops::unregister_ops, "withdraw this build's kernels of those ops for a key");
  m.def("generator_fingerprint_cpu", &mesa::generator_fingerprint_cpu,
        "CRC-32 of the first 64 bytes of torch's default CPU generator state (= mesa_ops.ops.torch_fingerprint)");
#ifdef MESA_WITH_CUDA
  m.attr("with_cuda") = true;
#ifdef MESA_CUDA_EMULATION
  m.attr("emulated") = true;  // the CUDA ops below run their kernels on CPU tensors
  m.def("set_index64", [](bool on) { mesa_emu::state().force_index64 = on; },
        "emulation only: run the kernels' 64-bit-index variants whatever the sizes");
  m.def("set_coop_blocks", [](int64_t n) { mesa_emu::state().coop_blocks = static_cast<int>(n); },
        "emulation only: blocks a cooperative launch may have (0: none, quantize_step takes two launches)");
  m.def("launches", []() { return static_cast<int64_t>(mesa_emu::state().launches); },
        "emulation only: kernel launches so far in this thread");
  m.def("vector_accesses", []() { return static_cast<int64_t>(mesa_emu::state().vector_accesses); },
        "emulation only: the kernels' wide (vector) loads and stores so far in this thread");
#else
  m.attr("emulated") = false;
#endif
  m.def("quantize_cuda", &mesa::quantize_cuda, "quantize a CUDA tensor (contiguous or row-strided) to packed codes");
  m.def("dequantize_cuda", [](const at::Tensor& p, const at::Tensor& st, const at::Tensor& sh, int64_t bits,
                              int64_t groups, int64_t inner, int64_t numel, py::object dtype) {
    return mesa::dequantize_cuda(p, st, sh, bits, groups, inner, numel,
                                 torch::python::detail::py_object_to_dtype(dtype));
  });
  m.def("dequantize_out_cuda", &mesa::dequantize_out_cuda,
        "dequantize into a contiguous CUDA tensor (the exact prefix rows of head over its first rows)",
        py::arg("packed"), py::arg("step"), py::arg("shift"), py::arg("bits"), py::arg("groups"),
        py::arg("inner"), py::arg("out"), py::arg("head") = py::none());
  m.def("restore_cuda", [](const at::Tensor& p, const at::Tensor& st, const at::Tensor& sh, int64_t bits,
                          int64_t groups, int64_t inner, at::IntArrayRef shape, py::object dtype,
                          const std::optional<at::Tensor>& head, int64_t heads) {
    at::Tensor out = at::empty(shape, p.options().dtype(dtype_of(dtype)));
    return split_heads(mesa::dequantize_out_cuda(p, st, sh, bits, groups, inner, out, head), heads);
  }, "dequantize into a new tensor of the given shape and dtype on packed's device",
        py::arg("packed"), py::arg("step"), py::arg("shift"), py::arg("bits"), py::arg("groups"),
        py::arg("inner"), py::arg("shape"), py::arg("dtype"), py::arg("head") = py::none(), py::arg("heads") = 0);
  m.def("lut_apply_out_cuda", &mesa::lut_apply_out_cuda,
        "out = table[group][code] (* mul) on CUDA", py::arg("packed"), py::arg("table"),
        py::arg("bits"), py::arg("groups"), py::arg("inner"), py::arg("out"), py::arg("mul") = py::none(),
        py::arg("head") = py::none());
  m.def("levels_cuda", [](const at::Tensor& st, const at::Tensor& sh, int64_t bits, py::object dtype) {
    return mesa::levels_cuda(st, sh, bits, torch::python::detail::py_object_to_dtype(dtype));
  }, "(G, 2^bits) values each group's codes dequantize to");
  m.def("group_minmax_cuda", &mesa::group_minmax_cuda, "per-group (min, max) as a (2, G) float tensor");
  m.def("range_update_cuda", &mesa::range_update_cuda,
        "running-range update in place on the GPU; returns (4, G): inv, step, shift, finite");
  m.def("quantize_step_cuda",
        [](const at::Tensor& x, int64_t groups, int64_t inner, at::Tensor clip_val, at::Tensor shift,
           at::Tensor iteration, double decay, double one_minus_decay, int64_t range_mode,
           int64_t bits, bool update, int64_t seed_prefix, at::Tensor draws, bool stochastic,
           bool mark_nonfinite, bool prefix_of_mix, const std::optional<at::Tensor>& row_mean,
           const std::optional<at::Tensor>& row_rstd, const std::optional<at::Tensor>& head) {
          auto r = mesa::quantize_step_cuda(x, groups, inner, clip_val, shift, iteration, decay,
                                            one_minus_decay, range_mode, bits, update, seed_prefix,
                                            draws, stochastic, mark_nonfinite, prefix_of_mix,
                                            row_mean, row_rstd, head);
          // None where the CPU op returns its host flag: on the GPU it stays on the device
          return py::make_tuple(std::get<0>(r), std::get<1>(r), std::get<2>(r), py::none(), std::get<3>(r));
        },
        "quantize_step_cpu's twin on CUDA: (packed, step, shift, None, (4, G) rows)",
        py::arg("x"), py::arg("groups"), py::arg("inner"), py::arg("clip_val"), py::arg("shift"),
        py::arg("iteration"), py::arg("decay"), py::arg("one_minus_decay"), py::arg("range_mode"),
        py::arg("bits"), py::arg("update"), py::arg("seed_prefix"), py::arg("draws"),
        py::arg("stochastic"), py::arg("mark_nonfinite"), py::arg("prefix_of_mix") = false,
        py::arg("row_mean") = py::none(), py::arg("row_rstd") = py::none(),
        py::arg("head") = py::none());
  m.def("step_plan_cuda", make_plan([](const at::Tensor& x, int64_t groups, int64_t inner, at::Tensor clip,
                                        at::Tensor shift, at::Tensor it, double decay, double one_minus,
                                        int64_t range_mode, int64_t bits, bool update, int64_t mix, at::Tensor draws,
                                        bool stochastic, bool mark_nonfinite, const std::optional<at::Tensor>& mean,
                                        const std::optional<at::Tensor>& rstd, const std::vector<int64_t>& head_sizes,
                                        at::ScalarType head_dtype) {
          std::optional<at::Tensor> head;
          if (!head_sizes.empty()) head = at::empty(head_sizes, x.options().dtype(head_dtype));
          auto r = mesa::quantize_step_cuda(x, groups, inner, clip, shift, it, decay, one_minus, range_mode, bits,
                                            update, mix, draws, stochastic, mark_nonfinite, stochastic, mean, rstd,
                                            head);
          return mesa::StepResult(std::get<0>(r), std::get<1>(r), std::get<2>(r), std::nullopt, std::get<3>(r),
                                  head.has_value() ? *head : at::Tensor());
        }), "the quantizer's one-call step for one input layout on the CUDA kernels (mesa::StepPlan)");
  m.def("quantize_step_many_cuda",
        [](const py::list& calls) {
          std::vector<mesa::StepArgs> args;
          for (const py::handle& h : calls) {
            const py::sequence t = call_args(h, 19, "quantize_step_many_cuda", "quantize_step_cuda");
            args.push_back(mesa::StepArgs{
                t[0].cast<at::Tensor>(), t[1].cast<int64_t>(), t[2].cast<int64_t>(),
                t[3].cast<at::Tensor>(), t[4].cast<at::Tensor>(), t[5].cast<at::Tensor>(),
                t[6].cast<double>(), t[7].cast<double>(), t[8].cast<int64_t>(), t[9].cast<int64_t>(),
                t[10].cast<bool>(), t[11].cast<int64_t>(), t[12].cast<at::Tensor>(), t[13].cast<bool>(),
                t[14].cast<bool>(), t[15].cast<bool>(), opt_tensor(t[16]), opt_tensor(t[17]), opt_tensor(t[18])});
          }
          py::list out;
          for (const auto& r : mesa::quantize_step_many_cuda(args))
            out.append(py::make_tuple(std::get<0>(r), std::get<1>(r), std::get<2>(r), py::none(), std::get<3>(r)));
          return out;
        },
        "several quantize_step_cuda calls (each a tuple of its 19 arguments), in one launch where they "
        "can share one (at most 3, one dtype): a list of their results");
  m.def("dequantize_out_many_cuda",
        [](const py::list& calls) {
          std::vector<mesa::RestoreArgs> args;
          for (const py::handle& h : calls) {
            const py::sequence t = call_args(h, 8, "dequantize_out_many_cuda", "dequantize_out_cuda");
            args.push_back(mesa::RestoreArgs{
                t[0].cast<at::Tensor>(), t[1].cast<at::Tensor>(), t[2].cast<at::Tensor>(),
                t[3].cast<int64_t>(), t[4].cast<int64_t>(), t[5].cast<int64_t>(), t[6].cast<at::Tensor>(),
                opt_tensor(t[7])});
          }
          return mesa::dequantize_out_many_cuda(args);
        },
        "several dequantize_out_cuda calls (each a tuple of its 8 arguments), in one launch where the "
        "outs share a dtype (at most 3): the outs");
  m.def("generator_fingerprint_cuda", &mesa::generator_fingerprint_cuda,
        "CRC-32 of the 16-byte state of torch's default CUDA generator of a device");
#else
  m.attr("with_cuda") = false;
#endif
}

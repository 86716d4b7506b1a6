// A quantizer's one-call kernel step for one input layout, as a native object (issue 48: host
// time). mesa_ops.quant.QuantMixin._step_plan decides, once per input layout and setting, what the
// kernel is passed; this object then runs the whole eager path of a stored activation in one call:
// the checks that the input has that layout and the running state is as the quantizer last left
// it, the exact prefix rows' buffer, the range update and codes (quantize_step_cpu / _cuda), and
// the QTensor. Where a check fails it returns None and the quantizer takes its Python path (which
// decides again, re-reads the draw counter, and shows the object the state it left).
#pragma once
#include <torch/extension.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace mesa {

// (StepResult: quant_api.h) head_sizes / head_dtype: the exact prefix rows to make (empty: none)
using StepKernel = std::function<StepResult(const at::Tensor& x, int64_t groups, int64_t inner,
                                            at::Tensor clip, at::Tensor shift, at::Tensor it,
                                            double decay, double one_minus, int64_t range_mode,
                                            int64_t bits, bool update, int64_t mix, at::Tensor draws,
                                            bool stochastic, bool mark_nonfinite,
                                            const std::optional<at::Tensor>& mean,
                                            const std::optional<at::Tensor>& rstd,
                                            const std::vector<int64_t>& head_sizes,
                                            at::ScalarType head_dtype)>;

// (hidden, as the pybind11 objects it holds: one extension's own type)
class __attribute__((visibility("hidden"))) StepPlan {
 public:
  // x, mean / rstd: an input and row statistics of the layout the plan is for (their sizes,
  // strides, dtype, device are the key, with amp16 and MESA_BACKEND's value `env`); it / draws:
  // the quantizer's state as it left it; qtensor_type / shape / stored_dtype: the QTensor's class
  // and fields; head_shape: the exact prefix rows' shape (empty: none).
  StepPlan(StepKernel kernel, const at::Tensor& x, bool amp16, const std::optional<at::Tensor>& mean,
           const std::optional<at::Tensor>& rstd, py::object env, int64_t transposed, int64_t groups,
           int64_t inner, double decay, double one_minus, int64_t range_mode, int64_t bits,
           bool stochastic, bool mark_nonfinite, std::vector<int64_t> head_shape, py::object stored_dtype,
           py::object qtensor_type, py::object shape, const at::Tensor& it, const at::Tensor& draws)
      : kernel_(std::move(kernel)), sizes_(x.sizes().vec()), strides_(x.strides().vec()),
        dtype_(x.scalar_type()), device_(x.device()), amp16_(amp16), env_(std::move(env)),
        transposed_(transposed), groups_(groups), inner_(inner), decay_(decay), one_minus_(one_minus),
        range_mode_(range_mode), bits_(bits), stochastic_(stochastic), mark_nonfinite_(mark_nonfinite),
        head_shape_(std::move(head_shape)), stored_dtype_(std::move(stored_dtype)),
        stored_scalar_(torch::python::detail::py_object_to_dtype(stored_dtype_)),
        qtensor_type_(std::move(qtensor_type)), shape_(std::move(shape)),
        tuple_new_(py::module_::import("builtins").attr("tuple").attr("__new__")),
        bits_obj_(py::int_(bits)), groups_obj_(py::int_(groups)), inner_obj_(py::int_(inner)),
        transposed_obj_(py::int_(transposed)) {
    has_norm_ = mean.has_value() && mean->defined();
    if (has_norm_) {
      norm_sizes_ = mean->sizes().vec();
      mean_strides_ = mean->strides().vec();
      rstd_strides_ = rstd->strides().vec();
    }
    see(it, draws);
  }

  // The state the quantizer leaves after a call of its Python path.
  void see(const at::Tensor& it, const at::Tensor& draws) {
    it_ = it;
    it_version_ = it._version();
    draws_ = draws;
    draws_version_ = draws._version();
  }

  // The packed copy of x as (QTensor, None) or, where a non-finite activation must be reported
  // (the CPU's flag says so; on CUDA always: the flags stay on the device), (QTensor, rows); None
  // where x or the state differ from what the plan is for.
  py::object call(const at::Tensor& x, const at::Tensor& clip, const at::Tensor& shift,
                  const at::Tensor& it, const at::Tensor& draws, bool update, int64_t mix,
                  const std::optional<at::Tensor>& mean, const std::optional<at::Tensor>& rstd,
                  bool amp16, const py::object& env) {
    if (!matches(x, mean, rstd, amp16, env) || !it.is_same(it_) ||
        it._version() != it_version_ || !draws.is_same(draws_) ||
        draws._version() != draws_version_ || !draws.device().is_cpu() ||
        clip.scalar_type() != at::kFloat || shift.scalar_type() != at::kFloat ||
        it.scalar_type() != at::kFloat)
      return py::none();
    const at::Tensor xs = transposed_ == 0   ? x
                          : transposed_ == 1 ? x.transpose(-2, -1)
                                             : x.permute({0, 2, 3, 1});
    const StepResult r = kernel_(xs, groups_, inner_, clip, shift, it, decay_, one_minus_, range_mode_,
                                 bits_, update, mix, draws, stochastic_, mark_nonfinite_, mean, rstd, head_shape_,
                                 stored_scalar_);
    py::object head_obj = py::none();
    if (std::get<5>(r).defined()) {
      head_obj = py::cast(std::get<5>(r));
      head_obj.attr("_mesa_head") = true;  // (the audit counts it with the packed copy)
    }
    py::object q = tuple_new_(qtensor_type_,
                              py::make_tuple(std::get<0>(r), std::get<1>(r), std::get<2>(r), shape_,
                                             stored_dtype_, bits_obj_, groups_obj_, inner_obj_,
                                             transposed_obj_, head_obj));
    const std::optional<bool>& finite = std::get<3>(r);
    return py::make_tuple(q, finite.has_value() && *finite ? py::object(py::none()) : py::cast(std::get<4>(r)));
  }

 private:
  bool matches(const at::Tensor& x, const std::optional<at::Tensor>& mean,
               const std::optional<at::Tensor>& rstd, bool amp16, const py::object& env) const {
    if (amp16 != amp16_ || x.scalar_type() != dtype_ || x.device() != device_ ||
        x.sizes() != at::IntArrayRef(sizes_) || x.strides() != at::IntArrayRef(strides_) ||
        !env.equal(env_))
      return false;
    const bool norm = mean.has_value() && mean->defined();
    if (norm != has_norm_) return false;
    return !norm || (mean->scalar_type() == at::kFloat && mean->sizes() == at::IntArrayRef(norm_sizes_) &&
                     mean->strides() == at::IntArrayRef(mean_strides_) &&
                     rstd->strides() == at::IntArrayRef(rstd_strides_));
  }

  StepKernel kernel_;
  std::vector<int64_t> sizes_, strides_;
  at::ScalarType dtype_;
  at::Device device_;
  bool amp16_;
  py::object env_;
  bool has_norm_ = false;
  std::vector<int64_t> norm_sizes_, mean_strides_, rstd_strides_;
  int64_t transposed_, groups_, inner_;
  double decay_, one_minus_;
  int64_t range_mode_, bits_;
  bool stochastic_, mark_nonfinite_;
  std::vector<int64_t> head_shape_;
  py::object stored_dtype_;
  at::ScalarType stored_scalar_;
  py::object qtensor_type_, shape_, tuple_new_, bits_obj_, groups_obj_, inner_obj_, transposed_obj_;
  at::Tensor it_, draws_;  // (held: an address of a freed tensor could come back)
  int64_t it_version_ = 0, draws_version_ = 0;
};

}  // namespace mesa

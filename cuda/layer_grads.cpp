// The gradient math of Mesa's Linear, LayerNorm and GELU backwards in one native call each (issue
// 48: host time). Composites of ATen ops, so one body serves every device (CPU, CUDA, fake tensors
// of the tests): the same ops, in the same order and dtypes, as the pure-PyTorch versions in
// mesa_ops/functional (the specification, run while torch.compile traces and where the extension
// is not built), which tests compare with these bit for bit.
#include <torch/extension.h>

#include "quant_api.h"

namespace mesa {
namespace {

bool wide(at::ScalarType t) { return t == at::kFloat || t == at::kDouble; }

at::Tensor as_type(const at::Tensor& t, at::ScalarType dtype) {
  return !t.defined() || t.scalar_type() == dtype ? t : t.to(dtype);
}

// g2^T x for g2 (tokens, out) and x (..., in): (out, in), x in cdt; on the CPU for fewer than
// kThinOut outputs as (x^T g2)^T (its bits do not depend on the thread count: functional/linear.py).
constexpr int64_t kThinOut = 64;

at::Tensor weight_grad(const at::Tensor& g2, const at::Tensor& x, at::ScalarType cdt) {
  const at::Tensor x2 = as_type(x.reshape({-1, x.size(-1)}), cdt);
  if (g2.size(1) < kThinOut && g2.device().is_cpu()) return x2.t().mm(g2).t().contiguous();
  return g2.t().mm(x2);
}

}  // namespace

// functional/linear.py's _Linear.backward after its restore: g (..., out) of the output; x the
// stored input restored (..., in), or with a LayerNorm's affine map (`a`, `c`: (in,) or
// undefined; `affine`) its x-hat, x = x-hat * a + c; the weight as the forward used it (the
// parameter's dtype: w_dtype). Returns (gx, gw, gb), undefined where not needed.
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_backward(
    const at::Tensor& gy, const at::Tensor& x, const at::Tensor& weight, bool affine,
    const std::optional<at::Tensor>& a_opt, const std::optional<at::Tensor>& c_opt, bool need_x,
    bool need_w, bool need_b, at::ScalarType cdt, at::ScalarType x_dtype, at::ScalarType w_dtype,
    at::ScalarType b_dtype) {
  const at::Tensor a = a_opt.value_or(at::Tensor()), c = c_opt.value_or(at::Tensor());
  const at::Tensor g = as_type(gy, cdt);
  const at::Tensor g2 = g.reshape({-1, g.size(-1)});  // (tokens, out)
  at::Tensor gx, gw, gb, gsum;
  if (need_x) {
    gx = g2.mm(as_type(weight, cdt));
    std::vector<int64_t> shape(g.sizes().begin(), g.sizes().end() - 1);
    shape.push_back(gx.size(-1));
    gx = as_type(gx.view(shape), x_dtype);
  }
  if (need_b) gsum = g2.sum(0);
  if (need_w) {
    if (affine && g2.size(0) < g2.size(1)) {  // fewer tokens than outputs: x restored
      at::Tensor xa;
      if (!a.defined() && !c.defined()) {
        xa = as_type(x, cdt);
      } else {
        xa = at::empty(x.sizes(), x.options().dtype(cdt));
        if (!c.defined()) at::mul_out(xa, x, as_type(a, x.scalar_type()));
        else if (!a.defined()) at::add_out(xa, x, as_type(c, x.scalar_type()));
        else at::addcmul_out(xa, as_type(c, x.scalar_type()), x, as_type(a, x.scalar_type()));
      }
      gw = weight_grad(g2, xa, cdt);
    } else if (affine) {  // gW = (g^T x-hat) * a + outer(sum g, c), in float32 or wider
      gw = weight_grad(g2, x, cdt);
      if (!wide(gw.scalar_type())) gw = gw.to(at::kFloat);
      if (a.defined()) gw.mul_(as_type(a, gw.scalar_type()));
      if (c.defined()) {
        if (!gsum.defined()) gsum = g2.sum(0);
        gw.addr_(as_type(gsum, gw.scalar_type()), as_type(c, gw.scalar_type()));
      }
    } else {
      gw = weight_grad(g2, x, cdt);
    }
    gw = as_type(gw, w_dtype);
  }
  if (need_b) gb = as_type(gsum, b_dtype);
  return {gx, gw, gb};
}

// functional/norm.py's _LayerNorm.backward after its restore: xh the stored x-hat (float32 or
// wider), rstd the forward's statistics; aten's backward with mean `zero` (x-hat's own row mean:
// the x-hat it works with is centred, as exact's) and rstd `one` (x-hat less that mean is its own
// normalized input), the input gradient times rstd; with `own_sums` (CPU,
// float32/64) the weight / bias gradients as column sums in an order that does not depend on the
// thread count. Returns (gx, gw, gb), undefined where not needed.
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward(
    const at::Tensor& gy, const at::Tensor& xh, const at::Tensor& rstd, const at::Tensor& zero,
    const at::Tensor& one, const std::optional<at::Tensor>& w, const std::optional<at::Tensor>& b,
    at::IntArrayRef normalized_shape, bool need_x, bool need_w, bool need_b, bool own_sums,
    at::ScalarType cdt, at::ScalarType x_dtype, at::ScalarType w_dtype, at::ScalarType b_dtype) {
  const at::Tensor g = as_type(gy, cdt);
  const at::Tensor xc = as_type(xh, cdt);
  auto r = at::native_layer_norm_backward(g, xc, normalized_shape, zero, one, w, b,
                                          {need_x, own_sums ? false : need_w, own_sums ? false : need_b});
  at::Tensor gx = std::get<0>(r), gw = std::get<1>(r), gb = std::get<2>(r);
  if (own_sums) {
    std::vector<int64_t> dims;
    for (int64_t d = 0; d < g.dim() - static_cast<int64_t>(normalized_shape.size()); ++d) dims.push_back(d);
    if (need_w) gw = (g * (xc - zero)).sum(dims);  // (zero: x-hat's row mean, functional/norm.py centre)
    if (need_b) gb = g.sum(dims);
  }
  if (gx.defined()) gx = as_type(gx.mul_(rstd), x_dtype);
  return {gx, as_type(gw, w_dtype), as_type(gb, b_dtype)};
}

// GELU of x, or with `grad` its backward (grad * GELU'(x)), in `dtype`: the tables of GELU / GELU'
// at the 2^bits levels of each group that a Mesa GELU's packed input is restored through, and its
// exact prefix rows. On the CPU computed in float64 and rounded once (ATen's own kernel: float32
// GELU there goes to a library primitive whose set-up costs ~6 us a call, for tables of a few
// hundred values made in every backward); elsewhere in x's dtype, one kernel each.
at::Tensor gelu_table(const at::Tensor& x, const std::optional<at::Tensor>& grad, const std::string& approximate,
                      at::ScalarType dtype) {
  const bool has_grad = grad.has_value() && grad->defined();
  if (!x.device().is_cpu())
    return as_type(has_grad ? at::gelu_backward(*grad, x, approximate) : at::gelu(x, approximate), dtype);
  const at::Tensor x64 = x.to(at::kDouble);
  const at::Tensor t = has_grad ? at::gelu_backward(grad->to(at::kDouble), x64, approximate)
                                : at::gelu(x64, approximate);
  return t.to(dtype);
}

}  // namespace mesa

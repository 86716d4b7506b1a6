// CUDA kernels of Mesa's quantizer on the per-element math of quant_math.h: one thread per output
// byte (grid-stride), fp32/fp16/bf16 (and fp64) inputs, launched on the current stream.
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <limits>

#include "quant_math.h"
#include "quant_api.h"

namespace mesa {
namespace {

constexpr int kThreads = 256;

inline int blocks_for(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<int>(std::min<int64_t>(std::max<int64_t>(b, 1), 65535LL * 32));
}

template <typename scalar_t>
__global__ void quantize_kernel(const scalar_t* __restrict__ x, const float* __restrict__ inv,
                                const float* __restrict__ shift, uint8_t* __restrict__ out,
                                int64_t n, int64_t nbytes, int bits, int64_t inner, int64_t groups,
                                uint64_t seed, bool stochastic) {
  const int per = 8 / bits;
  const float maxq = static_cast<float>((1u << bits) - 1u);
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < nbytes;
       k += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    uint32_t byte = 0;
    for (int j = 0; j < per; ++j) {
      const int64_t e = k * per + j;
      if (e >= n) break;
      const float v = static_cast<float>(x[e]);
      uint32_t q;
      if (bits == 1) {
        q = mask_one(v);
      } else {
        const int64_t g = group_of(e, inner, groups);
        q = quantize_one(v, inv[g], shift[g], stochastic ? uniform(seed, e) : 0.5f, maxq);
      }
      byte |= q << (j * bits);
    }
    out[k] = static_cast<uint8_t>(byte);
  }
}

template <typename scalar_t>
__global__ void dequantize_kernel(const uint8_t* __restrict__ in, const float* __restrict__ step,
                                  const float* __restrict__ shift, scalar_t* __restrict__ out,
                                  int64_t n, int bits, int64_t inner, int64_t groups) {
  const int per = 8 / bits;
  const uint32_t mask = (1u << bits) - 1u;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const uint32_t q = (static_cast<uint32_t>(in[e / per]) >> ((e % per) * bits)) & mask;
    const int64_t g = group_of(e, inner, groups);
    out[e] = static_cast<scalar_t>(dequantize_one(q, step[g], shift[g]));
  }
}

}  // namespace

at::Tensor quantize_cuda(const at::Tensor& x, const at::Tensor& inv, const at::Tensor& shift,
                         int64_t bits, int64_t groups, int64_t inner, int64_t seed, bool stochastic) {
  TORCH_CHECK(x.is_cuda(), "mesa quantize_cuda: x must be a CUDA tensor");
  check_quantize_args(x, inv, shift, bits, groups, inner);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = x.numel();
  const int64_t per = 8 / bits;
  const int64_t nbytes = (n + per - 1) / per;
  auto out = at::empty({nbytes}, x.options().dtype(at::kByte));
  if (n == 0) return out;
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "mesa_quantize_cuda", [&] {
    quantize_kernel<scalar_t><<<blocks_for(nbytes), kThreads, 0, stream>>>(
        x.data_ptr<scalar_t>(), inv.data_ptr<float>(), shift.data_ptr<float>(),
        out.data_ptr<uint8_t>(), n, nbytes, static_cast<int>(bits), inner, groups,
        static_cast<uint64_t>(seed), stochastic);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor dequantize_cuda(const at::Tensor& packed, const at::Tensor& step, const at::Tensor& shift,
                           int64_t bits, int64_t groups, int64_t inner, int64_t numel,
                           at::ScalarType dtype) {
  TORCH_CHECK(packed.is_cuda(), "mesa dequantize_cuda: packed must be a CUDA tensor");
  check_dequantize_args(packed, step, shift, bits, groups, inner, numel);
  const c10::cuda::CUDAGuard guard(packed.device());
  auto out = at::empty({numel}, packed.options().dtype(dtype));
  if (numel == 0) return out;
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "mesa_dequantize_cuda", [&] {
    dequantize_kernel<scalar_t><<<blocks_for(numel), kThreads, 0, stream>>>(
        packed.data_ptr<uint8_t>(), step.data_ptr<float>(), shift.data_ptr<float>(),
        out.data_ptr<scalar_t>(), numel, static_cast<int>(bits), inner, groups);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// Per-group (min, max) on the GPU with ATen reductions; a group holding NaN/Inf gets NaN in both
// rows, matching group_minmax_cpu.
at::Tensor group_minmax_cuda(const at::Tensor& x, int64_t groups, int64_t inner) {
  TORCH_CHECK(x.is_cuda(), "mesa group_minmax_cuda: x must be a CUDA tensor");
  TORCH_CHECK(x.is_contiguous(), "mesa group_minmax: x must be contiguous");
  check_group_args("group_minmax", x.numel(), groups, inner);
  const c10::cuda::CUDAGuard guard(x.device());
  auto v = x.view({-1, groups, inner});
  auto mn = v.amin({0, 2}).to(at::kFloat);
  auto mx = v.amax({0, 2}).to(at::kFloat);
  auto bad = (mx - mn).isfinite().logical_not();
  auto nan = at::full_like(mn, std::numeric_limits<float>::quiet_NaN());
  return at::stack({at::where(bad, nan, mn), at::where(bad, nan, mx)});
}

}  // namespace mesa

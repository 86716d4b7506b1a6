// The second half of quant_cuda.cu (included at its end: it uses that file's kernels, device
// functions and launch helpers): quantize_step_kernel, which runs up to kMaxStepJobs
// quantize_steps (the range pass, a grid sync, the finalize, a grid sync, the codes) in one
// cooperative launch, and dequantize_many_kernel; the host ops quantize_step_cuda,
// quantize_step_many_cuda and dequantize_out_many_cuda (issue 36: one launch per stored
// activation, one for an attention's q, k and v).
#pragma once

namespace mesa {
namespace {

// One quantize_step of quantize_step_kernel: x (normalized by rn when NORM) split into chunks
// for the range pass, the partials, what the finalize does, what is packed.
template <typename T, typename I>
struct StepJob {
  DRows<T, I> x;
  DNorm rn;
  I G, inner, per_group, chunk, chunks;
  float* part;
  Finalize fin;
  QuantArgs<I> qa;
};
template <typename T, typename I>
struct StepJobs {
  StepJob<T, I> job[kMaxStepJobs];
  int n;
};

// minmax_kernel + quantize_kernel in one cooperative launch (the grid fits on the device at
// once), for up to kMaxStepJobs tensors (the q, k, v of an attention): for each job in turn the
// blocks reduce its chunks (c, g) = (v % chunks, v / chunks) for v = blockIdx.x, + gridDim.x,
// ...; the grid syncs; block j finalizes job j's range into its rows; the grid syncs; every
// block packs runs of each job in turn with those rows. The same partials, rows and codes as
// the two launches per job.
template <typename T, typename I, bool NORM>
__global__ void quantize_step_kernel(StepJobs<T, I> jobs) {
  __shared__ float s_lo[kThreads];
  __shared__ float s_hi[kThreads];
  __shared__ int s_bad[kThreads];
  const cooperative_groups::grid_group grid = cooperative_groups::this_grid();
  for (int j = 0; j < jobs.n; ++j) {
    const StepJob<T, I>& a = jobs.job[j];
    for (I v = blockIdx.x; v < a.chunks * a.G; v += gridDim.x) {
      minmax_chunk<T, I, NORM>(a.x, a.rn, a.G, a.inner, a.per_group, a.chunk, v % a.chunks,
                               v / a.chunks, a.chunks, a.part, s_lo, s_hi, s_bad);
      __syncthreads();  // (thread 0 has read s_lo[0] / s_hi[0] / s_bad[0] before the next chunk)
    }
  }
  grid.sync();
  for (int j = blockIdx.x; j < jobs.n; j += gridDim.x) {
    const StepJob<T, I>& a = jobs.job[j];
    finalize_ranges<I>(a.part, a.G, a.chunks, a.fin, s_lo, s_hi, s_bad);
    __syncthreads();  // (its shared flags are read by every thread before the next job's)
  }
  grid.sync();
  for (int j = 0; j < jobs.n; ++j) {
    const StepJob<T, I>& a = jobs.job[j];
    quantize_runs<T, I, NORM>(a.x, a.rn, a.qa.out, a.qa.n, a.qa.nbytes, a.qa.bits, a.inner, a.G,
                              a.fin.rows, a.fin.rows + 2 * a.G, a.qa.seed, a.qa.stochastic, a.qa.hd);
  }
}

// dequantize_kernel of up to kMaxStepJobs packed tensors in one launch, one after the other.
template <typename T, typename I>
struct RestoreJob {
  const uint8_t* in;
  const float* step;
  const float* shift;
  T* out;
  I n;
  int bits;
  I inner, G;
  HeadRows hd;
};
template <typename T, typename I>
struct RestoreJobs {
  RestoreJob<T, I> job[kMaxStepJobs];
  int n;
};

template <typename T, typename I>
__global__ void dequantize_many_kernel(RestoreJobs<T, I> jobs) {
  for (int j = 0; j < jobs.n; ++j) {
    const RestoreJob<T, I>& a = jobs.job[j];
    DequantRun<T, I> run{a.step, a.shift};
    restore_runs<T, I>(a.in, a.out, a.n, a.bits, a.inner, a.G, a.hd, run);
  }
}

// One quantize_step's checked arguments and outputs, before its launch.
struct PreparedStep {
  at::Tensor xr, rows, packed;  // x readable in place (a copy only of a layout it cannot read)
  int64_t groups, inner, bits, seed, rn_len, row_len, row_stride;
  bool stochastic;
  const float* mean;
  const float* rstd;
  HeadRows hd;
  Finalize fin;
};

PreparedStep prepare_step(const StepArgs& a) {
  const at::Tensor& x = a.x;
  check_device_input("quantize_step_cuda", x, a.groups, a.inner);
  check_range_args("quantize_step", a.clip_val, a.shift, a.iteration, a.groups, a.range_mode,
                   x.device());
  check_bits("quantize_step", a.bits);
  TORCH_CHECK(x.numel() > 0, "mesa quantize_step_cuda: x is empty");
  TORCH_CHECK(a.groups <= 65535, "mesa quantize_step: at most 65535 groups on CUDA, got ", a.groups);
  PreparedStep p;
  p.groups = a.groups;
  p.inner = a.inner;
  p.bits = a.bits;
  p.stochastic = a.stochastic;
  p.rn_len = row_norm_len("quantize_step_cuda", x, a.inner, a.row_mean, a.row_rstd);
  p.mean = p.rn_len > 0 ? a.row_mean->data_ptr<float>() : nullptr;
  p.rstd = p.rn_len > 0 ? a.row_rstd->data_ptr<float>() : nullptr;
  p.hd = head_rows_of("quantize_step_cuda", a.head, x, p.rn_len > 0);
  p.seed = a.stochastic ? draw_seed(a.draws, static_cast<uint64_t>(a.seed_prefix), a.prefix_of_mix,
                                    a.prefix_of_mix ? generator_fingerprint_cuda(x.device().index()) : 0,
                                    a.update)
                        : 0;
  p.rows = at::empty({4, a.groups}, x.options().dtype(at::kFloat));
#if defined(MESA_CUDA_EMULATION)
  p.rows.fill_(std::numeric_limits<float>::quiet_NaN());  // (a read before its write shows)
#endif
  // a layout the kernels cannot read in place is made contiguous once, for both launches
  p.xr = readable(x, a.inner, &p.row_len, &p.row_stride);
  at::Tensor clip = a.clip_val, shift = a.shift, it = a.iteration;
  p.fin = range_finalize(clip, shift, it, p.rows, a.decay, a.one_minus_decay, a.range_mode, a.bits,
                         a.update, a.mark_nonfinite);
  p.packed = packed_for(p.xr, a.bits);
  return p;
}

// The steps ps (at most kMaxStepJobs, x of one dtype, all or none row-normalized) in one launch
// of quantize_step_kernel, as many blocks as the work wants and the device holds at once; false
// (nothing launched) where coop_capacity is 0 or the driver refuses the launch.
bool launch_quantize_steps(const std::vector<PreparedStep*>& ps) {
  const at::Tensor& x0 = ps[0]->xr;
  const bool norm = ps[0]->mean != nullptr;
  std::vector<ChunkPlan> cps;
  int64_t want = 1, extent = 0;
  for (const PreparedStep* p : ps) {
    cps.push_back(chunk_plan(p->xr.numel(), p->groups));
    const int64_t runs = (p->xr.numel() + kQuantRun - 1) / kQuantRun;
    want = std::max<int64_t>({want, cps.back().chunks * p->groups, blocks_for(runs)});
    extent = std::max<int64_t>(extent, extent_of(p->xr, p->row_len, p->row_stride));
  }
  bool launched = false;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x0.scalar_type(), "mesa_quantize_step_cuda", [&] {
    with_index(extent, [&](auto tag) {
      using I = decltype(tag);
      auto k = norm ? &quantize_step_kernel<scalar_t, I, true> : &quantize_step_kernel<scalar_t, I, false>;
      const int cap = coop_capacity(reinterpret_cast<const void*>(k), kThreads);
      if (cap <= 0) return;
      StepJobs<scalar_t, I> jobs{};
      std::vector<at::Tensor> parts;  // (alive until the launch is queued: stream-ordered reuse)
      jobs.n = static_cast<int>(ps.size());
      for (size_t j = 0; j < ps.size(); ++j) {
        const PreparedStep& p = *ps[j];
        const ChunkPlan& cp = cps[j];
        parts.push_back(at::empty({3, p.groups, cp.chunks}, x0.options().dtype(at::kFloat)));
#if defined(MESA_CUDA_EMULATION)
        parts.back().fill_(std::numeric_limits<float>::quiet_NaN());  // (a read before its write shows)
#endif
        const int64_t n = p.xr.numel(), per = 8 / p.bits;
        jobs.job[j] = StepJob<scalar_t, I>{
            DRows<scalar_t, I>{p.xr.data_ptr<scalar_t>(), static_cast<I>(p.row_len),
                               static_cast<I>(p.row_stride)},
            DNorm{p.mean, p.rstd, std::max<int64_t>(p.rn_len, 1)}, static_cast<I>(p.groups),
            static_cast<I>(p.inner), static_cast<I>(cp.per_group), static_cast<I>(cp.chunk),
            static_cast<I>(cp.chunks), parts.back().data_ptr<float>(), p.fin,
            QuantArgs<I>{p.packed.data_ptr<uint8_t>(), static_cast<I>(n),
                         static_cast<I>((n + per - 1) / per), static_cast<int>(p.bits),
                         static_cast<uint64_t>(p.seed), p.stochastic, p.hd}};
      }
      launched = launch_cooperative(k, static_cast<int>(std::min<int64_t>(cap, want)), kThreads, jobs);
    });
  });
  return launched;
}

// The two launches of one step (minmax_kernel with the range update, quantize_kernel).
void launch_two(const PreparedStep& p) {
  launch_minmax(p.xr, p.groups, p.inner, p.mean, p.rstd, p.rn_len, p.fin);
  const float* r = p.rows.data_ptr<float>();
  launch_quantize(p.xr, r, r + 2 * p.groups, p.bits, p.groups, p.inner, p.seed, p.stochastic,
                  p.packed.data_ptr<uint8_t>(), p.mean, p.rstd, p.rn_len, p.hd);
}

}  // namespace

// quantize_step_cpu's twin: the range update and the packed codes with the exact prefix rows
// when a head is given, in one cooperative launch (quantize_step_kernel), or where there is none
// (coop_capacity) in two (minmax_kernel, finalized on the device, then quantize_kernel). Returns
// (packed, step, shift, (4, G) rows); the binding adds None where the CPU op returns its host
// "all finite" flag.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_step_cuda(
    const at::Tensor& x, int64_t groups, int64_t inner, at::Tensor clip_val, at::Tensor shift,
    at::Tensor iteration, double decay, double one_minus_decay, int64_t range_mode, int64_t bits,
    bool update, int64_t seed_prefix, at::Tensor draws, bool stochastic, bool mark_nonfinite,
    bool prefix_of_mix, const std::optional<at::Tensor>& row_mean,
    const std::optional<at::Tensor>& row_rstd, const std::optional<at::Tensor>& head) {
  return quantize_step_many_cuda({StepArgs{x, groups, inner, clip_val, shift, iteration, decay,
                                           one_minus_decay, range_mode, bits, update, seed_prefix,
                                           draws, stochastic, mark_nonfinite, prefix_of_mix,
                                           row_mean, row_rstd, head}})[0];
}

// The steps in the order given (each draw counter advanced as by calls one after the other):
// one launch for all where they share a device, a dtype and row normalization, number at most
// kMaxStepJobs and update no running state in common; else one step (or two launches) at a time.
std::vector<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>> quantize_step_many_cuda(
    const std::vector<StepArgs>& calls) {
  TORCH_CHECK(!calls.empty(), "mesa quantize_step_many: no calls");
  std::vector<PreparedStep> ps;
  ps.reserve(calls.size());
  bool together = calls.size() <= static_cast<size_t>(kMaxStepJobs);
  for (size_t j = 0; j < calls.size(); ++j) {
    const StepArgs& c = calls[j];
    ps.push_back(prepare_step(c));  // (checks x first: a CPU x is named as such)
    together = together && c.x.device() == calls[0].x.device() &&
               c.x.scalar_type() == calls[0].x.scalar_type() &&
               (ps.back().mean != nullptr) == (ps[0].mean != nullptr);
    for (size_t i = 0; i < j; ++i)  // (two finalizes of one state would race)
      together = together && calls[i].clip_val.data_ptr() != c.clip_val.data_ptr() &&
                 calls[i].shift.data_ptr() != c.shift.data_ptr() &&
                 calls[i].iteration.data_ptr() != c.iteration.data_ptr();
  }
  std::vector<PreparedStep*> all;
  for (PreparedStep& p : ps) all.push_back(&p);
  bool done = false;
  if (together) {
    MESA_GUARD(calls[0].x);
    done = launch_quantize_steps(all);
  }
  if (!done) {
    for (PreparedStep& p : ps) {
      MESA_GUARD(p.xr);
      if (!launch_quantize_steps({&p})) launch_two(p);
    }
  }
  std::vector<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>> out;
  for (PreparedStep& p : ps) out.emplace_back(p.packed, p.rows.select(0, 1), p.rows.select(0, 2), p.rows);
  return out;
}

// dequantize_out_cuda of each call; one launch (dequantize_many_kernel) where the outs share a
// dtype and number at most kMaxStepJobs.
std::vector<at::Tensor> dequantize_out_many_cuda(const std::vector<RestoreArgs>& calls) {
  TORCH_CHECK(!calls.empty(), "mesa dequantize_out_many: no calls");
  bool together = calls.size() <= static_cast<size_t>(kMaxStepJobs);
  for (const RestoreArgs& c : calls)
    together = together && c.out.scalar_type() == calls[0].out.scalar_type() &&
               c.packed.device() == calls[0].packed.device() && c.out.numel() > 0;
  std::vector<at::Tensor> outs;
  if (!together) {
    for (const RestoreArgs& c : calls)
      outs.push_back(dequantize_out_cuda(c.packed, c.step, c.shift, c.bits, c.groups, c.inner,
                                         c.out, c.head));
    return outs;
  }
  std::vector<HeadRows> hds;
  int64_t extent = 0, runs = 1;
  for (const RestoreArgs& c : calls) {
    const int64_t n = c.out.numel();
    check_dequantize_args(c.packed, c.step, c.shift, c.bits, c.groups, c.inner, n);
    TORCH_CHECK(MESA_ON_DEVICE(c.packed) && c.out.device() == c.packed.device() && c.out.is_contiguous(),
                "mesa dequantize_out_many: packed and a contiguous out must be ", MESA_DEVICE_NAME,
                " tensors on one device");
    hds.push_back(head_rows("dequantize_out", c.head, n, c.out.scalar_type(), c.out.device()));
    extent = std::max<int64_t>(extent, n + 8);
    runs = std::max<int64_t>(runs, (n + kRestoreRun - 1) / kRestoreRun);
    outs.push_back(c.out);
  }
  MESA_GUARD(calls[0].packed);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, calls[0].out.scalar_type(), "mesa_dequantize_many_cuda", [&] {
    with_index(extent, [&](auto tag) {
      using I = decltype(tag);
      RestoreJobs<scalar_t, I> jobs{};
      jobs.n = static_cast<int>(calls.size());
      for (size_t j = 0; j < calls.size(); ++j) {
        const RestoreArgs& c = calls[j];
        jobs.job[j] = RestoreJob<scalar_t, I>{
            c.packed.data_ptr<uint8_t>(), c.step.data_ptr<float>(), c.shift.data_ptr<float>(),
            c.out.data_ptr<scalar_t>(), static_cast<I>(c.out.numel()), static_cast<int>(c.bits),
            static_cast<I>(c.inner), static_cast<I>(c.groups), hds[j]};
      }
      auto k = &dequantize_many_kernel<scalar_t, I>;
      MESA_LAUNCH(k, blocks_for(runs), kThreads, jobs);
    });
  });
  return outs;
}

}  // namespace mesa

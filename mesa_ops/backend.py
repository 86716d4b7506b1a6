"""Backend choice per tensor and lazy JIT build of the kernels in ``cuda/``.

CUDA tensor -> CUDA kernel, CPU tensor -> C++ kernel; ``MESA_BACKEND=torch|cpp|cuda`` forces one
(``torch`` is the pure-PyTorch reference of :mod:`mesa_ops.reference`, which runs on any device).
Nothing is compiled at import: the first quantization builds the extension with
``torch.utils.cpp_extension.load`` (ninja). A build that fails gives one warning and the
reference for the rest of the process (an error where ``MESA_BACKEND`` forces that backend).

Builds are keyed by their contents: the extension's name carries a hash of its sources, headers
and flags, and it is compiled from a copy of them in its own build folder, so checkouts at the
same commit share one build and different commits never overwrite each other's.

On CUDA each (dtype, bits) a run quantizes is first checked once on the device against the
reference (:func:`kernel_for`): a kernel that disagrees is never used to train; the launch that
takes several calls at once (an attention's q, k and v) is checked against the calls one at a
time, and where it disagrees the layers make one call per tensor.
Fake tensors (``torch._subclasses.fake_tensor``: CUDA tensors without a GPU, meta tensors) get
:class:`_FakeKernels`, which give every kernel's output shapes and dtypes and compute nothing, so
the Python side of any device's path can run, be traced and be checked for host syncs.
"""
from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensor

from . import reference

CUDA_DIR = Path(__file__).resolve().parent.parent / "cuda"
BACKENDS = ("torch", "cpp", "cuda")
# -fopenmp: at::parallel_for is inline in ATen's headers and runs serially unless the extension
# itself is compiled with OpenMP (torch links the same libgomp, so the pools are shared)
_CXX_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]
_CUDA_FLAGS = ["-O3", "--fmad=false"]


@functools.lru_cache(maxsize=None)
def _cpu_flags() -> frozenset:
    """The feature flags /proc/cpuinfo lists for the first CPU (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return frozenset(next((line.split() for line in f if line.startswith("flags")), []))
    except OSError:
        return frozenset()


def cpu_has_avx2() -> bool:
    """True where /proc/cpuinfo lists avx2 and f16c: the CPU kernel is then built with -mavx2
    -mf16c (under its own extension name, so machines sharing a cache never load a build their
    CPU lacks)."""
    return {"avx2", "f16c"} <= _cpu_flags()


def cpu_has_avx512() -> bool:
    """True where /proc/cpuinfo lists AVX-512 F, BW, VL and DQ (and AVX2/F16C): the CPU kernel
    then also gets its 16-lane loops (cuda/quant_cpu_avx512.h), under its own extension name."""
    return cpu_has_avx2() and {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= _cpu_flags()


# the CPU kernel's builds: compiler flags of each SIMD level (each under its own extension name)
SIMD_FLAGS = {"none": [], "avx2": ["-mavx2", "-mf16c"],
              "avx512": ["-mavx2", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]}


def cpu_simd() -> str:
    """The SIMD level the CPU kernel is built for: the best this CPU has ('avx512' > 'avx2' >
    'none'), or $MESA_CPU_SIMD where set (a lower level, to test or compare its loops)."""
    best = "avx512" if cpu_has_avx512() else "avx2" if cpu_has_avx2() else "none"
    asked = os.environ.get("MESA_CPU_SIMD", "").strip().lower()
    if not asked:
        return best
    order = list(SIMD_FLAGS)
    if asked not in order:
        raise ValueError(f"MESA_CPU_SIMD={asked!r}: expected one of {', '.join(order)}")
    if order.index(asked) > order.index(best):
        raise ValueError(f"MESA_CPU_SIMD={asked!r}: this CPU supports up to {best!r}")
    return asked


class BackendUnavailable(RuntimeError):
    """The backend that was asked for cannot be built or used here."""


# ---- the build ------------------------------------------------------------------------------
KINDS = ("cpu", "cuda", "emu")  # emu: the CUDA kernels compiled for the host (cuda_emulation.h)
_SOURCES = {"cpu": ["bindings.cpp", "quant_cpu.cpp", "layer_grads.cpp"],
            "cuda": ["bindings.cpp", "quant_cpu.cpp", "layer_grads.cpp", "quant_cuda.cu"],
            "emu": ["bindings.cpp", "quant_cpu.cpp", "layer_grads.cpp", "quant_cuda_emu.cpp"]}


def nvidia_include_dirs() -> list[str]:
    """Header folders of the nvidia-* wheels (CUDA 13 puts cuda_runtime.h etc. under nvidia/cu13)."""
    import site

    roots = site.getsitepackages() + [site.getusersitepackages()]
    found = []
    for root in roots:
        found += glob.glob(os.path.join(root, "nvidia", "cu*", "include"))
        found += glob.glob(os.path.join(root, "nvidia", "*", "include"))
    return sorted(set(found))


def missing_headers_dir(home: str, build_dir: str, wheel_dirs: list[str] | None = None) -> list[str]:
    """A folder in ``build_dir`` linking the headers of the nvidia-* wheels (cuBLAS, cuSPARSE, ...,
    which torch's CUDA headers include) that the toolkit at ``home`` lacks, as a one-element list
    (empty when it lacks none). The toolkit's own headers (its runtime, cccl) are never shadowed:
    a wheel's runtime headers of a newer minor (torch 2.15's CUDA 13.2 beside nvcc 13.0) stop
    nvcc with "CUDA compiler and CUDA toolkit headers are incompatible"."""
    have = set(os.listdir(os.path.join(home, "include"))) if os.path.isdir(os.path.join(home, "include")) else set()
    shim = os.path.join(build_dir, "nvidia_include")
    links = {}
    for d in nvidia_include_dirs() if wheel_dirs is None else wheel_dirs:
        for name in sorted(os.listdir(d)):
            if name not in have and name not in links:
                links[name] = os.path.join(d, name)
    if not links:
        return []
    os.makedirs(shim, exist_ok=True)
    for name, target in links.items():
        dest = os.path.join(shim, name)
        if os.path.islink(dest) and os.readlink(dest) != target:
            os.remove(dest)
        if not os.path.lexists(dest):
            os.symlink(target, dest)
    return [shim]


def _has_cudart(home: str) -> bool:
    return any(glob.glob(os.path.join(home, sub, "libcudart.so*"))
               for sub in ("lib64", "lib", os.path.join("targets", "*", "lib")))


def cuda_home(environ=None, which=shutil.which, defaults=("/usr/local/cuda",)) -> str | None:
    """The CUDA toolkit to build with: ``$CUDA_HOME`` / ``$CUDA_PATH`` where set, else the first
    of ``/usr/local/cuda`` and the folder above the real (symlinks resolved) ``nvcc`` on PATH
    that holds both ``bin/nvcc`` and the CUDA runtime library. torch guesses the folder above
    the first ``nvcc`` on PATH, which for a wrapper script in /usr/local/bin is /usr/local and
    fails to link (``cannot find -lcudart``)."""
    env = os.environ if environ is None else environ
    given = env.get("CUDA_HOME") or env.get("CUDA_PATH")
    if given:
        return given
    candidates = list(defaults)
    nvcc = which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
        candidates.append(os.path.dirname(os.path.dirname(nvcc)))
    for home in candidates:
        if os.path.exists(os.path.join(home, "bin", "nvcc")) and _has_cudart(home):
            return home
    return None


def nvcc_version(home: str) -> tuple[int, int] | None:
    """(major, minor) that ``home``/bin/nvcc reports ("release 13.0"), or None."""
    try:
        out = subprocess.run([os.path.join(home, "bin", "nvcc"), "--version"], capture_output=True,
                             text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def toolkit_mismatch(home: str, torch_cuda: str | None = None, version=nvcc_version) -> str | None:
    """Why the toolkit at ``home`` cannot build against this torch, or None: a CPU-only torch, or
    nvcc of another CUDA major than the one torch was built with (torch 2.8's PyPI wheel is
    CUDA 12.8: nvcc 13 rejects its CUDA 12 runtime headers, "CUDA compiler and CUDA toolkit
    headers are incompatible")."""
    torch_cuda = torch.version.cuda if torch_cuda is None else torch_cuda
    if not torch_cuda:
        return f"this torch ({torch.__version__}) is built without CUDA"
    have = version(home)
    want = int(torch_cuda.split(".")[0])
    if have is not None and have[0] != want:
        return (f"nvcc {have[0]}.{have[1]} (in {home}) cannot build against torch {torch.__version__}, "
                f"which is built for CUDA {torch_cuda}: use a CUDA {want}.x toolkit (CUDA_HOME) or a "
                f"torch built for CUDA {have[0]}")
    return None


@contextlib.contextmanager
def _quiet_cpp_extension():
    """Import torch.utils.cpp_extension without its 'No CUDA runtime is found' warning (logged at
    import on every machine without a GPU, where it only means what Mesa already knows)."""
    log = logging.getLogger("torch.utils.cpp_extension")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension
        yield cpp_extension
    finally:
        log.setLevel(level)


def _build_spec(kind: str) -> dict:
    """Sources, flags and the content-keyed name of the extension ``kind``."""
    if kind not in KINDS:
        raise ValueError(f"mesa extension kind must be one of {KINDS}, got {kind!r}")
    level = cpu_simd()
    cflags = _CXX_FLAGS + SIMD_FLAGS[level]
    if kind != "cpu":
        cflags = cflags + ["-DMESA_WITH_CUDA"] + (["-DMESA_CUDA_EMULATION"] if kind == "emu" else [])
    cuda_flags = _CUDA_FLAGS + ["-DMESA_WITH_CUDA"] if kind == "cuda" else []
    files = sorted({p.name for p in CUDA_DIR.iterdir()
                    if p.suffix in (".h", ".cuh", ".cpp", ".cu")})
    h = hashlib.sha256()
    for f in files:
        h.update(f.encode() + b"\0" + (CUDA_DIR / f).read_bytes() + b"\0")
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST", "") if kind == "cuda" else ""
    h.update(repr((cflags, cuda_flags, arch, torch.__version__, sys.version_info[:2])).encode())
    simd = "" if level == "none" else f"_{level}"
    return dict(name=f"mesa_ext_{kind}{simd}_{h.hexdigest()[:12]}", files=files,
                sources=_SOURCES[kind], cflags=cflags, cuda_flags=cuda_flags)


def _stage(spec: dict, build_dir: str) -> str:
    """Copy the sources into ``build_dir``/src (once: the folder's name is keyed by them)."""
    src = os.path.join(build_dir, "src")
    if not all(os.path.exists(os.path.join(src, f)) for f in spec["files"]):
        os.makedirs(src, exist_ok=True)
        for f in spec["files"]:
            tmp = os.path.join(src, f"{f}.{os.getpid()}.tmp")
            shutil.copyfile(CUDA_DIR / f, tmp)
            os.replace(tmp, os.path.join(src, f))
    return src


def build_extension(kind: str = "cpu", verbose: bool = False, build_directory: str | None = None):
    """Compile (or load, when built before) Mesa's extension ``kind`` ('cpu', 'cuda' or 'emu')
    and return the module. Prints one line before a build that has to compile."""
    if kind is True or kind is False:  # (the older signature: build_extension(with_cuda))
        kind = "cuda" if kind else "cpu"
    spec = _build_spec(kind)
    with _quiet_cpp_extension() as cpp_extension:
        build_dir = build_directory or cpp_extension._get_build_directory(spec["name"], verbose)
        os.makedirs(build_dir, exist_ok=True)
        src = _stage(spec, build_dir)
        kwargs = dict(name=spec["name"], sources=[os.path.join(src, f) for f in spec["sources"]],
                      extra_cflags=spec["cflags"], extra_include_paths=[src],
                      extra_ldflags=["-fopenmp"], build_directory=build_dir, verbose=verbose)
        if not os.path.exists(os.path.join(build_dir, spec["name"] + ".so")):
            print(f"mesa_ops: building Mesa's {kind.upper()} kernels once (a few minutes on 2 cores; "
                  f"kept in {build_dir})", file=sys.stderr, flush=True)
        if kind != "cuda":
            return cpp_extension.load(**kwargs)
        home = cuda_home()
        if home is None:
            raise BackendUnavailable("mesa_ops: no CUDA toolkit found (set CUDA_HOME to the folder "
                                     "holding bin/nvcc and the CUDA runtime library)")
        mismatch = toolkit_mismatch(home)
        if mismatch:
            raise BackendUnavailable(f"mesa_ops: {mismatch}")
        kwargs["extra_cuda_cflags"] = spec["cuda_flags"]
        kwargs["extra_include_paths"] += missing_headers_dir(home, build_dir)
        saved = cpp_extension.CUDA_HOME
        cpp_extension.CUDA_HOME = home  # torch's own guess, used by load(), for this build only
        try:
            return cpp_extension.load(**kwargs)
        finally:
            cpp_extension.CUDA_HOME = saved


_BUILD_ERRORS = (RuntimeError, OSError, ImportError, subprocess.CalledProcessError)


@functools.lru_cache(maxsize=None)
def _extension(kind: str):
    """The built extension ``kind``, or the exception its build raised (cached either way: a
    failed build is tried once per process)."""
    try:
        return build_extension(kind)
    except _BUILD_ERRORS as exc:
        return exc


# dicts of backends chosen from the cached ones above (mesa_ops.packed's backend of each kind of
# restore), emptied with them by clear_caches; and what else clear_caches calls (mesa_ops.ops:
# withdraw the extension's kernels of the native torch ops)
DEPENDENT_CACHES: list = []
ON_CLEAR: list = []


def clear_caches() -> None:
    """Forget the built extensions, the backends made of them and every choice made from those
    (a test that builds or fails to build another: the next use loads them again)."""
    _extension.cache_clear()
    _extension_backend.cache_clear()
    native_for.cache_clear()
    _CHECKED.clear()
    for cache in DEPENDENT_CACHES:
        cache.clear()
    for fn in ON_CLEAR:
        fn()


def _cpu_extension():
    """The C++ extension, or None (with one warning) when it cannot be built."""
    ext = _extension("cpu")
    return None if isinstance(ext, BaseException) else ext


class _Reference:
    name = "torch"
    has_quantize_step = has_dequantize_out = False
    lut_apply_out = levels = None
    quantize = staticmethod(reference.quantize)
    dequantize = staticmethod(reference.dequantize)
    group_minmax = staticmethod(reference.group_minmax)
    range_update = staticmethod(reference.range_update)


_REFERENCE = _Reference()


class _Extension:
    def __init__(self, ext, suffix: str):
        self.name = suffix
        self.ext = ext  # (mesa_ops.ops registers its kernels of the native torch ops)
        self.quantize = getattr(ext, f"quantize_{suffix}")
        self._d = getattr(ext, f"dequantize_{suffix}")
        self.group_minmax = getattr(ext, f"group_minmax_{suffix}")
        # range_update(x, groups, inner, clip_val, shift, iteration, decay, one_minus_decay,
        #              range_mode, bits, update) -> (4, G) rows inv, step, offset, finite
        self.range_update = getattr(ext, f"range_update_{suffix}")
        # the one-call paths, bound directly (no Python wrapper: they run once per activation)
        #   quantize_step(x, groups, inner, clip_val, shift, iteration, decay, one_minus_decay,
        #                 range_mode, bits, update, seed_prefix, draws, stochastic,
        #                 mark_nonfinite, prefix_of_mix=False, row_mean=None, row_rstd=None,
        #                 head=None)
        #     -> (packed, step, shift, all finite, (4, G) rows): range_update, then quantize
        #     with the seed ops.make_seed gives for draws[0] (advanced when update), reading x
        #     in any layout; seed_prefix is ops.seed_prefix, or with prefix_of_mix ops.salt_mix
        #     (the kernel hashes torch's generator state of x's device itself). "all finite" is
        #     a bool on CPU and None on CUDA (not known on the host without a sync: the finite
        #     row of the (4, G) rows stays on the device, see ops.defer_nonfinite); head: an
        #     empty x.narrow(-2, 0, P)-shaped tensor (x's dtype, float32 with row_mean) that the
        #     codes' kernel fills with the first P rows along dim -2 of what it stores
        #   dequantize_out(packed, step, shift, bits, groups, inner, out, head=None) -> out
        #     (contiguous; head: exact rows of out's dtype written over its first rows along dim -2)
        #   lut_apply_out(packed, table, bits, groups, inner, out, mul=None, head=None) -> out:
        #     out = table[group][code] (* mul), head's rows as they are
        #   levels(step, shift, bits, dtype) -> (G, 2^bits) dequantized values (reference.levels)
        #   quantize_step_many([quantize_step's arguments, ...]) -> [its results], in order;
        #   dequantize_out_many([dequantize_out's arguments, ...]) -> [outs]: on CUDA one launch
        #     where the calls can share one (the q, k, v of an attention: at most 3, one dtype)
        self.quantize_step = getattr(ext, f"quantize_step_{suffix}")
        self.dequantize_out = getattr(ext, f"dequantize_out_{suffix}")
        # restore(packed, step, shift, bits, groups, inner, shape, dtype, head=None, heads=0) -> a
        # new tensor of shape and dtype (dequantize_out into it: one call, no Python-side
        # empty/view); with heads a (B, L, H * D) one as its (B, H, L, D) view
        self.restore = getattr(ext, f"restore_{suffix}")
        # step_plan(x, amp16, mean, rstd, env, transposed, groups, inner, decay, one_minus_decay,
        #           range_mode, bits, stochastic, mark_nonfinite, head_shape, stored dtype, QTensor,
        #           shape, iteration, draws) -> a native step for inputs laid out as x
        #           (cuda/step_plan.h), called (x, clip_val, shift, iteration, draws, update, mix,
        #           mean, rstd, amp16, env) -> (QTensor, rows or None), or None where it does not apply
        self.step_plan = getattr(ext, f"step_plan_{suffix}")
        self.quantize_step_many = getattr(ext, f"quantize_step_many_{suffix}", None) or self._steps
        self.dequantize_out_many = getattr(ext, f"dequantize_out_many_{suffix}", None) or self._restores
        # (several calls in one launch: the CUDA kernels; the CPU ones take a call each, which
        # the layers then make themselves, without the batching's bookkeeping)
        self.has_many = hasattr(ext, f"quantize_step_many_{suffix}")
        self.lut_apply_out = getattr(ext, f"lut_apply_out_{suffix}")
        self.levels = getattr(ext, f"levels_{suffix}")
        self.has_quantize_step = self.has_dequantize_out = True

    def dequantize(self, packed, step, shift, bits, groups, inner, numel, dtype):
        return self._d(packed, step, shift, bits, groups, inner, numel, dtype)

    def _steps(self, calls):  # (the CPU kernels: a call each)
        return [self.quantize_step(*c) for c in calls]

    def _restores(self, calls):
        return [self.dequantize_out(*c) for c in calls]


def _new_empty(t, shape, dtype):
    return t.new_empty(shape, dtype=dtype)


class _FakeKernels:
    """The kernels' signatures for fake/meta tensors: outputs of the right shape, dtype and
    device, nothing computed (in-place state updates are no-ops), no host flag (as on CUDA)."""

    name = "fake"
    has_quantize_step = has_dequantize_out = has_many = True
    step_plan = None  # (the quantizer's Python path: these signatures)

    @staticmethod
    def quantize(x, inv, shift, bits, groups, inner, seed, stochastic=True):
        per = 8 // bits
        return _new_empty(x, ((x.numel() + per - 1) // per,), torch.uint8)

    @staticmethod
    def dequantize(packed, step, shift, bits, groups, inner, numel, dtype):
        return _new_empty(packed, (numel,), dtype)

    @staticmethod
    def group_minmax(x, groups, inner):
        return _new_empty(x, (2, groups), torch.float32)

    @staticmethod
    def range_update(x, groups, inner, *args, **kwargs):
        return _new_empty(x, (4, groups), torch.float32)

    @staticmethod
    def quantize_step(x, groups, inner, *args, **kwargs):
        rows = _new_empty(x, (4, groups), torch.float32)
        return _FakeKernels.quantize(x, None, None, args[6], groups, inner, 0), rows[1], rows[2], None, rows

    @staticmethod
    def quantize_step_many(calls):
        return [_FakeKernels.quantize_step(*c) for c in calls]

    @staticmethod
    def dequantize_out_many(calls):
        return [_FakeKernels.dequantize_out(*c) for c in calls]

    @staticmethod
    def dequantize_out(packed, step, shift, bits, groups, inner, out, head=None):
        return out

    @staticmethod
    def restore(packed, step, shift, bits, groups, inner, shape, dtype, head=None, heads=0):
        out = _new_empty(packed, shape, dtype)
        return out.unflatten(2, (heads, -1)).transpose(1, 2) if heads else out

    @staticmethod
    def lut_apply_out(packed, table, bits, groups, inner, out, mul=None, head=None):
        return out

    @staticmethod
    def levels(step, shift, bits, dtype):
        return _new_empty(step, (step.numel(), 1 << bits), dtype)


_FAKE = _FakeKernels()


@functools.lru_cache(maxsize=None)
def _extension_backend(kind: str):
    """The backend of the built extension: 'cuda', or 'cpp' (the CPU kernels). A failed build
    warns once and gives the reference."""
    ext = _extension("cuda" if kind == "cuda" else "cpu")
    if isinstance(ext, BaseException):
        warnings.warn(f"mesa_ops: building the {'CUDA' if kind == 'cuda' else 'C++'} kernels failed "
                      f"({ext}); falling back to the pure-PyTorch reference for the rest of the "
                      "process (slower, same results)", RuntimeWarning, stacklevel=3)
        return _REFERENCE
    return _Extension(ext, "cuda" if kind == "cuda" else "cpu")


# os.environ's own mapping and its key for MESA_BACKEND: forced_backend reads it as
# os.environ.get does (os.environ[k] = v and monkeypatch.setenv update it), without the three
# Python-level calls of the Mapping interface (it runs once per packed tensor, with cold caches)
_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_KEY = os.environ.encodekey("MESA_BACKEND") if hasattr(os.environ, "encodekey") else None


# the same for the per-activation fast paths (mesa_ops.quant, mesa_ops.packed), which key their
# cached backend on MESA_BACKEND's raw value: one dict lookup, no call (None: read forced_backend());
# ENV.get(BACKEND_VAR) that value on any platform (os.environ's own .get where it has no dict)
ENV_VARS = _ENV_DATA if type(_ENV_DATA) is dict and _ENV_KEY is not None else None
BACKEND_VAR = _ENV_KEY if ENV_VARS is not None else "MESA_BACKEND"
ENV = ENV_VARS if ENV_VARS is not None else os.environ


def forced_backend() -> str | None:
    """$MESA_BACKEND, read at each call (None when unset or empty)."""
    if type(_ENV_DATA) is dict and _ENV_KEY is not None:
        raw = _ENV_DATA.get(_ENV_KEY)
        if raw is None:
            return None
        name = os.environ.decodevalue(raw)
    else:  # (a platform whose os.environ differs: its public interface)
        name = os.environ.get("MESA_BACKEND")
    if not name:
        return None
    name = name.strip().lower()
    if name and name not in BACKENDS:
        raise ValueError(f"MESA_BACKEND={name!r}: expected one of {', '.join(BACKENDS)}")
    return name or None


@functools.lru_cache(maxsize=None)
def native_for(raw, cuda: bool = False):
    """The extension's device-independent composites of ATen ops (the layers' gradient math,
    cuda/layer_grads.cpp: the same ops as the pure-PyTorch versions in mesa_ops.functional, in
    one call) under MESA_BACKEND's raw value ``raw`` (``ENV.get(BACKEND_VAR)``), for tensors on a
    CUDA device (``cuda``: the CUDA build, which the kernels load anyway, where torch counts a GPU;
    fake CUDA tensors without one take the CPU build's), or None where those run instead
    (MESA_BACKEND=torch, or that extension not built). Cached: a Mesa backward reads it through
    the cache, without a Python frame (:func:`native_ops` reads the variable)."""
    if raw is not None and forced_backend() == "torch":
        return None
    ext = _extension("cuda" if cuda and torch.cuda.device_count() > 0 else "cpu")
    return None if isinstance(ext, BaseException) else ext


def native_ops(cuda: bool = False):
    """:func:`native_for` of MESA_BACKEND's value now."""
    return native_for(ENV.get(BACKEND_VAR), cuda)


def _cuda_backend(forced: bool):
    be = _extension_backend("cuda")
    if forced and be is _REFERENCE:
        raise BackendUnavailable(f"MESA_BACKEND=cuda but the CUDA kernels could not be built: "
                                 f"{_extension('cuda')}")
    return be


def get_backend(t: torch.Tensor, name: str | None = None):
    """The backend for tensor ``t``: ``name`` if given, else $MESA_BACKEND, else by device
    (fake and meta tensors: :class:`_FakeKernels`)."""
    name = name or forced_backend()
    if type(t) is FakeTensor or t.is_meta:
        return _REFERENCE if name == "torch" else _FAKE
    if name is None:  # the usual case, first
        return _cuda_backend(False) if t.is_cuda else _extension_backend("cpp")
    if name == "torch":
        return _REFERENCE
    if name == "cuda":
        if not t.is_cuda:
            raise BackendUnavailable(f"MESA_BACKEND=cuda but the tensor is on {t.device}")
        return _cuda_backend(True)
    if t.is_cuda:
        raise BackendUnavailable("MESA_BACKEND=cpp but the tensor is on CUDA; use cuda or torch")
    return _extension_backend("cpp")


# ---- the runtime self-check of the CUDA kernels -------------------------------------------
_CHECKED: dict = {}  # (device index, dtype, bits) -> the backend that case uses


def kernel_for(be, t: torch.Tensor, dtype: torch.dtype, bits: int):
    """``be`` (from :func:`get_backend`) for quantizing/restoring ``dtype`` at ``bits`` bits on
    ``t``'s device: on CUDA the kernel once :func:`self_check` has passed for that case in this
    process, else (one warning) the reference; other backends as they are."""
    if be.name != "cuda":
        return be
    key = (t.device.index, dtype, bits)
    got = _CHECKED.get(key)
    if got is None:
        got = _CHECKED[key] = _checked(be, t.device, dtype, bits)
    return got


def _checked(be, device, dtype, bits):
    problem = self_check(be, device, dtype, bits)
    if problem is None:
        many = self_check_many(be, device, dtype, bits) if getattr(be, "has_many", False) else None
        if many is None:
            return be
        warnings.warn(f"mesa_ops: the CUDA kernels' several calls in one launch disagree with the "
                      f"same calls made one at a time for {dtype} at {bits} bits ({many}); that "
                      "case makes one call per tensor for the rest of the run", RuntimeWarning,
                      stacklevel=4)
        return _OneCallEach(be)
    if forced_backend() == "cuda":
        raise BackendUnavailable(f"MESA_BACKEND=cuda but the CUDA kernel fails its self-check for "
                                 f"{dtype} at {bits} bits: {problem}")
    warnings.warn(f"mesa_ops: the CUDA kernel disagrees with the PyTorch reference for {dtype} at "
                  f"{bits} bits ({problem}); that case uses the reference for the rest of the run",
                  RuntimeWarning, stacklevel=4)
    return _REFERENCE


class _OneCallEach:
    """``be`` without its several-calls-in-one-launch path (``has_many`` False: the layers make
    one kernel call per tensor), for a case whose :func:`self_check_many` failed."""

    has_many = False

    def __init__(self, be):
        self._be = be

    def __getattr__(self, name):
        return getattr(self._be, name)


def _self_check_cases(device, dtype):
    """(name, x, groups, inner) of the self-check: a small tensor (odd sizes, three groups, an
    outlier beyond the running range), a row-strided view of it (two groups), and a long one (one
    group of 13 chunks, whose range the CUDA kernel's last block reduces with the whole block)."""
    gen = torch.Generator().manual_seed(1234)
    base = (torch.randn(2, 7, 3 * 40, generator=gen) * 2 + 0.25)
    base[0, 3, 5] = 40.0  # beyond the running range below: the range rule is exercised
    full = base.to(device=device, dtype=dtype)
    long = (torch.randn(12 * 2048 + 7, generator=gen) * 2 - 0.5)
    long[9000] = 35.0  # (the max in a middle chunk)
    long = long.to(device=device, dtype=dtype)
    return (("contiguous", full, 3, 40), ("row-strided", full[..., 40:], 2, 40),
            ("many-chunk", long, 1, long.numel()))


_CHECK_PREFIX = 0x5EED_1234_ABCD  # the draw stream's prefix of the self-check's quantizations


def _check_state(g, device, i=0):
    """A self-check case's running state: clip_val 3 + i, shift -1.5 - i, iteration 1."""
    return [torch.full((g,), 3.0 + i, device=device), torch.full((g,), -1.5 - i, device=device),
            torch.ones(1, device=device)]


def _check_step_call(x, g, inner, bits, device, i=0):
    """(quantize_step's arguments for one self-check case: a running range of 3 / -1.5 and the
    draw counter at 5, each moved by ``i`` (so that several calls in one launch differ in both),
    its first row along dim -2 kept exactly where x has one; the state tensors it updates, the
    draw counter last, on the CPU)."""
    st = _check_state(g, device, i)
    draws = torch.full((1,), 5 + i, dtype=torch.int64)
    head = x.narrow(-2, 0, 1).contiguous() if x.dim() >= 3 else None
    hout = None if head is None else torch.empty_like(head)
    return ((x, g, inner, *st, 0.9, 0.1, reference.UNION, bits, True, _CHECK_PREFIX, draws, True,
             False, False, None, None, hout), st + [draws])


def self_check(be, device, dtype: torch.dtype, bits: int) -> str | None:
    """Quantize, dequantize and restore through a table the cases of :func:`_self_check_cases`
    (each with its first row along dim -2 kept exactly, where it has one) by the kernels of
    ``be`` and by the reference on ``device``; returns None when every result is identical, else
    what differs."""
    problems = []
    for name, x, g, inner in _self_check_cases(device, dtype):
        call, state = _check_step_call(x, g, inner, bits, device)
        st_ref = _check_state(g, device)
        head, hout = (x.narrow(-2, 0, 1).contiguous(), call[-1]) if x.dim() >= 3 else (None, None)
        packed, step, shift, _, rows = be.quantize_step(*call)
        seed = reference.splitmix64(_CHECK_PREFIX ^ 5) & ((1 << 62) - 1)
        rrows = reference.range_update(x.contiguous(), g, inner, *st_ref, 0.9, 0.1, reference.UNION,
                                       bits, True)
        rpacked = reference.quantize(x.contiguous(), rrows[0], rrows[2], bits, g, inner, seed, True)
        n = x.numel()
        deq = be.dequantize(rpacked, rrows[1], rrows[2], bits, g, inner, n, dtype)
        rdeq = reference.dequantize(rpacked, rrows[1], rrows[2], bits, g, inner, n, dtype)
        table = reference.levels(rrows[1], rrows[2], bits, dtype)
        lut = be.lut_apply_out(rpacked, table, bits, g, inner, torch.empty(n, dtype=dtype, device=device))
        checks = [("range rows", rows, rrows), ("running state", torch.cat(state[:3]), torch.cat(st_ref)),
                  ("codes", packed, rpacked), ("dequantized values", deq, rdeq),
                  ("table restore", lut, rdeq), ("levels", be.levels(rrows[1], rrows[2], bits, dtype), table)]
        if head is not None:
            want = rdeq.view(x.shape).clone()
            want.narrow(-2, 0, 1).copy_(head)
            got = be.dequantize_out(rpacked, rrows[1], rrows[2], bits, g, inner,
                                    torch.empty(n, dtype=dtype, device=device), head)
            checks += [("exact rows", hout, head), ("restore with exact rows", got.view(x.shape), want)]
        problems += [f"{what} ({name} input)" for what, a, b in checks if not torch.equal(a, b)]
    return ", ".join(problems) or None


def self_check_many(be, device, dtype: torch.dtype, bits: int) -> str | None:
    """The cases of :func:`_self_check_cases` quantized by one ``be.quantize_step_many`` call and
    restored by one ``be.dequantize_out_many`` (on CUDA one launch each, as an attention's q, k
    and v) against the same calls made one at a time (which :func:`self_check` compares with the
    reference); returns None when every result is identical, else what differs."""
    cases = _self_check_cases(device, dtype)
    one = [_check_step_call(x, g, inner, bits, device, i) for i, (_, x, g, inner) in enumerate(cases)]
    together = [_check_step_call(x, g, inner, bits, device, i)
                for i, (_, x, g, inner) in enumerate(cases)]
    want = [be.quantize_step(*call) for call, _ in one]
    got = be.quantize_step_many([call for call, _ in together])
    problems = []
    for (name, x, g, inner), (c1, s1), (c2, s2), w, r in zip(cases, one, together, want, got):
        checks = [("codes", r[0], w[0]), ("range rows", r[4], w[4]),
                  ("running state", torch.cat(s2[:3]), torch.cat(s1[:3])),
                  ("draw counter", s2[3], s1[3])]
        if c1[-1] is not None:
            checks.append(("exact rows", c2[-1], c1[-1]))
        problems += [f"{what} ({name} input)" for what, a, b in checks if not torch.equal(a, b)]
    rest = [(w[0], w[1], w[2], bits, g, inner, torch.empty(x.numel(), dtype=dtype, device=device),
             c1[-1]) for (_, x, g, inner), (c1, _), w in zip(cases, one, want)]
    want_out = [be.dequantize_out(*c) for c in rest]
    got_out = be.dequantize_out_many([c[:6] + (torch.empty_like(c[6]),) + c[7:] for c in rest])
    problems += [f"restore ({name} input)" for (name, *_), a, b in zip(cases, got_out, want_out)
                 if not torch.equal(a, b)]
    return ", ".join(problems) or None

"""Backend choice per tensor and lazy JIT build of the kernels in ``cuda/``.

CUDA tensor -> CUDA kernel, CPU tensor -> C++ kernel; ``MESA_BACKEND=torch|cpp|cuda`` forces one
(``torch`` is the pure-PyTorch reference of :mod:`mesa_ops.reference`). Nothing is compiled at
import: the first quantization builds the extension with ``torch.utils.cpp_extension.load``
(ninja) and caches it. If the C++ build fails, one warning is issued and the reference is used.
"""
from __future__ import annotations

import functools
import glob
import os
import warnings
from pathlib import Path

import torch

from . import reference

CUDA_DIR = Path(__file__).resolve().parent.parent / "cuda"
BACKENDS = ("torch", "cpp", "cuda")
# -fopenmp: at::parallel_for is inline in ATen's headers and runs serially unless the extension
# itself is compiled with OpenMP (torch links the same libgomp, so the pools are shared)
_CXX_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]


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


def _sources(with_cuda: bool) -> list[str]:
    names = ["bindings.cpp", "quant_cpu.cpp"] + (["quant_cuda.cu"] if with_cuda else [])
    return [str(CUDA_DIR / n) for n in names]


def nvidia_include_dirs() -> list[str]:
    """Header folders of the nvidia-* wheels (CUDA 13 puts cuda_runtime.h etc. under nvidia/cu13)."""
    import site

    roots = site.getsitepackages() + [site.getusersitepackages()]
    found = []
    for root in roots:
        found += glob.glob(os.path.join(root, "nvidia", "cu*", "include"))
        found += glob.glob(os.path.join(root, "nvidia", "*", "include"))
    return sorted(set(found))


def build_extension(with_cuda: bool, verbose: bool = False, build_directory: str | None = None):
    """Compile (or load from the torch extensions cache) Mesa's extension and return the module."""
    from torch.utils import cpp_extension

    level = cpu_simd()
    simd = SIMD_FLAGS[level]
    name = ("mesa_ext_cuda" if with_cuda else "mesa_ext_cpu") + ("" if level == "none" else f"_{level}")
    kwargs = dict(
        name=name,
        sources=_sources(with_cuda),
        extra_cflags=_CXX_FLAGS + simd + (["-DMESA_WITH_CUDA"] if with_cuda else []),
        extra_include_paths=[str(CUDA_DIR)] + (nvidia_include_dirs() if with_cuda else []),
        extra_ldflags=["-fopenmp"],
        verbose=verbose,
    )
    if with_cuda:
        kwargs["extra_cuda_cflags"] = ["-O3", "--fmad=false", "-DMESA_WITH_CUDA"]
    if build_directory is not None:
        os.makedirs(build_directory, exist_ok=True)
        kwargs["build_directory"] = build_directory
    return cpp_extension.load(**kwargs)


@functools.lru_cache(maxsize=None)
def _cpu_extension():
    """The C++ extension, or None (with one warning) when it cannot be built."""
    try:
        return build_extension(with_cuda=False)
    except (RuntimeError, OSError, ImportError, FileNotFoundError) as exc:  # compiler/ninja missing
        warnings.warn(f"mesa_ops: building the C++ kernels failed ({exc}); "
                      "falling back to the pure-PyTorch reference (slower, same results).",
                      RuntimeWarning, stacklevel=3)
        return None


@functools.lru_cache(maxsize=None)
def _cuda_extension():
    try:
        return build_extension(with_cuda=True)
    except (RuntimeError, OSError, ImportError) as exc:
        raise BackendUnavailable(f"mesa_ops: building the CUDA kernels failed: {exc}") from exc


class _Reference:
    name = "torch"
    has_quantize_step = has_dequantize_out = False
    quantize = staticmethod(reference.quantize)
    dequantize = staticmethod(reference.dequantize)
    group_minmax = staticmethod(reference.group_minmax)
    range_update = staticmethod(reference.range_update)


class _Extension:
    def __init__(self, ext, suffix: str):
        self.name = suffix
        self._q = getattr(ext, f"quantize_{suffix}")
        self._d = getattr(ext, f"dequantize_{suffix}")
        self._m = getattr(ext, f"group_minmax_{suffix}")
        self._r = getattr(ext, f"range_update_{suffix}", None)
        # the one-call paths, bound directly (no Python wrapper: they run once per activation)
        #   quantize_step(x, groups, inner, clip_val, shift, iteration, decay, one_minus_decay,
        #                 batch_mode, bits, update, seed_prefix, draws, stochastic,
        #                 mark_nonfinite, prefix_of_mix=False, row_mean=None, row_rstd=None)
        #     -> (packed, step, shift, all finite, (4, G) rows): range_update, then quantize
        #     with the seed ops.make_seed gives for draws[0] (advanced when update), reading x
        #     in any layout (CPU); seed_prefix is ops.seed_prefix, or with prefix_of_mix
        #     ops.salt_mix (the kernel hashes torch's generator state itself)
        #   dequantize_out(packed, step, shift, bits, groups, inner, out) -> out (contiguous)
        self.quantize_step = getattr(ext, f"quantize_step_{suffix}", None)
        self.dequantize_out = getattr(ext, f"dequantize_out_{suffix}", None)
        #   lut_apply_out(packed, table, bits, groups, inner, out, mul=None) -> out:
        #     out = table[group][code] (* mul) (CPU; reference.lut_apply elsewhere)
        self.lut_apply_out = getattr(ext, f"lut_apply_out_{suffix}", None)
        #   levels(step, shift, bits, dtype) -> (G, 2^bits) dequantized values (reference.levels)
        self.levels = getattr(ext, f"levels_{suffix}", None)
        self.has_quantize_step = self.quantize_step is not None
        self.has_dequantize_out = self.dequantize_out is not None

    def quantize(self, x, inv, shift, bits, groups, inner, seed, stochastic=True):
        return self._q(x, inv, shift, bits, groups, inner, seed, stochastic)

    def dequantize(self, packed, step, shift, bits, groups, inner, numel, dtype):
        return self._d(packed, step, shift, bits, groups, inner, numel, dtype)

    def group_minmax(self, x, groups, inner):
        return self._m(x, groups, inner)

    def range_update(self, x, groups, inner, clip_val, shift, iteration, decay, one_minus_decay,
                     batch_mode, bits, update=True):
        if self._r is not None:  # fused C++ (CPU)
            return self._r(x, groups, inner, clip_val, shift, iteration, decay, one_minus_decay,
                           batch_mode, bits, update)
        # CUDA: the reference's tensor ops on the GPU (no host sync), min/max by the kernel
        return reference.range_update(x, groups, inner, clip_val, shift, iteration, decay,
                                      one_minus_decay, batch_mode, bits, update, minmax=self._m)


@functools.lru_cache(maxsize=None)
def _extension_backend(kind: str):
    if kind == "cuda":
        return _Extension(_cuda_extension(), "cuda")
    ext = _cpu_extension()
    return _Extension(ext, "cpu") if ext is not None else _Reference()


# os.environ's own mapping and its key for MESA_BACKEND: forced_backend reads it as
# os.environ.get does (os.environ[k] = v and monkeypatch.setenv update it), without the three
# Python-level calls of the Mapping interface (it runs once per packed tensor, with cold caches)
_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_KEY = os.environ.encodekey("MESA_BACKEND") if hasattr(os.environ, "encodekey") else None


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


def get_backend(t: torch.Tensor, name: str | None = None):
    """The backend for tensor ``t``: ``name`` if given, else $MESA_BACKEND, else by device."""
    name = name or forced_backend()
    if name is None:  # the usual case, first
        return _extension_backend("cuda" if t.is_cuda else "cpp")
    if name == "torch":
        return _Reference()
    if name == "cuda":
        if not t.is_cuda:
            raise BackendUnavailable(f"MESA_BACKEND=cuda but the tensor is on {t.device}")
        return _extension_backend("cuda")
    if t.is_cuda:
        raise BackendUnavailable("MESA_BACKEND=cpp but the tensor is on CUDA; use cuda or torch")
    return _extension_backend("cpp")

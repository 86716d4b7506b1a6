"""Memory and throughput of whole models: exact training vs Mesa vs activation checkpointing.

Modes: ``exact`` (the models' default: fused ``scaled_dot_product_attention``, which keeps no
N x N attention matrix); ``exact-explicit`` (q@k, softmax, attn@v as separate ops, the paper's
baseline); ``mesa8``/``mesa4``/``mesa2`` (Mesa on fc, gelu, layernorm and attention through the
fused ``ms.SDPA``); ``mesa8-explicit`` (the paper's Mesa: q@k, softmax, attn@v compressed as
separate ops); ``ckpt`` (``torch.utils.checkpoint``, non-reentrant, around each top-level
Transformer block); ``mesa8+ckpt``; ``mesa8+cckpt`` (Mesa 8-bit with compressed checkpointing:
each block keeps its input at 8 bits, :mod:`mesa_ops.checkpoint`). For each (model, mode) one
worker process builds the model, runs ``warmup +
steps`` train steps (forward, loss, backward, SGD step) and reports:

* ``saved_bytes``: bytes autograd holds for backward after one forward (unique storages,
  parameters excluded; for checkpointed blocks, their stored inputs);
* ``peak_bytes``: CUDA ``max_memory_allocated``; on CPU the peak RSS (``ru_maxrss``) of a
  worker whose large allocations are mmap-backed, minus its RSS once the model and batch are
  built (the training peak: activations, gradients, optimizer state), comparable between modes
  since every configuration runs in fresh processes;
* ``step_time_s``: median step time after warm-up.

``largest_batch`` searches (doubling, then bisection) the largest batch whose peak stays within
a budget, each probe in a fresh worker.
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn

from mesa_ops.bench import agg_pyplot, saved_bytes, sync, time_in_turn
from mesa_ops.checkpoint import wrap_blocks

MODES = ("exact", "exact-explicit", "mesa8", "mesa8-explicit", "mesa4", "mesa2", "ckpt", "mesa8+ckpt",
         "mesa8+cckpt")
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Config:
    model: str
    mode: str
    batch: int
    input_size: int = 224
    precision: str = "fp32"
    steps: int = 5
    warmup: int = 2
    device: str = "cpu"
    num_classes: int = 1000
    threads: int = 0
    optimizer: str = "sgd"  # or "adamw" (the paper's: one more parameter-sized state)
    lora: int = 0  # LoRA rank (peft) on a frozen model: qkv, proj, fc1, fc2; 0 = full training


@dataclass
class Record:
    model: str
    mode: str
    precision: str
    batch: int
    input_size: int
    device: str
    saved_bytes: int
    peak_bytes: int
    step_time_s: float
    by_type: dict = field(default_factory=dict)
    oom: bool = False
    dry_run: bool = False


def _mode_policy(model: str, mode: str):
    """set_mesa arguments of a mesa mode: the paper's tags (fc, matmul, gelu, layernorm,
    softmax) at the mode's bits; PVT also compresses its convs (configs/mesa/pvt_8bit.txt)."""
    if not mode.startswith("mesa"):
        return None
    from models.registry import MESA_TAGS, model_entry

    tags = list(MESA_TAGS) + (["conv"] if model_entry(model).family == "pvt" else [])
    return {"bits": int(mode[4]), "tags": tags}


def checkpoint_blocks(model: nn.Module, bits: int | None = None) -> list:
    """Wrap every outermost module whose class name ends in 'Block' (DeiT, Swin, PVT blocks) in
    non-reentrant checkpointing (``bits``: keep each block's input packed at that many bits)."""
    return wrap_blocks(model, bits)


# the blocks' qkv, proj, fc1, fc2 (not the patch embedding's conv, also named proj)
LORA_TARGETS = r".*\.(attn\.(qkv|proj)|mlp\.(fc1|fc2))"


def _label(cfg: Config) -> str:
    """The model column of a record: the model, and its LoRA rank if any."""
    return cfg.model + (f" LoRA-{cfg.lora}" if cfg.lora else "")


def lora_model(model: nn.Module, rank: int) -> nn.Module:
    """``model`` fine-tuned with LoRA through peft, as LowMemoryBP's ViT experiments do
    (arXiv 2406.16282; their config ``lora_all_ViT_B``: rank 4 on qkv, proj, fc1, fc2, the
    head trained): every other parameter frozen, the adapters' B at zero (peft's init)."""
    import peft

    cfg = peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=LORA_TARGETS,
                          modules_to_save=["head"])
    return peft.get_peft_model(model, cfg)


def _build_lora(cfg: Config) -> tuple[nn.Module, list]:
    """The exact model, LoRA (peft) on it, then the mode: Mesa through ``ms.compress`` (the
    adapters' Linears converted too; a frozen base Linear stores nothing), checkpointing."""
    import mesa_ops as ms
    from models import create_model

    if cfg.mode.endswith("-explicit"):
        raise ValueError(f"mode {cfg.mode!r} with LoRA: use exact, mesaN, ckpt, mesa8+ckpt or mesa8+cckpt")
    model = lora_model(create_model(cfg.model, img_size=cfg.input_size, num_classes=cfg.num_classes),
                       cfg.lora)
    if cfg.mode.startswith("mesa"):
        model = ms.compress(model, f"mesa{cfg.mode[4]}", warn=False)
    if cfg.mode.endswith("+cckpt"):
        wrapped = checkpoint_blocks(model, bits=8)
    else:
        wrapped = checkpoint_blocks(model) if cfg.mode.endswith("ckpt") else []
    return model.to(cfg.device).train(), wrapped


def build(cfg: Config) -> tuple[nn.Module, list]:
    from models import create_model
    from models.layers import set_attn_impl

    if cfg.lora:
        return _build_lora(cfg)
    policy = _mode_policy(cfg.model, cfg.mode)
    model = create_model(cfg.model, ms_policy=policy, img_size=cfg.input_size,
                         num_classes=cfg.num_classes)
    if policy and "conv" in policy["tags"]:  # the image's patch embedding stays exact
        next(m for m in model.modules() if isinstance(m, nn.Conv2d)).enable = False
    if cfg.mode == "exact-explicit":
        for m in model.modules():
            if hasattr(m, "fused_attn"):
                m.fused_attn = False
    if cfg.mode.endswith("-explicit"):
        set_attn_impl(model, "explicit")
    if cfg.mode.endswith("+cckpt"):
        wrapped = checkpoint_blocks(model, bits=8)
    else:
        wrapped = checkpoint_blocks(model) if cfg.mode.endswith("ckpt") else []
    return model.to(cfg.device).train(), wrapped


def _rss_bytes() -> int:
    """Resident set size of this process now (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


OPTIMIZERS = ("sgd", "adamw")


def make_optimizer(model: nn.Module, cfg: Config) -> torch.optim.Optimizer:
    """SGD with momentum (one state per parameter) or AdamW as DeiT trains (lr 5e-4 x batch / 512,
    weight decay 0.05; two states per parameter)."""
    params = [p for p in model.parameters() if p.requires_grad]  # (LoRA: the adapters and head)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=5e-4 * cfg.batch / 512, weight_decay=0.05)
    raise ValueError(f"optimizer {cfg.optimizer!r}: expected one of {', '.join(OPTIMIZERS)}")


def dry_run(cfg: Config) -> Record:
    """``cfg`` checked without its device: the model built with its mode on the CPU and one train
    step at batch 1 (fp32), so that every (model, mode) is known to build and run; the record has
    no figures (``dry_run=True``)."""
    small = Config(**{**asdict(cfg), "device": "cpu", "batch": 1, "precision": "fp32"})
    _, _, _, step = _setup(small)
    step()
    return Record(_label(cfg), cfg.mode, cfg.precision, cfg.batch, cfg.input_size, cfg.device, 0, 0,
                  float("nan"), dry_run=True)


def _setup(cfg: Config):
    """(model, checkpoint wrappers, input batch, one train step) of a configuration."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(0)
    dev = cfg.device
    amp = PRECISIONS[cfg.precision]
    model, wrapped = build(cfg)
    opt = make_optimizer(model, cfg)
    x = torch.randn(cfg.batch, 3, cfg.input_size, cfg.input_size, device=dev)
    y = torch.randint(0, cfg.num_classes, (cfg.batch,), device=dev)
    loss_fn = nn.CrossEntropyLoss()

    def step():
        with torch.autocast(torch.device(dev).type, dtype=amp, enabled=amp is not None):
            out = model(x)
            out = out[0] if isinstance(out, tuple) else out
            loss = loss_fn(out.float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return model, wrapped, x, step


def measure_interleaved(cfgs: list[Config]) -> list[float]:
    """Median step times of ``cfgs`` (same model and batch, different modes) built side by side in
    this process and stepped in turn (one step of each per round), so that load from other
    processes hits every mode alike."""
    steppers = {j: _setup(c)[3] for j, c in enumerate(cfgs)}
    times = time_in_turn(steppers, {j: c.warmup for j, c in enumerate(cfgs)},
                         {j: c.steps for j, c in enumerate(cfgs)}, {j: c.device for j, c in enumerate(cfgs)})
    return [statistics.median(times[j]) if times[j] else float("nan") for j in range(len(cfgs))]


def measure(cfg: Config) -> Record:
    """Run one configuration in this process and return its record."""
    dev = cfg.device
    amp = PRECISIONS[cfg.precision]
    model, wrapped, x, step = _setup(cfg)

    if dev.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    baseline = _rss_bytes()
    times = []
    try:
        for i in range(cfg.warmup + cfg.steps):
            sync(dev)
            t0 = time.perf_counter()
            step()
            sync(dev)
            if i >= cfg.warmup:
                times.append(time.perf_counter() - t0)
    except torch.cuda.OutOfMemoryError:
        return Record(_label(cfg), cfg.mode, cfg.precision, cfg.batch, cfg.input_size, dev, 0, 0,
                      float("nan"), oom=True)
    if dev.startswith("cuda"):
        peak = torch.cuda.max_memory_allocated()
    else:  # the training peak above the loaded model: RSS high-water mark minus RSS before step 1
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline
    meter = saved_bytes(model, (x,), autocast_dtype=amp)
    # the meter sees what a checkpointed block keeps (torch's checkpoint saves its inputs for
    # backward, the packed input of a compressed one likewise): counted once, here
    saved = meter.total_bytes
    return Record(_label(cfg), cfg.mode, cfg.precision, cfg.batch, cfg.input_size, dev, saved,
                  int(peak), statistics.median(times) if times else float("nan"),
                  by_type=dict(meter.by_type))


# glibc keeps freed heap memory and fragments it, so the RSS high-water mark of a default process
# follows the allocator more than the live tensors; with every allocation above 64 KiB served by
# mmap (and returned on free), peak RSS tracks what training really holds. That setting slows
# steps (a page fault per fresh page), so CPU timing and CPU memory come from separate workers.
_MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def measure_fresh(cfg: Config) -> Record:
    """:func:`measure` in this process after freeing what earlier configurations left (CUDA:
    its peak memory is then this configuration's own)."""
    import gc

    gc.collect()
    if cfg.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return measure(cfg)


def _worker(cfg: Config, timeout: float | None, extra_env: dict | None = None) -> Record:
    cmd = [sys.executable, "-m", "benchmarks.models", json.dumps(asdict(cfg))]
    env = dict(os.environ, PYTHONWARNINGS="ignore", **(extra_env or {}))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"benchmark worker failed for {cfg}:\n{proc.stderr[-3000:]}")
    return Record(**json.loads(lines[-1]))


def run_interleaved(cfgs: list[Config], timeout: float | None = None) -> list[Record]:
    """Records of ``cfgs`` (one model, several modes; CPU): saved bytes and peak from one fresh
    memory worker each, step times from one worker that steps all of them in turn
    (:func:`measure_interleaved`)."""
    recs = [run_in_worker(c, timeout, memory_only=True) for c in cfgs]
    cmd = [sys.executable, "-m", "benchmarks.models", "--interleaved", json.dumps([asdict(c) for c in cfgs])]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("[")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"interleaved benchmark worker failed:\n{proc.stderr[-3000:]}")
    for r, t in zip(recs, json.loads(lines[-1])):
        r.step_time_s = t
    return recs


def run_in_worker(cfg: Config, timeout: float | None = None, memory_only: bool = False) -> Record:
    """``measure`` in fresh Python processes (so peak RSS belongs to this configuration): on
    CPU one worker times the steps, a second (one step, mmap-backed allocations) gives the peak."""
    if cfg.device.startswith("cuda"):
        return _worker(cfg, timeout)
    mem_cfg = Config(**{**asdict(cfg), "steps": 1, "warmup": 1})
    mem = _worker(mem_cfg, timeout, _MEMORY_ENV)
    if memory_only:
        return mem
    rec = _worker(cfg, timeout)
    rec.peak_bytes = mem.peak_bytes
    return rec


def largest_batch(cfg: Config, budget_bytes: int, max_batch: int = 4096, worker=None) -> int:
    """Largest batch whose peak memory fits ``budget_bytes`` (0 if even batch 1 does not)."""
    worker = worker or (lambda c: run_in_worker(c, memory_only=True))

    def fits(b):
        r = worker(Config(**{**asdict(cfg), "batch": b, "steps": 1, "warmup": 0}))
        return not r.oom and r.peak_bytes <= budget_bytes

    lo, hi = 0, 1
    while hi <= max_batch and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, max_batch + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def markdown_table(records: list[Record], budgets: dict | None = None) -> str:
    """One row per (model, mode, precision, batch) with ratios to the ``exact`` row of the same
    model, precision and batch."""
    exact = {(r.model, r.precision, r.batch): r for r in records if r.mode == "exact"}
    explicit = {(r.model, r.precision, r.batch): r for r in records if r.mode == "exact-explicit"}
    cols = ["model", "mode", "precision", "batch", "saved MiB", "saved x",
            *(["saved x explicit"] if explicit else []), "peak MiB", "peak x",
            "step s", "time x"] + (["max batch", "batch x"] if budgets else [])
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in records:
        e = exact.get((r.model, r.precision, r.batch))

        def ratio(a, b):
            return f"{a / b:.3f}" if e is not None and b else "-"
        x = explicit.get((r.model, r.precision, r.batch))
        row = [r.model, r.mode, r.precision, str(r.batch), f"{r.saved_bytes / 2**20:.1f}",
               ratio(r.saved_bytes, e.saved_bytes if e else 0),
               *([f"{r.saved_bytes / x.saved_bytes:.3f}" if x and x.saved_bytes else "-"] if explicit else []),
               f"{r.peak_bytes / 2**20:.0f}",
               ratio(r.peak_bytes, e.peak_bytes if e else 0), f"{r.step_time_s:.3f}",
               ratio(r.step_time_s, e.step_time_s if e else 0)]
        if budgets:
            b = budgets.get((r.model, r.mode))
            be = budgets.get((r.model, "exact"))
            row += [str(b) if b is not None else "-",
                    f"{b / be:.2f}" if b is not None and be else "-"]
        out.append("| " + " | ".join(row) + " |")
    return "\n".join(out)


def plot(records: list[Record], path: str) -> None:
    """Bar charts of peak memory and step time per mode, one group of bars per model."""
    plt = agg_pyplot()

    models = list(dict.fromkeys(r.model for r in records))
    modes = list(dict.fromkeys(r.mode for r in records))
    by = {(r.model, r.mode): r for r in records}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    width = 0.8 / max(1, len(modes))
    for ax, key, label in zip(axes, ("saved_bytes", "peak_bytes", "step_time_s"),
                              ("saved activations (MiB)", "peak memory (MiB)", "step time (s)")):
        for j, md in enumerate(modes):
            vals = []
            for m in models:
                r = by.get((m, md))
                v = getattr(r, key) if r else float("nan")
                vals.append(v / 2**20 if key != "step_time_s" else v)
            ax.bar([i + j * width for i in range(len(models))], vals, width, label=md)
        ax.set_xticks([i + width * (len(modes) - 1) / 2 for i in range(len(models))])
        ax.set_xticklabels(models, rotation=15, fontsize=8)
        ax.set_title(label)
    axes[0].legend(fontsize=8)
    r0 = records[0]
    fig.suptitle(f"Mesa benchmark: batch {r0.batch}, {r0.input_size}px, {r0.precision}, {r0.device}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":  # worker: python -m benchmarks.models [--interleaved] '<Config json (list)>'
    if sys.argv[1] == "--interleaved":
        print(json.dumps(measure_interleaved([Config(**c) for c in json.loads(sys.argv[2])])))
    else:
        print(json.dumps(asdict(measure(Config(**json.loads(sys.argv[1]))))))

"""One training epoch, evaluation and the training-throughput protocol (after DeiT's engine.py).

Shapes: a batch is ``(images (B, 3, S, S), targets (B,))``; with Mixup the targets become soft
``(B, num_classes)``. A distilled DeiT returns two logits in training; both heads get the loss.
"""
from __future__ import annotations

import contextlib
import math
import time

import torch
from timm.utils import NativeScaler, accuracy, dispatch_clip_grad

import mesa_ops as ms

from .logs import MetricLogger, SmoothedValue, log, max_memory_mb

__all__ = [
    "PlainScaler",
    "TrainingError",
    "autocast",
    "evaluate",
    "make_scaler",
    "train_one_epoch",
    "train_throughput",
]

MiB = 2.0 ** 20


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. a non-finite loss)."""


class PlainScaler:
    """The NativeScaler interface without loss scaling (fp32 / bf16): backward, clip, step."""

    state_dict_key = "amp_scaler"

    def __call__(self, loss, optimizer, clip_grad=None, clip_mode="norm", parameters=None, create_graph=False,
                 need_update=True):
        loss.backward(create_graph=create_graph)
        if need_update:
            if clip_grad is not None:
                dispatch_clip_grad(parameters, clip_grad, mode=clip_mode)
            optimizer.step()

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def make_scaler(amp: str, device: torch.device):
    """timm's NativeScaler (GradScaler) for fp16, a :class:`PlainScaler` otherwise."""
    return NativeScaler(device=device.type) if amp == "fp16" else PlainScaler()


def autocast(amp: str, device: torch.device):
    if amp in ("fp16", "bf16"):
        return torch.autocast(device.type, dtype=torch.float16 if amp == "fp16" else torch.bfloat16)
    return contextlib.nullcontext()


def _loss(criterion, outputs, targets):
    if isinstance(outputs, (tuple, list)):  # distilled DeiT in training: (cls logits, dist logits)
        return sum(criterion(o, targets) for o in outputs) / len(outputs)
    return criterion(outputs, targets)


@contextlib.contextmanager
def _nonfinite_at(epoch: int, step: int):
    """Mesa's non-finite check (a FloatingPointError naming the layer, in forward or backward) as
    a :class:`TrainingError` with the epoch and step, as exact's loss check says them."""
    try:
        yield
    except FloatingPointError as exc:
        raise TrainingError(f"non-finite values at epoch {epoch}, step {step}: {exc}; stopping") from exc


def train_one_epoch(model, criterion, data_loader, optimizer, device, epoch: int, loss_scaler,
                    amp: str = "none", max_norm=None, model_ema=None, mixup_fn=None, print_freq: int = 10,
                    use_tqdm: bool = False,
                    tb=None, global_step: int = 0, meter_model=None, lr_scheduler=None,
                    on_first_step=None, quiet: bool = False, compiled: bool = False,
                    compile_step: bool = False) -> dict:
    """One pass over ``data_loader``. Returns the epoch's averages: ``loss, lr, img/s,
    step_ms`` (forward + backward + update, data loading excluded), ``max_mem_mb`` and
    ``saved_act_mib`` (bytes autograd held for backward in the epoch's first step, measured with
    :class:`mesa_ops.SavedActivationMeter` on ``meter_model``, the model without DDP).
    ``lr_scheduler``: given, it is stepped after every update (``step_update``). ``on_first_step``:
    given, called with the first step's saved bytes (e.g. to compare them with a memory plan).
    ``quiet``: no progress lines and no averages line (the caller prints one line per epoch).
    ``compiled``: ``model`` is torch.compile's (the meter measures the second step, without module
    hooks: they must not be active while dynamo traces, nor retrace it; one step alone: NaN); ``compile_step``: the
    first step compiles (its time is returned as ``compile_s``, not in ``step_ms``)."""
    model.train()
    ml = MetricLogger(device=device)
    ml.add_meter("lr", SmoothedValue(window_size=1, fmt="{value:.6f}"))
    header = f"Epoch: [{epoch}]"
    step_ms = SmoothedValue(fmt="{avg:.1f}")
    n_steps = len(data_loader)
    measure_at = (1 if n_steps > 1 else -1) if compiled else 0
    saved = float("nan")
    compile_s = None
    for i, (samples, targets) in enumerate(ml.log_every(data_loader, print_freq, header,
                                                        batch_size_of=lambda b: b[0].shape[0],
                                                        use_tqdm=use_tqdm, quiet=quiet)):
        samples = samples.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        if mixup_fn is not None:
            samples, targets = mixup_fn(samples, targets)
        t0 = time.perf_counter()
        meter = (ms.SavedActivationMeter(meter_model or model, module_hooks=not compiled) if i == measure_at
                 else contextlib.nullcontext())
        with _nonfinite_at(epoch, i), meter, autocast(amp, device):
            outputs = model(samples)
            loss = _loss(criterion, outputs, targets)
        if i == measure_at:
            saved = meter.total_bytes / MiB
            if on_first_step is not None:
                on_first_step(meter.total_bytes)
        loss_value = loss.item()
        if not math.isfinite(loss_value):
            raise TrainingError(f"loss is {loss_value} at epoch {epoch}, step {i}; stopping")
        optimizer.zero_grad(set_to_none=True)
        second_order = getattr(optimizer, "is_second_order", False)
        with _nonfinite_at(epoch, i):
            loss_scaler(loss, optimizer, clip_grad=max_norm, parameters=model.parameters(),
                        create_graph=second_order)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if compile_step and i == 0:
            compile_s = time.perf_counter() - t0
        else:
            step_ms.update((time.perf_counter() - t0) * 1000.0)
        if model_ema is not None:
            model_ema.update(meter_model or model)
        if lr_scheduler is not None:
            lr_scheduler.step_update(num_updates=global_step + i + 1)
        lr = optimizer.param_groups[0]["lr"]
        ml.update(loss=loss_value, lr=lr)
        if tb is not None and (i % print_freq == 0 or i == n_steps - 1):
            tb.scalars({"loss": loss_value, "lr": lr, "img_per_s": ml.meters["img/s"].value,
                        "max_mem_mb": max_memory_mb(device)}, global_step + i, prefix="train_step/")
    ml.synchronize_between_processes()
    stats = {k: m.global_avg for k, m in ml.meters.items() if k != "img/s"}
    stats["img/s"] = ml.meters["img/s"].global_avg
    stats["step_ms"] = step_ms.global_avg if step_ms.count else float("nan")
    stats["max_mem_mb"] = max_memory_mb(device)
    stats["saved_act_mib"] = saved
    if compile_s is not None:
        stats["compile_s"] = compile_s
    if not quiet:
        log(f"Averaged stats: loss {stats['loss']:.4f}  lr {stats['lr']:.6f}  step {stats['step_ms']:.1f} ms  "
            f"saved activations {saved:.2f} MiB  max mem {stats['max_mem_mb']:.0f} MiB")
    return stats


@torch.no_grad()
def evaluate(data_loader, model, device, amp: str = "none", num_classes: int = 1000, print_freq: int = 10,
             use_tqdm: bool = False, quiet: bool = False, summary: bool = True, where: str = "") -> dict:
    """Top-1 / top-5 accuracy (%) and cross-entropy over ``data_loader``; prints DeiT's line
    ``* Acc@1 X Acc@5 Y loss Z`` (``quiet``: only that line; ``summary`` False: not that line either).
    Images whose logits are not all finite make it a :class:`TrainingError` naming their count and
    ``where`` (e.g. 'epoch 3'): an accuracy over them would be silently wrong."""
    criterion = torch.nn.CrossEntropyLoss()
    ml = MetricLogger(device=device)
    model.eval()
    k = min(5, num_classes)
    bad = torch.zeros((), dtype=torch.int64, device=device)
    for images, target in ml.log_every(data_loader, print_freq, "Test:", use_tqdm=use_tqdm, quiet=quiet):
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        with autocast(amp, device):
            output = model(images)
            loss = criterion(output, target)
        bad += (~torch.isfinite(output.float())).flatten(1).any(dim=1).sum()
        acc1, acc5 = accuracy(output.float(), target, topk=(1, k))
        n = images.shape[0]
        ml.meters["loss"].update(loss.item(), n=n)
        ml.meters["acc1"].update(acc1.item(), n=n)
        ml.meters["acc5"].update(acc5.item(), n=n)
    ml.synchronize_between_processes()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(bad)
    n_bad = int(bad)
    if n_bad or not math.isfinite(ml.meters["loss"].global_avg):
        total = ml.meters["acc1"].count
        raise TrainingError(f"validation{' at ' + where if where else ''}: {n_bad} of {total} images gave "
                            f"non-finite logits (loss {ml.meters['loss'].global_avg}); the model's weights or the "
                            "validation data hold non-finite values")
    if summary:
        log(f"* Acc@1 {ml.meters['acc1'].global_avg:.3f} Acc@5 {ml.meters['acc5'].global_avg:.3f} "
            f"loss {ml.meters['loss'].global_avg:.3f}")
    return {k: m.global_avg for k, m in ml.meters.items()}


def train_throughput(model, criterion, data_loader, optimizer, device, loss_scaler, amp: str = "none",
                     mixup_fn=None, warmup: int = 20, steps: int = 30) -> dict:
    """The original Mesa code's protocol: one batch, ``warmup`` untimed training steps, then
    ``steps`` timed ones. Prints and returns ``img/s`` and ``max_mem_mb`` (CUDA
    ``max_memory_allocated``, else peak RSS)."""
    model.train()
    samples, targets = next(iter(data_loader))
    samples, targets = samples.to(device), targets.to(device)
    if mixup_fn is not None:
        samples, targets = mixup_fn(samples, targets)
    b = samples.shape[0]

    def step():
        with autocast(amp, device):
            loss = _loss(criterion, model(samples), targets)
        optimizer.zero_grad(set_to_none=True)
        loss_scaler(loss, optimizer, parameters=model.parameters())

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dt = time.perf_counter() - t0
    out = {"batch_size": b, "img/s": steps * b / dt, "step_ms": dt / steps * 1000.0,
           "max_mem_mb": max_memory_mb(device)}
    what = "max_memory_allocated" if device.type == "cuda" else "peak RSS"
    log(f"batch_size {b} throughput {out['img/s']:.2f} img/s ({out['step_ms']:.1f} ms / step, "
        f"{warmup} warm-up + {steps} timed steps)")
    log(f"memory usage: {out['max_mem_mb']:.0f} MB ({what})")
    return out

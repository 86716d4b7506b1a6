"""Training logs: DeiT-style progress lines (ETA, loss, lr, img/s, max memory), a tqdm bar option,
JSON-lines ``log.txt``, tensorboard scalars, ``args.json``. Only the main process writes."""
from __future__ import annotations

import datetime
import json
import os
import resource
import sys
import time
from collections import defaultdict, deque

import torch

from .distributed import is_dist, is_main_process

__all__ = ["JsonLog", "MetricLogger", "SmoothedValue", "TensorBoard", "log", "max_memory_mb", "save_args"]

MB = 1024.0 * 1024.0


def log(*msg) -> None:
    """print on the main process only."""
    if is_main_process():
        print(*msg, flush=True)


def max_memory_mb(device) -> float:
    """CUDA ``max_memory_allocated`` on a CUDA device, else this process's peak RSS, in MiB."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.max_memory_allocated(dev) / MB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


class SmoothedValue:
    """A series: median / average over the last ``window`` values and the global average."""

    def __init__(self, window_size: int = 20, fmt: str = "{median:.4f} ({global_avg:.4f})"):
        self.deque = deque(maxlen=window_size)
        self.total = 0.0
        self.count = 0
        self.fmt = fmt

    def update(self, value, n: int = 1) -> None:
        self.deque.append(value)
        self.count += n
        self.total += value * n

    def synchronize_between_processes(self) -> None:
        """Sum count and total over ranks (the window stays local)."""
        if not is_dist():
            return
        t = torch.tensor([self.count, self.total], dtype=torch.float64,
                         device="cuda" if torch.distributed.get_backend() == "nccl" else "cpu")
        torch.distributed.all_reduce(t)
        self.count, self.total = int(t[0].item()), float(t[1].item())

    @property
    def median(self) -> float:
        return float(torch.tensor(list(self.deque)).median().item()) if self.deque else 0.0

    @property
    def avg(self) -> float:
        return float(sum(self.deque) / len(self.deque)) if self.deque else 0.0

    @property
    def global_avg(self) -> float:
        return self.total / max(self.count, 1)

    @property
    def value(self) -> float:
        return self.deque[-1] if self.deque else 0.0

    def __str__(self) -> str:
        return self.fmt.format(median=self.median, avg=self.avg, global_avg=self.global_avg, value=self.value)


class MetricLogger:
    """Meters plus :meth:`log_every`: yields the loader's batches and prints a progress line every
    ``print_freq`` steps (``Epoch: [3]  [ 40/312]  eta: 0:01:02  lr: 0.000500  loss: 2.1 (2.3)
    img/s: 812.4  time: 0.1531  data: 0.0012  max mem: 1234``), or drives a tqdm bar."""

    def __init__(self, device="cpu", delimiter: str = "  "):
        self.meters = defaultdict(SmoothedValue)
        self.delimiter = delimiter
        self.device = device

    def update(self, n: int = 1, **kwargs) -> None:
        for k, v in kwargs.items():
            if isinstance(v, torch.Tensor):
                v = v.item()
            self.meters[k].update(float(v), n=n)

    def add_meter(self, name: str, meter: SmoothedValue) -> None:
        self.meters[name] = meter

    def __str__(self) -> str:
        return self.delimiter.join(f"{k}: {v}" for k, v in self.meters.items())

    def synchronize_between_processes(self) -> None:
        for m in self.meters.values():
            m.synchronize_between_processes()

    def log_every(self, iterable, print_freq: int, header: str = "", batch_size_of=None, use_tqdm=False,
                  quiet: bool = False):
        """``quiet``: no progress lines and no closing line (the caller prints a summary)."""
        n = len(iterable)
        width = len(str(n))
        iter_time = SmoothedValue(fmt="{avg:.4f}")
        data_time = SmoothedValue(fmt="{avg:.4f}")
        bar = None
        # a bar written to a file or pipe is one ever-growing line: progress lines there instead
        if use_tqdm and is_main_process() and sys.stdout.isatty():
            from tqdm import tqdm
            bar = tqdm(total=n, desc=header.strip(), file=sys.stdout, dynamic_ncols=False, ncols=100,
                       leave=True, mininterval=0.5)
        start = end = time.time()
        for i, obj in enumerate(iterable):
            data_time.update(time.time() - end)
            yield obj
            iter_time.update(time.time() - end)
            if batch_size_of is not None and iter_time.value > 0:
                self.meters["img/s"].fmt = "{value:.1f}"
                self.meters["img/s"].update(batch_size_of(obj) / iter_time.value)
            if bar is not None:
                bar.update(1)
                if "loss" in self.meters:
                    bar.set_postfix_str(f"loss {self.meters['loss'].global_avg:.4f}", refresh=False)
            elif not quiet and (i % print_freq == 0 or i == n - 1):
                eta = datetime.timedelta(seconds=int(iter_time.global_avg * (n - i - 1)))
                log(self.delimiter.join([
                    f"{header}", f"[{i:{width}d}/{n}]", f"eta: {eta}", str(self),
                    f"time: {iter_time}", f"data: {data_time}",
                    f"max mem: {max_memory_mb(self.device):.0f}"]))
            end = time.time()
        if bar is not None:
            bar.close()
        total = time.time() - start
        if not quiet and bar is None:
            log(f"{header} Total time: {datetime.timedelta(seconds=int(total))} "
                f"({total / max(n, 1):.4f} s / it)")


class JsonLog:
    """Appends one JSON object per line to ``<output_dir>/log.txt`` (main process only)."""

    def __init__(self, output_dir: str):
        self.path = os.path.join(output_dir, "log.txt") if output_dir else None

    def write(self, record: dict) -> None:
        if self.path and is_main_process():
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


class TensorBoard:
    """``torch.utils.tensorboard`` writer in ``log_dir`` (main process only; a no-op otherwise)."""

    def __init__(self, log_dir: str | None):
        self.writer = None
        if log_dir and is_main_process():
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(log_dir=log_dir)

    def scalars(self, values: dict, step: int, prefix: str = "") -> None:
        if self.writer is None:
            return
        for k, v in values.items():
            if isinstance(v, (int, float)):
                self.writer.add_scalar(f"{prefix}{k}", v, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def save_args(args_dict: dict, output_dir: str) -> None:
    if output_dir and is_main_process():
        with open(os.path.join(output_dir, "args.json"), "w") as f:
            json.dump(args_dict, f, indent=2, sort_keys=True)
            f.write("\n")

"""Classification training and evaluation on the DeiT recipe, exact or with Mesa.

    import training
    args = training.get_args_parser().parse_args(argv)   # DeiT's flags + --ms-policy / --mesa-bits
    training.main(args)

Modules: ``args`` (the parser), ``engine`` (train_one_epoch / evaluate / train_throughput),
``checkpoint`` (atomic, weights_only-loadable checkpoints with every RNG state), ``logs`` (progress
lines, tensorboard, log.txt), ``distributed`` (torchrun / srun / one process), ``report`` (the
demo's table). ``KNOWN_ERRORS``: the exceptions that mean bad input, for a one-line CLI message.
"""
from data import DatasetError
from mesa_ops.policy import PolicyError
from models.checkpoint import CheckpointError

from . import args, checkpoint, distributed, engine, logs
from .args import args_to_dict, get_args_parser, parse_args
from .engine import TrainingError, evaluate, train_one_epoch, train_throughput
from .main import UsageError, build_model, main, resolve_args


def one_line(exc: BaseException) -> str:
    """An error message on one line: each section header of a multi-line message (e.g. a
    CheckpointError's "shape mismatch (19):") with its first entry."""
    parts = []
    for ln in str(exc).splitlines():
        if not ln.strip():
            continue
        if not ln[0].isspace():
            parts.append([ln.strip()])
        elif parts and len(parts[-1]) < 3:
            parts[-1].append(ln.strip() if len(parts[-1]) < 2 else "...")
    return "; ".join(" ".join(p) if len(p) > 1 else p[0].rstrip(":") for p in parts) or type(exc).__name__


KNOWN_ERRORS = (UsageError, DatasetError, PolicyError, CheckpointError, TrainingError, FileNotFoundError)

__all__ = [
    "KNOWN_ERRORS",
    "TrainingError",
    "UsageError",
    "args",
    "args_to_dict",
    "build_model",
    "checkpoint",
    "distributed",
    "engine",
    "evaluate",
    "get_args_parser",
    "logs",
    "main",
    "one_line",
    "parse_args",
    "resolve_args",
    "train_one_epoch",
    "train_throughput",
]

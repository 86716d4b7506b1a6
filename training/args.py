"""Command line of ``tools/train.py``: DeiT's flags and defaults (facebookresearch/deit main.py),
Mesa's ``--ms-policy`` / ``--mesa-bits``, and this repo's additions.

Every long option is accepted with dashes and with underscores (``--output-dir`` / ``--output_dir``,
``--num-workers`` / ``--num_workers``, ``--ms-policy`` / ``--ms_policy``, ...), so a DeiT or
original-Mesa command line runs unchanged.
"""
from __future__ import annotations

import argparse

from timm.utils import ParseKwargs

__all__ = ["args_to_dict", "get_args_parser", "parse_args"]

DATA_SETS = ("IMNET", "FOLDER", "CIFAR100", "CIFAR", "DIGITS", "FAKE")


class _Parser:
    """Adds each option under both spellings (dashes, underscores)."""

    def __init__(self, group):
        self.group = group

    def add(self, *flags, **kw):
        names = []
        for f in flags:
            for alt in (f, "--" + f[2:].replace("_", "-"), "--" + f[2:].replace("-", "_")):
                if alt.startswith("--") and alt not in names:
                    names.append(alt)
        if "dest" not in kw and kw.get("action") not in ("help",):
            kw["dest"] = flags[0][2:].replace("-", "_")
        return self.group.add_argument(*names, **kw)


def _batch_size(text: str):
    if text == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {text!r}") from None


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        "Mesa training and evaluation (DeiT recipe)", add_help=add_help,
        description="Train or evaluate a DeiT / Swin / PVT classifier, exact or with Mesa. "
                    "Options accept dashes or underscores (--output-dir / --output_dir).")
    g = _Parser(parser.add_argument_group("run"))
    g.add("--batch-size", type=_batch_size, default=64,
          help="per-process batch size (default 64); 'auto' with --memory-budget-gb: the largest batch "
               "whose memory plan fits")
    g.add("--epochs", type=int, default=300)
    g.add("--stop-after", type=int, default=None, metavar="N",
          help="stop after N epochs of this run (e.g. a job time limit); continue with --resume")
    g.add("--unscale-lr", action="store_true", help="do not scale --lr by global batch / 512")

    g = _Parser(parser.add_argument_group("model"))
    g.add("--model", default="deit_base_patch16_224", metavar="NAME", help="a name of models.list_models()")
    g.add("--input-size", type=int, default=None, help="image size (default: the data set's, 224 for IMNET)")
    g.add("--model-kwargs", nargs="*", default={}, action=ParseKwargs, metavar="KEY=VALUE",
          help="extra model constructor arguments, e.g. depth=4 embed_dim=96 patch_size=4")
    g.add("--drop", type=float, default=0.0, metavar="PCT", help="dropout rate")
    g.add("--drop-path", type=float, default=0.1, metavar="PCT", help="stochastic depth rate")
    g.add("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
          help="torch.compile the training step's model (backend: inductor when none is named; e.g. aot_eager). "
               "Mesa's kernels are native torch ops that the compiled graphs call without Python; evaluation "
               "and the EMA use the model as it is. The first step compiles (its time is logged, not averaged)")
    g.add("--model-ema", action="store_true", default=True, help="EMA of the weights (DeiT: on)")
    g.add("--no-model-ema", action="store_false", dest="model_ema")
    g.add("--model-ema-decay", type=float, default=0.99996)
    g.add("--model-ema-force-cpu", action="store_true", default=False)
    g.add("--model-ema-eval", action="store_true",
          help="also evaluate the EMA weights after each epoch (with --eval: the checkpoint's EMA)")
    g.add("--finetune", default="", metavar="PATH_OR_URL",
          help="initialise from a checkpoint; a classifier of another size is left at its init")

    g = _Parser(parser.add_argument_group("Mesa"))
    g.add("--ms-policy", default=None, metavar="FILE",
          help="Mesa policy file (configs/mesa/mesa_8bit.txt ...), applied with ms.policy.deploy_on_init")
    g.add("--mesa-bits", type=int, default=None, choices=(8, 4, 2),
          help="without --ms-policy: Mesa on fc, matmul, gelu, layernorm, softmax at this many bits; "
               "with it: the bits of the layers the policy enables")
    g.add("--ms-plan", default=None, metavar="FILE",
          help="a memory plan of tools/plan_memory.py (bits per layer, checkpointed blocks), applied as "
               "--ms-policy is; its predicted saved bytes are compared with the first step's")
    g.add("--memory-budget-gb", type=float, default=None, metavar="GB",
          help="plan Mesa bits and block checkpointing here so that one step's saved activations fit "
               "GB (1e9 bytes, per process) at --batch-size (or the largest batch: --batch-size auto); "
               "the plan goes to <output-dir>/memory_plan.txt")
    g.add("--scale-model", default=None, choices=("width", "depth"),
          help="with --memory-budget-gb: re-invest the budget in model size: the largest width (embed_dim, "
               "heads) or depth of --model's family whose memory plan fits at --batch-size (models.scale; "
               "the table of every mode is printed)")
    g.add("--no-mesa-dist-sync", action="store_true",
          help="do not all-reduce the quantizers' range statistics across ranks before the EMA update")

    g = _Parser(parser.add_argument_group("optimizer and schedule"))
    g.add("--opt", default="adamw", metavar="OPTIMIZER")
    g.add("--opt-eps", type=float, default=1e-8, metavar="EPSILON")
    g.add("--opt-betas", type=float, nargs="+", default=None, metavar="BETA")
    g.add("--clip-grad", type=float, default=None, metavar="NORM")
    g.add("--momentum", type=float, default=0.9, metavar="M")
    g.add("--weight-decay", type=float, default=0.05)
    g.add("--sched", default="cosine", metavar="SCHEDULER")
    g.add("--sched-on-updates", action="store_true",
          help="step the schedule (warm-up, decay) after every update, not every epoch (timm's option)")
    g.add("--lr", type=float, default=5e-4, help="learning rate for a global batch of 512")
    g.add("--lr-noise", type=float, nargs="+", default=None, metavar="pct, pct")
    g.add("--lr-noise-pct", type=float, default=0.67)
    g.add("--lr-noise-std", type=float, default=1.0)
    g.add("--warmup-lr", type=float, default=1e-6)
    g.add("--min-lr", type=float, default=1e-5)
    g.add("--decay-epochs", type=float, default=30)
    g.add("--warmup-epochs", type=int, default=5)
    g.add("--cooldown-epochs", type=int, default=10)
    g.add("--patience-epochs", type=int, default=10)
    g.add("--decay-rate", "--dr", type=float, default=0.1)

    g = _Parser(parser.add_argument_group("augmentation and regularisation"))
    g.add("--color-jitter", type=float, default=0.3)
    g.add("--aa", default="rand-m9-mstd0.5-inc1", help='AutoAugment policy, "none" for none')
    g.add("--smoothing", type=float, default=0.1, help="label smoothing")
    g.add("--train-interpolation", default="bicubic")
    g.add("--repeated-aug", action="store_true", default=True,
          help="repeated augmentation (RASampler) when distributed (DeiT: on)")
    g.add("--no-repeated-aug", action="store_false", dest="repeated_aug")
    g.add("--reprob", type=float, default=0.25, help="random erase probability")
    g.add("--remode", default="pixel")
    g.add("--recount", type=int, default=1)
    g.add("--mixup", type=float, default=0.8)
    g.add("--cutmix", type=float, default=1.0)
    g.add("--cutmix-minmax", type=float, nargs="+", default=None)
    g.add("--mixup-prob", type=float, default=1.0)
    g.add("--mixup-switch-prob", type=float, default=0.5)
    g.add("--mixup-mode", default="batch", choices=("batch", "pair", "elem"))

    g = _Parser(parser.add_argument_group("data"))
    g.add("--data-path", default=None, help="data set root (IMNET, FOLDER, CIFAR100)")
    g.add("--data-set", default="IMNET", type=str.upper, choices=DATA_SETS,
          help="FOLDER: any ImageFolder (DATA_PATH/train/<class>/..., DATA_PATH/val/<class>/...)")
    g.add("--strict-data", action="store_true",
          help="an unreadable image is an error naming it (default: skipped with a warning, counted)")
    g.add("--fake-size", type=int, default=1024, help="FAKE: training images (validation: a quarter)")
    g.add("--eval-crop-ratio", type=float, default=0.875)
    g.add("--num-workers", type=int, default=10)
    g.add("--pin-mem", action="store_true", default=True)
    g.add("--no-pin-mem", action="store_false", dest="pin_mem")

    g = _Parser(parser.add_argument_group("run control and output"))
    g.add("--output-dir", default="", help="where checkpoints, log.txt, args.json, tensorboard go; a "
          "directory that holds a run already needs --resume (continue it) or --overwrite")
    g.add("--overwrite", action="store_true",
          help="start afresh in an --output-dir that holds a run: its run files are deleted first")
    g.add("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available)")
    g.add("--amp", default=None, choices=("fp16", "bf16", "none"),
          help="autocast precision (default: fp16 on CUDA, none on CPU)")
    g.add("--seed", type=int, default=0)
    g.add("--resume", default="", metavar="PATH_OR_URL", help="checkpoint to continue from (or evaluate)")
    g.add("--trust-checkpoint", action="store_true",
          help="read --resume / --finetune with torch.load(weights_only=False): a full checkpoint of another "
               "code base (argparse / yacs config objects); it can run code, so only for files you trust")
    g.add("--start-epoch", type=int, default=0)
    g.add("--eval", action="store_true", help="evaluate only")
    g.add("--dist-eval", action="store_true", help="shard evaluation across ranks")
    g.add("--train-throughput", action="store_true",
          help="time training on one batch (20 warm-up, 30 timed steps) and exit")
    g.add("--print-freq", type=int, default=10, help="progress line every N steps")
    g.add("--tqdm", action="store_true", help="a tqdm bar per epoch instead of progress lines")
    g.add("--epoch-lines", action="store_true",
          help="one line per epoch (loss, lr, step time, saved activations, top-1), no progress lines "
               "(scripts/demo.sh when its output is not a terminal)")
    g.add("--save-rank-state", action="store_true",
          help="each rank writes its final model state to <output-dir>/rank<R>_state.pth")
    g.add("--no-tensorboard", action="store_true")

    g = _Parser(parser.add_argument_group("distributed (torchrun / srun set these from the environment)"))
    g.add("--fsdp", action="store_true",
          help="FSDP2 instead of DDP: fully_shard each block, then the root; checkpoints are DCP folders "
               "(<output-dir>/checkpoint), the whole model in checkpoint_full.pth at the end")
    g.add("--fsdp-reshard-after-forward", action="store_true", default=True,
          help="free the all-gathered parameters after each block's forward (FSDP2's default: on)")
    g.add("--no-fsdp-reshard-after-forward", action="store_false", dest="fsdp_reshard_after_forward")
    g.add("--world-size", type=int, default=1)
    g.add("--dist-url", default="env://")
    g.add("--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    return get_args_parser().parse_args(argv)


def args_to_dict(args: argparse.Namespace) -> dict:
    """The arguments as a plain dict of str / int / float / bool / None / lists / dicts, storable in
    a ``weights_only=True`` checkpoint and in JSON."""
    def plain(v):
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {str(k): plain(x) for k, x in v.items()}
        return str(v)
    return {k: plain(v) for k, v in sorted(vars(args).items())}

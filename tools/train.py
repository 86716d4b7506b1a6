"""Train or evaluate a classifier, exact or with Mesa (DeiT's recipe and flags).

    python tools/train.py --model deit_tiny_patch16_224 --data-set IMNET --data-path /imagenet \
        --batch-size 128 --output-dir outputs/deit_ti_mesa --ms-policy configs/mesa/mesa_8bit.txt
    torchrun --nproc_per_node 8 tools/train.py ...          # DDP (scripts/dist_train.sh)
    python tools/train.py --eval --resume CHECKPOINT_OR_URL --model ... --data-set ...

See ``python tools/train.py --help`` and the package ``training``.
"""
import os
import sys

# MKL's float32 GEMMs split their sums by the thread count (AVX-512 machines: other last bits with
# 1 and 2 threads); in its strict reproducible mode they do not, so that a run's bits do not
# depend on the thread count (docs/training.md). Read by MKL at its first call: set before any.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

import training  # noqa: E402


def main(argv=None) -> None:
    args = training.get_args_parser().parse_args(argv)
    try:
        training.main(args)
    except training.KNOWN_ERRORS as exc:
        sys.exit(f"error: {training.one_line(exc)}")


if __name__ == "__main__":
    main()

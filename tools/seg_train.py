"""Train a segmentor of configs/seg/ on ADE20K with mmengine's Runner (as mmsegmentation 1.x's
tools/train.py), e.g.

    python tools/seg_train.py configs/seg/fpn_pvt-tiny-mesa8_8xb4-40k_ade20k-512x512.py --work-dir work_dirs/x
    torchrun --nproc_per_node 8 tools/seg_train.py CONFIG --launcher pytorch     (scripts/dist_seg_train.sh)
"""
from __future__ import annotations

import argparse
import sys

from mmengine.config import DictAction

from models.seg import KNOWN_ERRORS, build_config, run_train
from models.seg.runner import LAUNCHERS


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Train a segmentor (configs/seg/) with mmengine's Runner")
    ap.add_argument("config", help="config file, e.g. configs/seg/fpn_pvt-tiny_8xb4-40k_ade20k-512x512.py")
    ap.add_argument("--work-dir", help="where logs and checkpoints go (default ./work_dirs/<config name>)")
    ap.add_argument("--amp", action="store_true", help="mixed precision (fp16 AmpOptimWrapper; needs a GPU)")
    ap.add_argument("--resume", nargs="?", const="auto", default=None, metavar="CHECKPOINT",
                    help="resume training: alone, from the latest checkpoint in the work dir; "
                         "or from the given checkpoint")
    ap.add_argument("--cfg-options", nargs="+", action=DictAction, metavar="KEY=VALUE",
                    help="override config entries, e.g. train_dataloader.batch_size=2 "
                         "model.backbone.init_cfg=None")
    ap.add_argument("--launcher", choices=LAUNCHERS, default="none", help="job launcher")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        cfg = build_config(args.config, work_dir=args.work_dir, amp=args.amp, resume=args.resume,
                           cfg_options=args.cfg_options, launcher=args.launcher)
        run_train(cfg)
    except KNOWN_ERRORS as exc:  # bad input: one line, exit status 1
        sys.exit(f"error: {exc}")


if __name__ == "__main__":
    main()

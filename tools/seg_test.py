"""Evaluate a trained segmentor checkpoint (mIoU on the config's test set) with mmengine's Runner
(as mmsegmentation 1.x's tools/test.py), e.g.

    python tools/seg_test.py configs/seg/fpn_pvt-tiny_8xb4-40k_ade20k-512x512.py work_dirs/x/iter_40000.pth
"""
from __future__ import annotations

import argparse
import sys

from mmengine.config import DictAction

from models.seg import KNOWN_ERRORS, build_config, run_test
from models.seg.runner import LAUNCHERS


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Test a segmentor checkpoint (configs/seg/)")
    ap.add_argument("config", help="config file the checkpoint was trained with")
    ap.add_argument("checkpoint", help="checkpoint file (iter_*.pth of seg_train.py)")
    ap.add_argument("--work-dir", help="where the test log goes (default ./work_dirs/<config name>)")
    ap.add_argument("--cfg-options", nargs="+", action=DictAction, metavar="KEY=VALUE",
                    help="override config entries, e.g. test_dataloader.dataset.data_root=...")
    ap.add_argument("--launcher", choices=LAUNCHERS, default="none", help="job launcher")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        cfg = build_config(args.config, work_dir=args.work_dir, cfg_options=args.cfg_options,
                           launcher=args.launcher)
        run_test(cfg, args.checkpoint)
    except KNOWN_ERRORS as exc:  # bad input: one line, exit status 1
        sys.exit(f"error: {exc}")


if __name__ == "__main__":
    main()

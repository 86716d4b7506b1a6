"""Export a training run's weights as safetensors that stock timm loads (quantizer state left out).

    python tools/export_weights.py outputs/deit_ti_mesa/checkpoint.pth deit_ti.safetensors [--ema]
    # then, anywhere timm is installed:
    #   timm.create_model("deit_tiny_patch16_224", pretrained=True, num_classes=N,
    #                     pretrained_cfg_overlay=dict(file="deit_ti.safetensors", num_classes=N))
    # (the tool prints this call with the run's model arguments)

``--layout mesa`` keeps this repo's keys (PVT v1, which timm does not have); ``tools/train.py
--eval / --resume / --finetune`` read either layout.
"""
import argparse
import sys

from timm.utils import ParseKwargs

import models


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", help="a checkpoint of tools/train.py (checkpoint.pth, checkpoint_full.pth)")
    p.add_argument("out", help="the .safetensors file to write")
    p.add_argument("--ema", action="store_true", help="export the EMA weights (model_ema) instead")
    p.add_argument("--layout", choices=models.export.LAYOUTS, default="timm",
                   help="timm: timm's keys (default); mesa: this repo's keys")
    p.add_argument("--model", default=None, help="model name, when the checkpoint records none")
    p.add_argument("--model-kwargs", nargs="*", default={}, action=ParseKwargs, metavar="KEY=VALUE")
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="read the checkpoint with torch.load(weights_only=False): only for files you trust")
    args = p.parse_args(argv)
    if not args.out.endswith(".safetensors"):
        sys.exit(f"error: {args.out}: the output name must end in .safetensors")
    try:
        info = models.export.export_checkpoint(args.checkpoint, args.out, model_name=args.model,
                                               model_kwargs=args.model_kwargs, ema=args.ema, layout=args.layout,
                                               weights_only=not args.trust_checkpoint,
                                               trust_remedy=models.checkpoint.TRUST_FLAG_REMEDY)
    except (models.CheckpointError, ValueError, TypeError) as exc:
        sys.exit(f"error: {exc}")
    print(f"wrote {info['keys']} tensors ({args.layout} layout, {'EMA' if args.ema else 'model'} weights of "
          f"{info['model']}) to {info['path']}")
    if args.layout == "timm":
        print(f"load with timm: {models.export.timm_load_call(info)}")


if __name__ == "__main__":
    main()

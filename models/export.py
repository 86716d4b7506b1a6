"""Export a model's weights as ``safetensors``, in timm's key layout (stock timm loads them) or in
this repo's.

    models.export.export_safetensors(model, "model.safetensors")            # timm's layout
    timm.create_model("deit_tiny_patch16_224", pretrained=True,                 # stock timm reads it
                      pretrained_cfg_overlay=dict(file="model.safetensors"))

(A classifier of other than 1000 classes needs ``num_classes=N`` in the overlay too, or timm
drops it as it drops any classifier whose size differs from the pretrained cfg's:
:func:`timm_load_call` writes the whole call.)

The Mesa quantizer state (ranges, counters) is left out: it is training state, not weights, and
stock timm's strict load would refuse it. Buffers a model derives from its geometry (Swin's
``relative_position_index`` / ``attn_mask``) are left out as timm leaves them out. DeiT's keys are
timm's already; Swin's are brought to timm's layout by the model's ``timm_layout``; PVT v1 has no
timm counterpart and exports in this repo's layout only (``layout='mesa'``), which
:func:`models.load_checkpoint` and ``tools/train.py --eval / --resume / --finetune`` read.
"""
from __future__ import annotations

import os

import timm
import torch
import torch.nn as nn

from .checkpoint import (TRUST_REMEDY, CheckpointError, architecture, extract_state_dict, load_checkpoint,
                         quantizer_keys, read_checkpoint)
from .registry import create_model

__all__ = ["LAYOUTS", "export_checkpoint", "export_safetensors", "export_state_dict", "timm_load_call",
           "timm_name"]

LAYOUTS = ("timm", "mesa")


def timm_name(model: nn.Module) -> str:
    """The timm model name of the same architecture (this repo's registry name, which timm knows
    as well: ``deit_*``, ``swin_*``), or '' when timm has none (PVT v1, a model built by hand)."""
    name = architecture(model)
    return name if name and name in timm.list_models() else ""


def export_state_dict(model: nn.Module, layout: str = "timm", state_dict: dict | None = None) -> dict:
    """The weights of ``model`` (or ``state_dict``, a state dict of it, e.g. its EMA's) without
    the quantizer state, in ``layout``: 'timm' (the keys of ``timm.create_model(timm_name(model))``)
    or 'mesa' (this repo's). Tensors are contiguous CPU copies (safetensors stores no views)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: expected one of {LAYOUTS}")
    sd = model.state_dict() if state_dict is None else dict(state_dict)
    drop = quantizer_keys(model)
    sd = {k: v for k, v in sd.items() if k not in drop}
    if layout == "timm":
        if not timm_name(model):
            raise ValueError(f"{architecture(model) or type(model).__name__}: timm has no model of this "
                             "architecture (PVT v1); export it with layout='mesa'")
        to_timm = getattr(model, "timm_layout", None)
        if to_timm is not None:
            sd = to_timm(sd)
        else:
            derived = set(getattr(model, "derived_buffers", ()))
            sd = {k: v for k, v in sd.items() if k.rsplit(".", 1)[-1] not in derived}
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in sd.items()}


def export_safetensors(model: nn.Module, path, layout: str = "timm", state_dict: dict | None = None,
                       metadata: dict | None = None) -> dict:
    """Write :func:`export_state_dict` to ``path`` (``safetensors.torch.save_file``, metadata
    ``format: pt`` as timm's hub files, the architecture and layout, and ``metadata``); written to
    a temporary name and renamed. Returns the state dict written."""
    from safetensors.torch import save_file

    sd = export_state_dict(model, layout, state_dict)
    meta = {"format": "pt", "architecture": architecture(model) or type(model).__name__, "layout": layout}
    meta.update({str(k): str(v) for k, v in (metadata or {}).items()})
    path = os.fspath(path)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        save_file(sd, tmp, metadata=meta)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return sd


def _num_classes(sd: dict) -> int:
    for k in ("head.weight", "head.fc.weight"):
        if k in sd:
            return int(sd[k].shape[0])
    return 0


def export_checkpoint(checkpoint, path, *, model_name: str | None = None, model_kwargs: dict | None = None,
                      ema: bool = False, layout: str = "timm", weights_only: bool = True,
                      trust_remedy: str = TRUST_REMEDY) -> dict:
    """Export the weights of a training checkpoint (``tools/train.py``'s ``checkpoint.pth``, an
    ``--fsdp`` run's ``checkpoint_full.pth``) as safetensors: the model is rebuilt from the
    checkpoint's ``args`` (``model``, ``model_kwargs``, ``input_size``; the classes from the
    classifier), or from ``model_name`` / ``model_kwargs`` where given, the weights loaded (all
    keys checked) and written by :func:`export_safetensors`. ``ema``: the EMA weights
    (``model_ema``) instead. Returns ``{'path', 'model', 'kwargs', 'keys', 'timm_name'}``."""
    src = os.fspath(checkpoint)
    obj = read_checkpoint(src, weights_only=weights_only, trust_remedy=trust_remedy)
    part = obj
    if ema:
        if not (isinstance(obj, dict) and isinstance(obj.get("model_ema"), dict)):
            raise CheckpointError(f"{src}: holds no EMA weights ('model_ema'); export without ema")
        part = {"model": obj["model_ema"]}
    sd, meta = extract_state_dict(part, src)
    run = obj.get("args") if isinstance(obj, dict) and isinstance(obj.get("args"), dict) else {}
    name = model_name or run.get("model") or meta.get("architecture")
    if not name:
        raise CheckpointError(f"{src}: records no model name (no 'args' or 'meta'); pass the model name")
    kwargs = dict(run.get("model_kwargs") or {})
    if run.get("input_size") and int(run["input_size"]) != 224:
        kwargs["img_size"] = int(run["input_size"])
    kwargs.update(model_kwargs or {})
    kwargs.setdefault("num_classes", _num_classes(sd))
    model = create_model(name, **kwargs)
    load_checkpoint(model, sd, verbose=lambda *_: None, reset_quantizers=True)
    written = export_safetensors(model, path, layout, metadata={"source": os.path.basename(src),
                                                                "weights": "model_ema" if ema else "model"})
    return {"path": os.fspath(path), "model": name, "kwargs": kwargs, "keys": len(written),
            "timm_name": timm_name(model)}


def _timm_kwargs(timm_model: str, kwargs: dict) -> dict:
    """The constructor arguments stock timm's model takes: built on the meta device (no memory),
    each argument it rejects as unexpected dropped (this repo's own, e.g. quantizer groups or
    ``attn_impl``: they do not change the weights)."""
    import re

    kw = dict(kwargs)
    for _ in range(len(kwargs) + 1):
        try:
            with torch.device("meta"):
                timm.create_model(timm_model, pretrained=False, **kw)
            return kw
        except TypeError as exc:
            m = re.search(r"unexpected keyword argument '(\w+)'", str(exc))
            if m is None or m.group(1) not in kw:
                return kw
            kw.pop(m.group(1))
    return kw


def timm_load_call(info: dict) -> str:
    """The ``timm.create_model`` call that loads an :func:`export_checkpoint` file in stock timm."""
    kw = _timm_kwargs(info["timm_name"], info["kwargs"]) if info.get("timm_name") else dict(info["kwargs"])
    overlay = f"file={info['path']!r}"
    if "num_classes" in kw:
        overlay += f", num_classes={kw['num_classes']!r}"
    extra = "".join(f", {k}={v!r}" for k, v in kw.items())
    return (f"timm.create_model({info['timm_name']!r}, pretrained=True, "
            f"pretrained_cfg_overlay=dict({overlay}){extra})")

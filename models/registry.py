"""Model registry: ``create_model``, ``list_models``, and the same models in timm's registry.

    model = models.create_model("deit_small_patch16_224", pretrained="deit_small.pth",
                                ms_policy="configs/mesa/mesa_8bit.txt")

Each model is also registered with timm as ``mesa_<name>`` (``timm.create_model(
"mesa_deit_small_patch16_224")``); timm's own entries are never overwritten (a clash raises).

``ms_policy``: None / False / "off" (Mesa layers stay disabled: the model computes exactly as
plain ``nn``), "mesa8" / "mesa4" / "mesa2" (``fc, matmul, gelu, layernorm, softmax`` at that
many bits, as ``configs/mesa/mesa_<b>bit.txt``), a policy file path (``ms.policy.deploy_on_init``;
a memory plan of ``tools/plan_memory.py`` is one: bits per layer and ``on checkpoint:`` blocks,
checked against the model) or a dict of :func:`mesa_ops.policy.set_mesa` arguments (e.g.
``{"bits": 4, "tags": ["fc"]}``). A policy file that enables no Mesa layer and checkpoints no
block warns (``UserWarning``): the model then trains exactly.
"""
from __future__ import annotations

import argparse
import fnmatch
import inspect
import logging
import os
import warnings
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch
import torch.nn as nn

import mesa_ops as ms

from .checkpoint import TIMM_PREFIX, CheckpointError, pretrained_filter_fn

__all__ = ["register_model", "create_model", "list_models", "is_model", "apply_policy",
           "model_entry", "registry_name", "TIMM_PREFIX", "MESA_TAGS"]

_log = logging.getLogger("models")
MESA_TAGS = ("fc", "matmul", "gelu", "layernorm", "softmax", "attention")
_SHORTHANDS = {"mesa8": 8, "mesa4": 4, "mesa2": 2}


@dataclass(frozen=True)
class ModelEntry:
    name: str
    fn: Callable[..., nn.Module]
    family: str
    cfg: dict = field(default_factory=dict)
    out_indices: int | tuple = (0, 1, 2, 3)


_MODELS: dict[str, ModelEntry] = {}
# timm reads the pretrained cfgs of the entrypoints registered from this module here (keyed by the
# timm name, ``mesa_<name>``), as it reads each of its own model modules' ``default_cfgs``.
default_cfgs: dict[str, dict] = {}


def register_model(fn=None, *, family: str = "", cfg: dict | None = None, out_indices=(0, 1, 2, 3)):
    """Decorator registering a model builder ``fn(**kwargs) -> nn.Module`` under ``fn.__name__``
    (here and, as ``mesa_<name>``, in timm). ``cfg``: timm ``PretrainedCfg`` fields (``url``,
    ``input_size``, ``mean``, ``std``, ``crop_pct``, ...); ``out_indices``: the default features
    of ``features_only=True``."""
    def wrap(f):
        name = f.__name__
        if name in _MODELS and _MODELS[name].fn is not f:
            raise ValueError(f"model {name!r} is already registered (by {_MODELS[name].fn.__module__})")
        _MODELS[name] = ModelEntry(name, f, family, dict(cfg or {}), out_indices)
        _register_with_timm(name)
        return f
    return wrap(fn) if fn is not None else wrap


def is_model(name: str) -> bool:
    return _strip(name) in _MODELS


def list_models(pattern: str = "*", family: str | None = None) -> list[str]:
    """Registered names matching the fnmatch ``pattern`` (and ``family``: deit, swin, pvt)."""
    return sorted(n for n, e in _MODELS.items()
                  if fnmatch.fnmatch(n, pattern) and (family is None or e.family == family))


def model_entry(name: str) -> ModelEntry:
    key = _strip(name)
    if key not in _MODELS:
        close = fnmatch.filter(_MODELS, f"*{key.split('_')[0]}*")[:8]
        raise KeyError(f"unknown model {name!r}; known: {', '.join(close or list_models())}")
    return _MODELS[key]


def _strip(name: str) -> str:
    short = name[len(TIMM_PREFIX):]
    return short if name.startswith(TIMM_PREFIX) and short in _MODELS else name


def registry_name(name: str) -> str:
    """This registry's name of a model (``mesa_deit_small_patch16_224`` -> ``deit_small_patch16_224``)."""
    return _strip(name)


def create_model(name: str, pretrained=None, ms_policy=None, checkpoint_kwargs: dict | None = None,
                 policy_verbose=None, pretrained_cfg=None, pretrained_cfg_overlay: dict | None = None,
                 cache_dir=None, **kwargs) -> nn.Module:
    """Build a registered model through timm's ``build_model_with_cfg``, load weights, apply a
    Mesa policy. ``timm.create_model('mesa_<name>', ...)`` calls this with the same arguments.

    Args:
        name: a name from :func:`list_models` (the ``mesa_`` prefix is accepted too).
        pretrained: None/False (random init); True: the pretrained cfg's weights, found as timm
            finds them (``pretrained_cfg_overlay=dict(file=<path>)`` first, then ``hf_hub_id``,
            then the official ``url``); a path or URL: that checkpoint (as ``file`` / ``url``).
            timm's ``load_pretrained`` reads it and :func:`models.checkpoint.pretrained_filter_fn`
            maps it onto the model (official, this repo's and the original Mesa code's formats);
            as for timm's models, another ``num_classes`` (0 included) leaves the classifier at its
            initialisation and another ``in_chans`` adapts the first conv (``adapt_input_conv``).
        ms_policy: see the module docstring; applied when the model is built (before any
            ``features_only`` wrapping, so policy indices count the whole model's layers).
        checkpoint_kwargs: ``skip`` (fnmatch patterns of checkpoint keys to leave at the model's
            values) and ``verbose`` (callable for the load summary) of the pretrained load.
        policy_verbose: callable for the policy's messages (default: the ``models`` logger).
        pretrained_cfg, pretrained_cfg_overlay, cache_dir: as in timm (the registered cfg, a tag
            or a dict; fields to override; the download cache). ``img_size`` / ``in_chans`` /
            ``num_classes`` are reflected in ``model.pretrained_cfg`` (``input_size``,
            ``pool_size``, ``num_classes``) once the weights are loaded.
        features_only, out_indices, feature_cls: timm's feature extraction: ``features_only=True``
            wraps the model in timm's ``FeatureGetterNet`` (``forward_intermediates``), returning
            the ``out_indices`` maps as (B, C, H, W) (default: the last 3 blocks of DeiT, the 4
            stages of Swin / PVT), with ``feature_info``; ``feature_cls='fx'``: timm's
            ``FeatureGraphNet`` (the outputs of the ``feature_info`` modules, in token layout);
            ``feature_cfg``: timm's dict of these (``feature_cls``, ``out_indices``, ...).
        **kwargs: the model's constructor arguments (img_size, num_classes, drop_path_rate,
            global_pool, grad_checkpointing, ...).
    """
    from timm.models import build_model_with_cfg

    entry = model_entry(name)
    ckpt = dict(checkpoint_kwargs or {})
    unknown = sorted(set(ckpt) - {"skip", "verbose"})
    if unknown:
        raise ValueError(f"checkpoint_kwargs {unknown}: create_model takes 'skip' and 'verbose' (timm's "
                         "loader reads weights_only on the CPU); for other options build the model and "
                         "call models.load_checkpoint(model, path, ...)")
    overlay = dict(pretrained_cfg_overlay or {})
    if pretrained is not None and not isinstance(pretrained, bool):
        overlay.update(_source_overlay(pretrained))
    out_indices = kwargs.pop("out_indices", entry.out_indices)
    feature_cfg = {"out_indices": out_indices, "feature_cls": "getter", **(kwargs.pop("feature_cfg", None) or {})}
    geometry = _cfg_overlay(entry.cfg, kwargs)

    def build(**model_kwargs):
        model = entry.fn(**model_kwargs)
        apply_policy(model, ms_policy, verbose=policy_verbose)
        return model

    filter_fn = partial(pretrained_filter_fn, skip=tuple(ckpt.get("skip", ())), verbose=ckpt.get("verbose"))
    # checkpoints of training scripts hold their argparse.Namespace (as the original Mesa code's do)
    if cache_dir is not None:
        if "cache_dir" not in inspect.signature(build_model_with_cfg).parameters:
            import timm
            raise TypeError(f"create_model(cache_dir=...): timm {timm.__version__} has no cache_dir "
                            "argument (timm >= 1.0.14 has)")
        kwargs["cache_dir"] = cache_dir
    with torch.serialization.safe_globals([argparse.Namespace]):
        model = build_model_with_cfg(build, TIMM_PREFIX + entry.name, bool(pretrained),
                                     pretrained_cfg=pretrained_cfg, pretrained_cfg_overlay=overlay,
                                     pretrained_filter_fn=filter_fn, feature_cfg=feature_cfg, **kwargs)
    _reflect_geometry(model, {k: v for k, v in geometry.items() if k not in overlay})
    return model


def _source_overlay(source) -> dict:
    """The pretrained-cfg fields that make timm's loader read ``source`` (a path or URL)."""
    src = os.fspath(source)
    if src.startswith(("http://", "https://", "file://")):
        return {"url": src, "file": None, "hf_hub_id": None}
    if not os.path.isfile(src):
        raise CheckpointError(f"checkpoint not found: {src}")
    return {"file": src}


def _reflect_geometry(model: nn.Module, geometry: dict) -> None:
    """``input_size`` / ``pool_size`` / ``num_classes`` of the built model into its pretrained cfg
    (after loading, which reads the weights' values there; a features wrapper's cfg has no
    classifier fields)."""
    inner = getattr(model, "model", None)
    if inner is not None and isinstance(getattr(inner, "pretrained_cfg", None), dict):
        inner.pretrained_cfg.update(geometry)
    cfg = getattr(model, "pretrained_cfg", None)
    if isinstance(cfg, dict):
        cfg.update({k: v for k, v in geometry.items() if k in cfg or k != "num_classes"})


def _cfg_overlay(cfg: dict, kwargs: dict) -> dict:
    """The pretrained-cfg fields that the constructor arguments change: input size (and with it
    Swin's ``pool_size``), channels, classes."""
    overlay = {}
    c, h, w = cfg.get("input_size", (3, 224, 224))
    if "img_size" in kwargs:
        s = kwargs["img_size"]
        h, w = (tuple(s) if isinstance(s, (tuple, list)) else (s, s))
        pool = cfg.get("pool_size")
        if pool:
            h0, w0 = cfg["input_size"][1:]
            overlay["pool_size"] = (h * pool[0] // h0, w * pool[1] // w0)
    if "in_chans" in kwargs:
        c = kwargs["in_chans"]
    if "img_size" in kwargs or "in_chans" in kwargs:
        overlay["input_size"] = (c, h, w)
    if "num_classes" in kwargs:
        overlay["num_classes"] = kwargs["num_classes"]
    return overlay


def apply_policy(model: nn.Module, ms_policy, verbose=None) -> nn.Module:
    """Switch Mesa on the model's layers per ``ms_policy`` (see the module docstring)."""
    verbose = verbose or _log.info
    if ms_policy is None or ms_policy is False or ms_policy == "off":
        return model
    if isinstance(ms_policy, dict):
        ms.policy.set_mesa(model, **{"enable": True, **ms_policy})
    elif isinstance(ms_policy, str) and ms_policy in _SHORTHANDS:
        ms.policy.set_mesa(model, enable=True, bits=_SHORTHANDS[ms_policy], tags=MESA_TAGS)
    elif isinstance(ms_policy, (str, os.PathLike)) and os.path.isfile(ms_policy):
        from mesa_ops import planner

        planner.apply_plan(model, os.fspath(ms_policy), verbose=verbose)  # (any policy file)
        if not any(m.enable for _, m in ms.policy.mesa_layers(model)) and not planner.checkpointed_blocks(model):
            warnings.warn(f"ms_policy={os.fspath(ms_policy)!r} enables no Mesa layer and checkpoints no block: "
                          "the model trains exactly, saving no activation memory", UserWarning, stacklevel=2)
    else:
        raise ValueError(f"ms_policy={ms_policy!r}: expected None, 'off', "
                         f"{', '.join(map(repr, _SHORTHANDS))}, a dict of ms.policy.set_mesa "
                         "arguments or the path of an existing policy file")
    return model


# ---- timm --------------------------------------------------------------------------------------
def _register_with_timm(name: str) -> None:
    """Register ``mesa_<name>`` with timm (never over one of timm's own names)."""
    import timm.models

    timm_name = TIMM_PREFIX + name
    if timm.models.is_model(timm_name):
        if getattr(timm.models.model_entrypoint(timm_name), "_mesa_entrypoint", None) == name:
            return  # already ours (module re-import)
        raise RuntimeError(f"timm already has a model named {timm_name!r}; not overwriting it")

    def entrypoint(pretrained=False, pretrained_cfg=None, pretrained_cfg_overlay=None, cache_dir=None,
                   **kwargs):
        return create_model(name, pretrained=pretrained or None, pretrained_cfg=pretrained_cfg,
                            pretrained_cfg_overlay=pretrained_cfg_overlay, cache_dir=cache_dir, **kwargs)

    entrypoint.__name__ = entrypoint.__qualname__ = timm_name
    entrypoint.__module__ = __name__
    entrypoint.__doc__ = f"mesa_ops {name} (see models.create_model)."
    entrypoint._mesa_entrypoint = name
    globals()[timm_name] = entrypoint  # timm lists entrypoints in their module's __all__
    default_cfgs[timm_name] = dict(_MODELS[name].cfg)
    timm.models.register_model(entrypoint)

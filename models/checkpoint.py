"""Checkpoint loading and saving for the models of this package.

:func:`load_checkpoint` reads

* the official checkpoints of DeiT, Swin and PVT (a bare state dict or ``{'model': ...}``; also
  ``{'state_dict': ...}`` and DDP's ``module.`` prefix),
* checkpoints of this repo (:func:`save_checkpoint`, with quantizer state),
* checkpoints of the original Mesa code (quantizer keys ``clip_val``, ``shift``, ``iteration`` on
  single-input layers, ``quant1.*`` / ``quant2.*`` under MatMul and Softmax),

into a model, and checks every key: the only keys a checkpoint may lack are the model's Mesa
quantizer state (reported in the returned :class:`LoadReport`) and buffers the model derives
from its own geometry (Swin's ``relative_position_index`` / ``attn_mask``, always the model's).
Any other missing, unexpected or mis-shaped key raises :class:`CheckpointError` naming it.
Position embeddings and relative-position tables of another resolution / window are resized
(the model's ``resize_checkpoint_tensor``). Files are read with ``torch.load(weights_only=True)``
(``argparse.Namespace`` allowed, as training scripts store their args).

Integrity: every checkpoint this repo writes (:func:`save_checkpoint`, ``training.checkpoint``)
holds ``'checksum': {'algorithm': 'sha256-tree-v1', 'value': hex}``, a SHA-256 of the payload
(every other entry: keys, tensor dtypes, shapes and bytes, scalars), and :func:`read_checkpoint`
verifies it (:class:`CheckpointError` naming the file on a mismatch). A file without one (the
official DeiT / Swin / PVT checkpoints, the original Mesa code's) loads as before.
"""
from __future__ import annotations

import argparse
import fnmatch
import hashlib
import logging
import os
import pickle
import urllib.error
import urllib.parse
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from mesa_ops.layers import MESA_LAYERS
from mesa_ops.quant import QuantMixin

__all__ = ["CheckpointError", "LoadReport", "load_checkpoint", "save_checkpoint", "read_checkpoint",
           "extract_state_dict", "match_state_dict", "pretrained_filter_fn", "quantizer_keys",
           "resize_pos_embed", "resize_rel_pos_bias_table", "FORMAT_NAME", "CHECKSUM_KEY",
           "add_checksum", "payload_checksum", "verify_checksum", "hub_cache_path"]

_log = logging.getLogger("models")
FORMAT_NAME = "mesa-repro"
FORMAT_VERSION = 1
QUANT_BUFFERS = ("clip_val", "shift", "iteration", "draws")
CHECKSUM_KEY = "checksum"
CHECKSUM_ALGORITHM = "sha256-tree-v1"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or does not fit the model."""


@dataclass
class LoadReport:
    """What :func:`load_checkpoint` did. ``missing_quantizer_keys``: the model's quantizer state
    the checkpoint did not have (left at its initial value); ``ignored_quantizer_keys``: quantizer
    state in the checkpoint for layers that are not Mesa layers in this model."""
    source: str
    format: str  # 'official' (no quantizer state), 'mesa' (original Mesa code / this repo), 'mesa-repro'
    loaded_keys: list = field(default_factory=list)
    missing_quantizer_keys: list = field(default_factory=list)
    ignored_quantizer_keys: list = field(default_factory=list)
    resized_keys: list = field(default_factory=list)
    # quantizers whose state did not fit (other group counts): (name, checkpoint shape, model
    # shape); with ``reset_quantizers`` they keep their initial state and start afresh
    reset_quantizers: list = field(default_factory=list)
    derived_keys: list = field(default_factory=list)
    skipped_keys: list = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    def summary(self) -> str:
        parts = [f"loaded {len(self.loaded_keys)} tensors from {self.source} ({self.format} format)"]
        if self.missing_quantizer_keys:
            parts.append(f"{len(self.missing_quantizer_keys)} quantizer keys missing (initial values kept)")
        if self.ignored_quantizer_keys:
            parts.append(f"{len(self.ignored_quantizer_keys)} quantizer keys ignored (no Mesa layer here)")
        if self.reset_quantizers:
            parts.append(self.reset_line())
        if self.resized_keys:
            parts.append(f"resized {', '.join(self.resized_keys)}")
        if self.skipped_keys:
            parts.append(f"skipped {', '.join(self.skipped_keys)}")
        return "; ".join(parts)

    def reset_line(self, outcome: str = "start afresh") -> str:
        """One line on the quantizers whose state did not fit (empty when none)."""
        if not self.reset_quantizers:
            return ""
        name, a, b = self.reset_quantizers[0]
        return (f"{len(self.reset_quantizers)} quantizers' state did not fit this model's groups and was not "
                f"loaded (e.g. {name}: checkpoint {a} vs model {b}): they {outcome}")


# ---- checksum ------------------------------------------------------------------------------------
def _feed(h, x) -> None:
    """Hash ``x`` into ``h``: the structure (dict keys in sorted order, list / tuple lengths), each
    tensor's dtype, shape and bytes, each scalar's repr (exact for floats)."""
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        if t.numel():
            h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    elif isinstance(x, dict):
        h.update(f"D{len(x)}".encode())
        for k in sorted(x, key=repr):
            h.update(f"K{k!r}".encode())
            _feed(h, x[k])
    elif isinstance(x, (list, tuple)):
        h.update(f"{'L' if isinstance(x, list) else 'U'}{len(x)}".encode())
        for v in x:
            _feed(h, v)
    elif isinstance(x, argparse.Namespace):
        _feed(h, vars(x))
    else:
        h.update(f"S{type(x).__name__}:{x!r}".encode())


def payload_checksum(obj: dict) -> str:
    """SHA-256 (hex) of a checkpoint dict's payload: every entry but ``'checksum'``."""
    h = hashlib.sha256()
    _feed(h, {k: v for k, v in obj.items() if k != CHECKSUM_KEY})
    return h.hexdigest()


def add_checksum(obj: dict) -> dict:
    """``obj`` with ``'checksum'`` set to its payload's :func:`payload_checksum` (in place)."""
    obj[CHECKSUM_KEY] = {"algorithm": CHECKSUM_ALGORITHM, "value": payload_checksum(obj)}
    return obj


def verify_checksum(obj, source: str) -> bool:
    """Check the stored checksum of a loaded checkpoint; True when there was one to check, False
    for a checkpoint without one (foreign files). Raises :class:`CheckpointError` on a mismatch."""
    if not isinstance(obj, dict):
        return False
    ck = obj.get(CHECKSUM_KEY)
    if not (isinstance(ck, dict) and ck.get("algorithm") == CHECKSUM_ALGORITHM):
        return False
    got = payload_checksum(obj)
    if got != ck.get("value"):
        raise CheckpointError(
            f"{source}: checksum mismatch, the file is corrupted (stored sha256 {str(ck.get('value'))[:12]}..., "
            f"contents hash to {got[:12]}...); copy it again or use an earlier checkpoint")
    return True


# ---- reading -------------------------------------------------------------------------------------
def _is_url(s: str) -> bool:
    return s.startswith(("http://", "https://", "file://"))


# what a refusal of ``weights_only=True`` tells the caller to do (the tools name their own flag)
TRUST_REMEDY = "If you trust this file, pass weights_only=False."
# the same for the tools (tools/train.py, tools/export_weights.py): their flag
TRUST_FLAG_REMEDY = ("If you trust this file (e.g. a full checkpoint of the original DeiT / Swin / Mesa code, "
                     "holding its args or yacs config), add --trust-checkpoint to read it with weights_only=False.")


def read_checkpoint(path_or_url, map_location="cpu", weights_only: bool = True, *,
                    trust_remedy: str = TRUST_REMEDY):
    """The object stored at a path or URL (``torch.load`` / ``torch.hub``, weights_only by default;
    a ``.safetensors`` file: its state dict, through ``safetensors.torch.load_file``), its checksum
    verified when it has one (see the module docstring). A URL is downloaded into torch.hub's cache
    (``<torch.hub.get_dir()>/checkpoints/<file name>``) unless already there; one that cannot be
    fetched raises :class:`CheckpointError` saying so and where a manual download goes. A file
    holding objects ``weights_only=True`` refuses (e.g. the yacs ``CfgNode`` of the official Swin
    code's checkpoints) raises :class:`CheckpointError` naming the object and ``trust_remedy``."""
    src = os.fspath(path_or_url)
    obj = _read(src, map_location, weights_only, trust_remedy)
    verify_checksum(obj, src)
    return obj


def is_safetensors(src: str) -> bool:
    """A ``.safetensors`` path or URL (by name: the format has no magic number)."""
    return urllib.parse.urlparse(src).path.endswith(".safetensors") if _is_url(src) else \
        src.endswith(".safetensors")


def _read_safetensors(path: str, map_location) -> dict:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    device = str(map_location) if isinstance(map_location, (str, torch.device)) else "cpu"
    try:
        return load_file(path, device=device)
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file ({type(exc).__name__}: {exc})") from exc


def hub_cache_path(url: str) -> str:
    """Where torch.hub keeps (and looks for) the download of ``url``."""
    name = os.path.basename(urllib.parse.urlparse(url).path)
    return os.path.join(torch.hub.get_dir(), "checkpoints", name)


def _download(url: str) -> None:
    dst = hub_cache_path(url)
    if os.path.isfile(dst):
        return
    try:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        torch.hub.download_url_to_file(url, dst, progress=False)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise CheckpointError(f"{url}: could not be downloaded ({type(exc).__name__}: {reason}); download "
                              f"it by hand to {dst} (torch.hub's cache, read from there) or pass "
                              "a local path") from exc


def _read(src: str, map_location, weights_only: bool, trust_remedy: str = TRUST_REMEDY):
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            if _is_url(src):
                _download(src)
                if is_safetensors(src):
                    return _read_safetensors(hub_cache_path(src), map_location)
                return torch.hub.load_state_dict_from_url(src, map_location=map_location, progress=False,
                                                          weights_only=weights_only)
            if not os.path.isfile(src):
                raise CheckpointError(f"checkpoint not found: {src}")
            if is_safetensors(src):
                return _read_safetensors(src, map_location)
            return torch.load(src, map_location=map_location, weights_only=weights_only)
    except CheckpointError:
        raise
    except pickle.UnpicklingError as exc:
        if weights_only and "Weights only load failed" in str(exc):
            lines = [ln.strip() for ln in str(exc).splitlines() if "Unsupported global" in ln]
            raise CheckpointError(
                f"{src}: holds objects torch.load(weights_only=True) refuses "
                f"({lines[0] if lines else str(exc).splitlines()[0]}). {trust_remedy}") from exc
        raise CheckpointError(f"{src}: not a readable PyTorch checkpoint ({exc})") from exc
    except (RuntimeError, EOFError, IndexError, KeyError, ValueError, TypeError, OSError) as exc:
        raise CheckpointError(
            f"{src}: not a readable PyTorch checkpoint ({type(exc).__name__}: {exc})") from exc


def extract_state_dict(obj, source: str = "checkpoint") -> tuple[dict, dict]:
    """(state_dict, meta) from a loaded checkpoint: a bare state dict, ``{'model': sd}`` or
    ``{'state_dict': sd}``; the ``module.`` prefix of DDP is removed."""
    meta = {}
    if isinstance(obj, dict) and isinstance(obj.get("meta"), dict):
        meta = obj["meta"]
    sd = obj
    for key in ("model", "state_dict"):
        if isinstance(sd, dict) and isinstance(sd.get(key), dict):
            sd = sd[key]
            break
    if not isinstance(sd, dict) or not sd:
        raise CheckpointError(f"{source}: holds no state dict (expected a dict of tensors, or one "
                              f"under 'model' or 'state_dict'; got {type(obj).__name__})")
    bad = [k for k, v in sd.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        keys = list(obj) if isinstance(obj, dict) else []
        raise CheckpointError(f"{source}: not a state dict; non-tensor entries {bad[:8]} "
                              f"(top-level keys: {keys[:8]})")
    if all(k.startswith("module.") for k in sd):
        sd = {k[len("module."):]: v for k, v in sd.items()}
    return dict(sd), meta


# ---- resizing ------------------------------------------------------------------------------------
def resize_pos_embed(posemb: torch.Tensor, new_grid, num_prefix_tokens: int = 1,
                     old_grid=None) -> torch.Tensor:
    """(1, P + h*w, C) -> (1, P + H*W, C): the grid part resized bicubically (as DeiT's fine-tuning
    at 384px), the P prefix tokens kept."""
    prefix, grid = posemb[:, :num_prefix_tokens], posemb[:, num_prefix_tokens:]
    n = grid.shape[1]
    if old_grid is None:
        side = int(round(n ** 0.5))
        old_grid = (side, side)
    if old_grid[0] * old_grid[1] != n:
        raise CheckpointError(f"position embedding with {n} grid tokens is not a {old_grid} grid")
    new_grid = tuple(new_grid)
    if tuple(old_grid) == new_grid:
        return posemb
    dtype = grid.dtype
    g = grid.reshape(1, old_grid[0], old_grid[1], -1).permute(0, 3, 1, 2).float()
    g = F.interpolate(g, size=new_grid, mode="bicubic", align_corners=False)
    g = g.permute(0, 2, 3, 1).reshape(1, new_grid[0] * new_grid[1], -1).to(dtype)
    return torch.cat([prefix, g], dim=1)


def resize_rel_pos_bias_table(table: torch.Tensor, new_window) -> torch.Tensor:
    """Swin's ((2w-1)^2, H) relative position bias table resized bicubically to window
    ``new_window`` (as the official Swin code does for fine-tuning at another window)."""
    n, heads = table.shape
    side = int(round(n ** 0.5))
    if side * side != n:
        raise CheckpointError(f"relative position table with {n} rows is not square")
    new = (2 * new_window[0] - 1, 2 * new_window[1] - 1)
    if (side, side) == new:
        return table
    t = table.permute(1, 0).reshape(1, heads, side, side).float()
    t = F.interpolate(t, size=new, mode="bicubic", align_corners=False)
    return t.reshape(heads, new[0] * new[1]).permute(1, 0).contiguous().to(table.dtype)


# ---- loading -------------------------------------------------------------------------------------
def quantizer_keys(model: nn.Module) -> set[str]:
    """State-dict keys of the model's Mesa quantizer state."""
    keys = set()
    for name, m in model.named_modules():
        if isinstance(m, QuantMixin):
            keys.update(f"{name}.{b}" if name else b for b in QUANT_BUFFERS)
    return keys


def _looks_like_quant_key(key: str) -> bool:
    return key.rsplit(".", 1)[-1] in QUANT_BUFFERS


def _fmt(keys, limit=40) -> str:
    keys = list(keys)
    more = f"\n  ... and {len(keys) - limit} more" if len(keys) > limit else ""
    return "\n  " + "\n  ".join(keys[:limit]) + more


# the prefix of this repo's models in timm's registry (models.registry registers them under it)
TIMM_PREFIX = "mesa_"


def architecture(model: nn.Module) -> str:
    """The model's name in this repo's registry, from its timm ``pretrained_cfg`` (``mesa_`` +
    name), or '' for a model without one."""
    cfg = getattr(model, "pretrained_cfg", None) or {}
    arch = str(cfg.get("architecture", "") or "")
    return arch[len(TIMM_PREFIX):] if arch.startswith(TIMM_PREFIX) else arch


def _model_name(model: nn.Module) -> str:
    return architecture(model) or type(model).__name__


def _other_model(model, own, sd, meta, qkeys, mismatched, missing, unexpected) -> str:
    """One line naming both models when the checkpoint is of another model: its recorded
    architecture differs from the model's, or (same keys) weights other than the classifier
    differ in shape (another width); else ''. A classifier of another size or other quantizer
    group counts keep the detailed message."""
    ck_arch = str(meta.get("architecture") or "")
    m_arch = _model_name(model)
    shape_keys = [m.split(":")[0] for m in mismatched if m.split(":")[0] not in qkeys]
    body = [k for k in shape_keys if not k.startswith(("head.", "head_dist."))]
    other_arch = bool(ck_arch) and ck_arch != m_arch and bool(missing or unexpected or mismatched)
    if not other_arch and not (body and not missing and not unexpected):
        return ""
    ck_desc, m_desc = ck_arch or "of another model", m_arch
    first = next((k for k in own if k in body), None)
    if first is not None:  # the width: the first dim where the first differing weight differs
        a, b = tuple(sd[first].shape), tuple(own[first].shape)
        dim = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if dim is not None and len(a) == len(b):
            ck_desc = f"{ck_desc} ({a[dim]}-dim)"
            m_desc = f"{m_desc} ({b[dim]}-dim)"
    parts = [f"checkpoint is {ck_desc}, model is {m_desc}"]
    if first is not None:
        parts.append(f"{len(shape_keys)} tensors differ in shape, e.g. {first}: checkpoint "
                     f"{tuple(sd[first].shape)} vs model {tuple(own[first].shape)}")
    if missing:
        parts.append(f"{len(missing)} model keys missing from the checkpoint, e.g. {missing[0]}")
    if unexpected:
        parts.append(f"{len(unexpected)} checkpoint keys not in the model, e.g. {unexpected[0]}")
    return "; ".join(parts)


def load_checkpoint(model: nn.Module, checkpoint, *, skip=(), weights_only: bool = True,
                    map_location="cpu", verbose=None, reset_quantizers: bool = False) -> LoadReport:
    """Load ``checkpoint`` (path, URL or an already loaded dict) into ``model``; see the module
    docstring for what is accepted. ``skip``: fnmatch patterns of keys to leave at the model's
    values (e.g. ``("head.*",)`` to fine-tune with another number of classes).
    ``reset_quantizers``: a quantizer whose state does not fit (the checkpoint was trained with
    other group counts, e.g. the original Mesa's ``convert_by_num_groups(model, 3)`` on the stem)
    keeps its initial state, all of it, and starts afresh (listed in
    ``LoadReport.reset_quantizers``) instead of failing. Raises :class:`CheckpointError` naming
    every key that does not fit."""
    verbose = verbose or _log.info
    if isinstance(checkpoint, dict):
        source, obj = "<state dict>", checkpoint
    else:
        source = os.fspath(checkpoint)
        obj = read_checkpoint(source, map_location=map_location, weights_only=weights_only)
    sd, meta = extract_state_dict(obj, source)
    to_load, report = match_state_dict(model, sd, meta, source, skip=skip, reset_quantizers=reset_quantizers)
    result = model.load_state_dict(to_load, strict=False)
    reset = {f"{q}.{b}" if q else b for q, _, _ in report.reset_quantizers for b in QUANT_BUFFERS}
    leftover = [k for k in result.missing_keys if k not in report.missing_quantizer_keys
                and k not in report.skipped_keys and k not in report.derived_keys and k not in reset]
    if leftover or result.unexpected_keys:  # cannot happen after the checks of match_state_dict
        raise CheckpointError(f"{source}: load_state_dict left {leftover} missing and "
                              f"{result.unexpected_keys} unexpected")
    verbose(report.summary())
    return report


def match_state_dict(model: nn.Module, sd: dict, meta: dict | None = None, source: str = "checkpoint", *,
                     skip=(), leave=(), reset_quantizers: bool = False) -> tuple[dict, LoadReport]:
    """The tensors of state dict ``sd`` to load into ``model`` (resized where the model resizes
    them) and the :class:`LoadReport`; raises :class:`CheckpointError` naming every key that does
    not fit. ``leave``: keys passed on as the checkpoint has them, unchecked (those timm's loader
    adapts: the first conv, the classifier). ``reset_quantizers``: see :func:`load_checkpoint`.
    A state dict in another library's key layout is first brought to the model's by the model's
    ``checkpoint_filter(sd)`` where it has one (Swin: timm's layout -> the official one)."""
    meta = meta or {}
    filt = getattr(model, "checkpoint_filter", None)
    if filt is not None:
        sd = filt(sd)
    own = model.state_dict()
    qkeys = quantizer_keys(model)
    suffixes = set(getattr(model, "derived_buffers", ()))
    derived = {k for k in set(sd) | set(own) if k.rsplit(".", 1)[-1] in suffixes}
    has_quant = any(_looks_like_quant_key(k) for k in sd)
    fmt = meta.get("format") or ("mesa" if has_quant else "official")
    report = LoadReport(source=source, format=fmt, meta=meta)

    skipped = {k for k in set(sd) | set(own) if any(fnmatch.fnmatch(k, p) for p in skip)}
    report.skipped_keys = sorted(skipped)
    leave = set(leave) - skipped
    resize = getattr(model, "resize_checkpoint_tensor", None)
    to_load, unexpected, mismatched = {}, [], []
    for k, v in sd.items():
        if k in skipped:
            continue
        if k in derived:
            continue  # the model's own geometry decides
        if k in leave:
            to_load[k] = v
            continue
        if k not in own:
            if _looks_like_quant_key(k):
                report.ignored_quantizer_keys.append(k)
            else:
                unexpected.append(k)
            continue
        if v.shape != own[k].shape:
            new = resize(k, v) if resize is not None and k not in qkeys else None
            if new is None or new.shape != own[k].shape:
                mismatched.append(f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(own[k].shape)}")
                continue
            report.resized_keys.append(f"{k} {tuple(v.shape)}->{tuple(new.shape)}")
            v = new
        to_load[k] = v
    if reset_quantizers and mismatched:
        _reset_mismatched_quantizers(sd, own, qkeys, mismatched, to_load, report)
    # a quantizer's draw counter absent beside its iteration (older checkpoints) follows it
    derived |= {k for k in own if k.endswith(".draws") and k in qkeys and k not in to_load
                and k[:-len("draws")] + "iteration" in to_load}
    missing = [k for k in own if k not in sd and k not in skipped and k not in derived
               and k not in leave]
    report.missing_quantizer_keys = sorted(k for k in missing if k in qkeys)
    missing_other = [k for k in missing if k not in qkeys]
    report.derived_keys = sorted(k for k in derived if k in own)

    wrong = _other_model(model, own, sd, meta, qkeys, mismatched, missing_other, unexpected)
    if wrong:
        raise CheckpointError(f"{source} does not fit the model: {wrong}")
    problems = []
    if missing_other:
        problems.append(f"missing from the checkpoint ({len(missing_other)}):{_fmt(missing_other)}")
    if unexpected:
        problems.append(f"not in the model ({len(unexpected)}):{_fmt(unexpected)}")
    if mismatched:
        hint = ""
        if all(k.split(":")[0] in qkeys for k in mismatched):
            hint = ("\n(quantizer group counts differ: load with reset_quantizers=True (tools/train.py does) "
                    "to take the weights and start those quantizers afresh, or build the model with the "
                    "quant_groups / quant_group_size the checkpoint was trained with)")
        problems.append(f"shape mismatch ({len(mismatched)}):{_fmt(mismatched)}{hint}")
    if problems:
        raise CheckpointError(f"{source} does not fit {type(model).__name__}:\n" + "\n".join(problems))
    report.loaded_keys = sorted(to_load)
    return to_load, report


def _reset_mismatched_quantizers(sd, own, qkeys, mismatched, to_load, report) -> None:
    """Take every quantizer with a mis-shaped entry out of ``mismatched`` and ``to_load`` (all of
    its entries: a range kept beside another's iteration count would be wrong) into
    ``report.reset_quantizers``."""
    names = {}
    for m in mismatched:
        k = m.split(":")[0]
        if k in qkeys:
            names.setdefault(k.rsplit(".", 1)[0] if "." in k else "", k)
    for q, k in names.items():
        report.reset_quantizers.append((q, tuple(sd[k].shape), tuple(own[k].shape)))
        for b in QUANT_BUFFERS:
            to_load.pop(f"{q}.{b}" if q else b, None)
    mismatched[:] = [m for m in mismatched if m.split(":")[0] not in qkeys]
    report.reset_quantizers.sort()


def _cfg_names(value) -> list[str]:
    if not value:
        return []
    return [value] if isinstance(value, str) else list(value)


def pretrained_filter_fn(state_dict: dict, model: nn.Module, *, skip=(), verbose=None,
                         source: str | None = None) -> dict:
    """timm's ``pretrained_filter_fn`` (``build_model_with_cfg``): a checkpoint that timm's
    ``load_pretrained`` read (any format :func:`load_checkpoint` reads) -> the complete state dict
    timm then loads into ``model``.

    The checkpoint's tensors are checked and resized as :func:`load_checkpoint` does; the
    pretrained cfg's ``first_conv`` and ``classifier`` are passed on as they are, for timm to adapt:
    ``adapt_input_conv`` for another ``in_chans``, the classifier dropped (left at its
    initialisation) for another ``num_classes`` (0 included). The keys a checkpoint does not hold
    (Mesa quantizer state, derived buffers, ``skip`` patterns) get the model's own values, so that
    timm's strict load passes.
    """
    verbose = verbose or _log.info
    cfg = getattr(model, "pretrained_cfg", None) or {}
    source = source or str(cfg.get("file") or cfg.get("hf_hub_id") or cfg.get("url") or "pretrained weights")
    sd, meta = extract_state_dict(state_dict, source)
    leave = {f"{n}.{p}" for n in _cfg_names(cfg.get("first_conv")) + _cfg_names(cfg.get("classifier"))
             for p in ("weight", "bias")}
    to_load, report = match_state_dict(model, sd, meta, source, skip=skip, leave=leave)
    own = model.state_dict()
    for k in report.missing_quantizer_keys + report.derived_keys + report.skipped_keys:
        if k in own:
            to_load[k] = own[k]
    verbose(report.summary())
    return to_load


def save_checkpoint(model: nn.Module, path, extra: dict | None = None) -> None:
    """Write ``{'model': state_dict (with quantizer state), 'meta': {...}, **extra, 'checksum'}``,
    readable with ``torch.load(weights_only=True)``. ``meta`` records the architecture name and, per Mesa
    layer, whether it was enabled and at how many bits."""
    mesa = {name: {"enable": bool(m.enable), "bits": int(m.bits)}
            for name, m in model.named_modules() if isinstance(m, MESA_LAYERS)}
    meta = {"format": FORMAT_NAME, "version": FORMAT_VERSION,
            "architecture": architecture(model),
            "class": type(model).__name__, "mesa": mesa}
    obj = {"model": model.state_dict(), "meta": meta}
    if extra:
        clash = set(extra) & (set(obj) | {CHECKSUM_KEY})
        if clash:
            raise ValueError(f"save_checkpoint: extra keys {sorted(clash)} are reserved")
        obj.update(extra)
    torch.save(add_checksum(obj), os.fspath(path))

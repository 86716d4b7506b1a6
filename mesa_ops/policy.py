"""Policy files in the original Mesa text format, and model conversion.

A policy file::

    on gelu:                 # layer tag: fc conv gelu bn relu softmax matmul layernorm
        by_index: all        # 'all' or indices (per tag, in module order)
        enable: True
        level: 256           # 2**bits; or `bits: 8`
        ema_decay: 0.9
        by_index: 1 2        # a later block overrides for its indices
        enable: False

Numbers after ``on <tag>:`` are trigger epochs for :func:`deploy_on_epoch`. A malformed file
raises :class:`PolicyError` naming the file, the line and what was expected.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch.nn as nn

from . import layers as L
from .quant import SUPPORTED_BITS, parse_groups

TAGS = ("conv", "fc", "eltwise", "shuffle", "concat", "norm", "gelu", "layernorm", "matmul",
        "softmax", "bn", "relu")  # the original's order of index assignment


class PolicyError(ValueError):
    """A policy file or policy setting that cannot be applied."""


def _bool(v):
    if isinstance(v, bool):
        return v
    s = str(v).strip()
    if s in ("True", "true", "1"):
        return True
    if s in ("False", "false", "0"):
        return False
    raise ValueError(f"expected True or False, got {v!r}")


def _level(v):
    n = int(v)
    if n not in (1 << b for b in SUPPORTED_BITS):
        raise ValueError(f"expected 256, 16 or 4, got {v!r}")
    return n


def _bits(v):
    n = int(v)
    if n not in SUPPORTED_BITS:
        raise ValueError(f"expected one of {SUPPORTED_BITS}, got {v!r}")
    return n


def _decay(v):
    x = float(v)
    if not 0.0 <= x < 1.0:
        raise ValueError(f"expected a decay in [0, 1), got {v!r}")
    return x


def _range_mode(v):
    s = str(v).strip().strip("'\"")
    if s not in ("ema", "batch"):
        raise ValueError(f"expected 'ema' or 'batch', got {v!r}")
    return s


def _pos_int(v):
    return parse_groups(v)


KEYS = {"enable": _bool, "level": _level, "bits": _bits, "ema_decay": _decay,
        "quant_groups": _pos_int, "group_size": _pos_int, "stochastic": _bool,
        "range_mode": _range_mode, "check_finite": _bool}
# keys of the original code that have no effect on its 8-bit path; accepted and ignored
IGNORED_KEYS = ("stable", "correlate", "non_negative_only", "half_range", "global_buffer",
                "progressive", "method", "quant_loss_function")


@dataclass
class Block:
    by_index: object  # 'all' or list[int]
    settings: dict = field(default_factory=dict)
    by_tag: list | None = None
    line: int = 0

    def as_dict(self) -> dict:
        d = {"by_index": self.by_index, **self.settings}
        if self.by_tag is not None:
            d["by_tag"] = self.by_tag
        return d


@dataclass
class Section:
    tag: str
    trigger: list
    blocks: list
    line: int


def parse_policy(filename: str) -> dict[str, Section]:
    """Parse a policy file into sections by tag; raise PolicyError on any malformed line."""
    if not os.path.isfile(filename):
        raise PolicyError(f"policy file not found: {filename}")
    sections: dict[str, Section] = {}
    cur: Section | None = None
    block: Block | None = None

    def fail(lineno, text, what):
        raise PolicyError(f"{filename}:{lineno}: {what} (line: {text.strip()!r})")

    def close_block(lineno):
        if block is not None and not block.settings:
            fail(block.line, f"by_index: {block.by_index}", "a 'by_index' block sets nothing; "
                 f"expected settings such as 'enable:' after it")

    with open(filename, encoding="utf-8") as f:
        lines = f.readlines()
    for lineno, raw in enumerate(lines, 1):
        text = raw.split("#", 1)[0].strip()
        if not text:
            continue
        if ":" not in text:
            fail(lineno, raw, "expected 'on <tag>:' or '<key>: <value>'")
        key, value = (s.strip() for s in text.split(":", 1))
        words = key.split()
        if words and words[0] == "on":
            if len(words) != 2 or words[1] not in TAGS:
                fail(lineno, raw, f"expected 'on <tag>:' with a tag among {', '.join(TAGS)}")
            close_block(lineno)
            try:
                trigger = [int(t) for t in value.replace(",", " ").split()]
            except ValueError:
                fail(lineno, raw, "expected trigger epochs (integers) after 'on <tag>:'")
            if words[1] in sections:
                fail(lineno, raw, f"section 'on {words[1]}:' appears twice")
            cur = Section(words[1], trigger, [], lineno)
            sections[cur.tag] = cur
            block = None
            continue
        if cur is None:
            fail(lineno, raw, "expected a section header 'on <tag>:' first")
        if key == "by_index":
            close_block(lineno)
            if value == "all":
                idx = "all"
            else:
                try:
                    idx = [int(t) for t in value.replace(",", " ").split()]
                except ValueError:
                    idx = []
                if not idx:
                    fail(lineno, raw, "expected 'by_index: all' or a list of layer indices")
            block = Block(idx, line=lineno)
            cur.blocks.append(block)
            continue
        if block is None:
            fail(lineno, raw, f"expected 'by_index:' before '{key}:' in section 'on {cur.tag}:'")
        if key == "by_tag":
            block.by_tag = value.replace(",", " ").split()
        elif key in KEYS:
            try:
                block.settings[key] = KEYS[key](value)
            except ValueError as exc:
                fail(lineno, raw, f"bad value for '{key}': {exc}")
        elif key in IGNORED_KEYS:
            block.settings.setdefault("_ignored", []).append(key)
        else:
            fail(lineno, raw, f"unknown key '{key}'; expected one of by_index, by_tag, "
                 f"{', '.join(KEYS)}")
    close_block(len(lines))
    return sections


def read_policy(filename: str, section: str = "init", debug: bool = False, verbose=print) -> list:
    """The original's list form of one section: ``[{'trigger': [...]}, block, block, ...]``."""
    sec = parse_policy(filename).get(section)
    if sec is None:
        return []
    return [{"trigger": sec.trigger}] + [b.as_dict() for b in sec.blocks]


def _matches(layer, parameters) -> bool:
    by_index = parameters.get("by_index", "all")
    if isinstance(by_index, str) and by_index != "all":
        by_index = [int(i) for i in by_index.replace(",", " ").split()]
    if by_index != "all" and layer.index not in by_index:
        return False
    by_tag = parameters.get("by_tag")
    return by_tag is None or layer.tag in by_tag


def update_quantization_parameter(layer, **parameters) -> dict:
    """Apply one policy block to a Mesa layer (the original's method, validated)."""
    if "index" in parameters:
        idx = parameters["index"]
        if isinstance(idx, dict):
            idx = idx.get(layer.tag, layer.index)
        layer.index = int(idx)
    if "by_index" in parameters and _matches(layer, parameters):
        for key, value in parameters.items():
            if key in ("by_index", "by_tag", "index", "_ignored"):
                continue
            if key not in KEYS:
                raise PolicyError(f"{layer.describe()}: unknown policy key {key!r}")
            try:
                value = KEYS[key](value)
            except ValueError as exc:
                raise PolicyError(f"{layer.describe()}: bad value for {key!r}: {exc}") from exc
            if key == "quant_groups" and value != layer.quant_groups:
                _set_groups(layer, value)
            else:
                setattr(layer, key, value)
            getattr(layer, "verbose", print)(
                f"update {layer.tag}_{key} to {value} for index {layer.index}")
    return {}


def _set_groups(layer, g):
    for q in (getattr(layer, "quant1", None), getattr(layer, "quant2", None)) if hasattr(layer, "quant1") else (layer,):
        q._resize_groups(g)


def mesa_layers(model: nn.Module):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, L.MESA_LAYERS)]


def assign_indices(model: nn.Module) -> dict[str, int]:
    """Number Mesa layers per tag in module order (the original's ``index``); name them."""
    counts = {t: 0 for t in TAGS}
    for name, m in mesa_layers(model):
        m.layer_name = name or type(m).__name__
        if m.tag in counts:
            m.index = counts[m.tag]
            counts[m.tag] += 1
    return counts


def deploy_on_init(model: nn.Module, filename: str, verbose=print, override_verbose: bool = False):
    """Index the Mesa layers of ``model`` and apply every section of the policy ``filename``."""
    if not hasattr(model, "modules"):
        return
    sections = parse_policy(filename)
    layers_ = mesa_layers(model)
    if override_verbose:
        for _, m in layers_:
            m.verbose = verbose
    counts = assign_indices(model)
    for tag, sec in sections.items():
        tagged = [m for _, m in layers_ if m.tag == tag]
        for blk in sec.blocks:
            if blk.by_index != "all":
                missing = [i for i in blk.by_index if i >= counts.get(tag, 0)]
                if missing:
                    verbose(f"mesa policy {filename}:{blk.line}: by_index {missing} matches no "
                            f"'{tag}' layer (the model has {counts.get(tag, 0)})")
            for m in tagged:
                update_quantization_parameter(m, **blk.as_dict())
        on = [m for m in tagged if m.enable]
        bits = sorted({m.bits for m in on})
        verbose(f"mesa policy: {tag}: {len(on)}/{len(tagged)} layers enabled"
                + (f" ({'/'.join(map(str, bits))}-bit)" if on else ""))


def deploy_on_epoch(model: nn.Module, policies: list, epoch: int, optimizer=None, verbose=print):
    """Apply a section read by :func:`read_policy` when ``epoch`` is one of its triggers."""
    if not hasattr(model, "modules") or len(policies) < 1:
        return
    if "trigger" not in policies[0]:
        raise PolicyError("deploy_on_epoch: policies[0] must hold the 'trigger' epochs "
                          "(use ms.policy.read_policy(filename, section))")
    if epoch not in policies[0]["trigger"]:
        return
    for p in policies[1:]:
        for _, m in mesa_layers(model):
            update_quantization_parameter(m, **p)
    verbose(f"mesa policy: applied {len(policies) - 1} block(s) at epoch {epoch}")


def deploy_on_iteration(model, policies, iteration, optimizer=None, verbose=print):
    deploy_on_epoch(model, policies, iteration, optimizer, verbose)


def set_mesa(model: nn.Module, enable: bool = True, bits: int = 8, tags=None, **settings) -> int:
    """Programmatic policy: set ``enable``/``bits`` (and any policy key) on the Mesa layers of
    ``model`` whose tag is in ``tags`` (all when None). Returns how many layers were set."""
    assign_indices(model)
    n = 0
    for _, m in mesa_layers(model):
        if tags is None or m.tag in tags:
            update_quantization_parameter(m, by_index="all", enable=enable, bits=bits, **settings)
            n += 1
    return n


# ---- conversion ------------------------------------------------------------------------------
def _adopt(new: nn.Module, old: nn.Module) -> nn.Module:
    """Give ``new`` the very parameters and buffers of ``old`` (no re-initialisation)."""
    for name, p in old.named_parameters(recurse=False):
        setattr(new, name, p)
    for name, b in old.named_buffers(recurse=False):
        if name in new._buffers:
            new._buffers[name] = b
    ref = next(iter(old.parameters()), None)
    if ref is not None:
        for q in [new] + [m for m in new.modules() if m is not new]:
            if isinstance(q, L.QuantMixin):
                for n in ("clip_val", "shift", "iteration"):
                    q._buffers[n] = q._buffers[n].to(ref.device)
    new.train(old.training)
    return new


def _convert_child(child: nn.Module, groups_for):
    """A Mesa layer for an ``nn`` layer (or None). ``groups_for(channels)`` -> dict of kwargs."""
    meta = dict(device="meta")
    if isinstance(child, nn.Linear):
        new = L.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                       **groups_for(child.in_features), **meta)
    elif isinstance(child, nn.Conv2d):
        new = L.Conv2d(child.in_channels, child.out_channels, child.kernel_size, child.stride,
                       child.padding, child.dilation, child.groups, child.bias is not None,
                       child.padding_mode, **groups_for(child.in_channels), **meta)
    elif isinstance(child, nn.LayerNorm):
        new = L.LayerNorm(child.normalized_shape, child.eps, child.elementwise_affine,
                          bias=child.bias is not None, **groups_for(child.normalized_shape[-1]), **meta)
    elif isinstance(child, nn.BatchNorm2d):
        new = L.BatchNorm2d(child.num_features, child.eps, child.momentum, child.affine,
                            child.track_running_stats, **groups_for(child.num_features), **meta)
    elif isinstance(child, nn.GELU):
        new = L.GELU(approximate=child.approximate, **groups_for(None))
    elif isinstance(child, nn.Softmax):
        kw = groups_for(None)
        new = L.Softmax(dim=child.dim, quant_groups=kw.get("quant_groups", 1))
        if kw.get("group_size"):
            new.group_size = kw["group_size"]
    elif isinstance(child, nn.ReLU):
        new = L.ReLU(inplace=child.inplace, **groups_for(None))
    else:
        return None
    return _adopt(new, child)


def _convert(module: nn.Module, groups_for) -> nn.Module:
    for name, child in module.named_children():
        if isinstance(child, L.MESA_LAYERS):
            continue
        new = _convert_child(child, groups_for)
        if new is None:
            _convert(child, groups_for)
        else:
            setattr(module, name, new)
    return module


def convert_by_num_groups(module: nn.Module, num_groups: int) -> nn.Module:
    """Replace the nn layers Mesa knows (Linear, Conv2d, LayerNorm, BatchNorm2d, GELU, Softmax,
    ReLU) by Mesa layers with ``num_groups`` quantization groups, in place; keeps every
    parameter and buffer; idempotent. Compression stays off until a policy enables it."""
    g = parse_groups(num_groups)
    return _convert(module, lambda channels: {"quant_groups": g})


def convert_by_group_size(module: nn.Module, hidden_group_size: int) -> nn.Module:
    """Like :func:`convert_by_num_groups` with groups of ``hidden_group_size`` channels (GELU,
    Softmax and ReLU derive their group count from the input at the first step)."""
    s = parse_groups(hidden_group_size)

    def groups_for(channels):
        if channels is None:
            return {"group_size": s}
        if channels % s:
            raise PolicyError(f"group size {s} does not divide {channels} channels")
        return {"quant_groups": channels // s}
    return _convert(module, groups_for)

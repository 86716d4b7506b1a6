"""The values of the quantizer settings a policy file or ``update_quantization_parameter`` sets:
each key's parser and check (``KEYS``), the original Mesa keys that have no effect here
(``IGNORED_KEYS``), and the error a bad one raises (:class:`PolicyError`). Applying them to a
layer is :func:`mesa_ops.quant.update_quantization_parameter`; reading policy files is
:mod:`mesa_ops.policy`."""
from __future__ import annotations

from .reference import RANGE_MODES

SUPPORTED_BITS = (8, 4, 2)
NONFINITE_MODES = ("auto", "raise", "skip")


def parse_groups(quant_groups) -> int:
    if isinstance(quant_groups, (tuple, list)):  # the original accepts a 1-tuple
        quant_groups = quant_groups[0]
    if quant_groups is None:
        quant_groups = 1
    g = int(quant_groups)
    if g < 1 or g != quant_groups:
        raise ValueError(f"quant_groups must be a positive integer, got {quant_groups!r}")
    return g


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


def _int(v) -> int:
    if isinstance(v, bool):
        raise ValueError(f"expected an integer, got {v!r}")
    if isinstance(v, float):
        if v != int(v):
            raise ValueError(f"expected an integer, got {v!r}")
        return int(v)
    try:
        return int(str(v).strip())
    except ValueError:
        raise ValueError(f"expected an integer, got {v!r}") from None


def _level(v):
    n = _int(v)
    if n not in [1 << b for b in SUPPORTED_BITS]:
        raise ValueError(f"expected 256, 16 or 4 (8, 4 or 2 bits), got {v!r}")
    return n


def _bits(v):
    n = _int(v)
    if n not in SUPPORTED_BITS:
        raise ValueError(f"expected one of {SUPPORTED_BITS}, got {v!r}")
    return n


def _decay(v):
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"expected a decay in [0, 1), got {v!r}") from None
    if not 0.0 <= x < 1.0:
        raise ValueError(f"expected a decay in [0, 1), got {v!r}")
    return x


def _one_of(choices):
    """The parser of a setting that takes one of the strings ``choices`` (quoted or not)."""
    def parse(v):
        s = str(v).strip().strip("'\"")
        if s not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}, got {v!r}")
        return s
    return parse


_range_mode = _one_of(RANGE_MODES)


def _pos_int(v):
    n = _int(v)
    if n < 1:
        raise ValueError(f"expected a positive integer, got {v!r}")
    return parse_groups(n)


def _nonneg_int(v):
    n = _int(v)
    if n < 0:
        raise ValueError(f"expected a non-negative integer, got {v!r}")
    return n


_nonfinite = _one_of(NONFINITE_MODES)


KEYS = {"enable": _bool, "level": _level, "bits": _bits, "ema_decay": _decay,
        "quant_groups": _pos_int, "group_size": _pos_int, "stochastic": _bool,
        "range_mode": _range_mode, "check_finite": _bool, "nonfinite": _nonfinite,
        "dist_sync": _bool, "prefix_tokens": _nonneg_int}
# keys of the original code (and of its demo projects' policies) with no effect here: the forward
# is always the exact op (``fp_forward``), ranges are always running min/max estimates
IGNORED_KEYS = ("stable", "correlate", "non_negative_only", "half_range", "global_buffer",
                "progressive", "method", "quant_loss_function", "fp_forward", "level_num")
_META_KEYS = ("by_index", "by_tag", "index", "_ignored")


def _index_list(by_index):
    """``by_index`` as 'all' or a list of ints (from a file, the original's strings, or code)."""
    if isinstance(by_index, str):
        if by_index.strip() == "all":
            return "all"
        by_index = by_index.replace(",", " ").split()
    elif isinstance(by_index, int):
        by_index = [by_index]
    try:
        return [_int(i) for i in by_index]
    except (TypeError, ValueError):
        raise PolicyError(f"by_index: expected 'all' or layer indices, got {by_index!r}") from None


def _tag_list(by_tag):
    if by_tag is None:
        return None
    if isinstance(by_tag, str):
        return by_tag.replace(",", " ").split()
    return [str(t) for t in by_tag]

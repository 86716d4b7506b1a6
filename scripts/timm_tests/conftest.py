"""Runs timm's own ``tests/test_models.py`` on the ``mesa_*`` models (see ``run.sh``).

The only adaptation is the model lists. Before the test module is imported, ``timm.list_models``
and ``timm.list_pretrained`` (which the test file imports by name) are replaced by versions that
return only the ``mesa_*`` models; timm's filters (``filter`` / ``exclude_filters``:
``NON_STD_FILTERS``, ``EXCLUDE_FX_JIT_FILTERS``, ...) are matched against the name without the
``mesa_`` prefix, so each model is treated as timm treats its counterpart (``mesa_deit_*`` as
``deit*``: a non-standard token model; the distilled DeiTs are left out of FX + TorchScript).
``module=`` (``FEAT_INTER_FILTERS``: the modules whose models have ``forward_intermediates``)
selects every ``mesa_*`` model: all of them have it. Tests of timm's own models that take no
model list (the NaFlexViT / Gemma tests) are deselected; ``run.sh`` points the FX-features
TorchScript test (``['regnetx_002']`` upstream) at Mesa models.
"""
from __future__ import annotations

import fnmatch

import pytest
import timm
import timm.models

import models  # noqa: F401  (registers the mesa_* models with timm)

PREFIX = models.TIMM_PREFIX
_list_models = timm.list_models
_list_pretrained = timm.list_pretrained


def _matches(name: str, patterns) -> bool:
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    return any(fnmatch.fnmatch(name, p) for p in patterns)


def mesa_list_models(filter="", module="", pretrained=False, exclude_filters="", name_matches_cfg=False,
                     include_tags=None):
    names = _list_models(PREFIX + "*", pretrained=pretrained, name_matches_cfg=name_matches_cfg,
                         include_tags=include_tags)
    base = {n: n[len(PREFIX):] for n in names}
    if filter:
        names = [n for n in names if _matches(base[n], filter)]
    if exclude_filters:
        names = [n for n in names if not _matches(base[n], exclude_filters)]
    return names


def mesa_list_pretrained(filter="", exclude_filters=""):
    return mesa_list_models(filter, pretrained=True, exclude_filters=exclude_filters, include_tags=True)


timm.list_models = timm.models.list_models = mesa_list_models
timm.list_pretrained = timm.models.list_pretrained = mesa_list_pretrained

_MARKERS = ("base", "cfg", "torchscript", "features", "fxforward", "fxbackward", "timeout(seconds)")


def pytest_configure(config):
    for m in _MARKERS:
        config.addinivalue_line("markers", f"{m}: timm's test marker")


def pytest_collection_modifyitems(config, items):
    """Keep the tests that run over a model list (all of them, now only mesa_* models)."""
    keep, drop = [], []
    for item in items:
        spec = getattr(item, "callspec", None)
        listed = spec is not None and "model_name" in spec.params
        empty = item.get_closest_marker("parametrize") is not None and spec is None
        (keep if listed or empty or item.originalname == "test_model_inference" else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep

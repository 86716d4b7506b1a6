"""Saved activations and step time of one segmentation train iteration, Mesa on vs off.

:func:`train_step_stats` builds the segmentor of a ``configs/seg/`` config (the Mesa variant: its
backbone carries the policy), runs ``steps`` train iterations (whole segmentor loss: backbone,
neck, heads, auxiliary head; backward; AdamW step) on random images of ``crop`` x ``crop`` with
random ADE20K labels, and reports what autograd holds for backward during the forward
(:class:`mesa_ops.SavedActivationMeter` over the whole segmentor: parameters excluded, the input
image included) and the median step time. ``mesa=False`` switches the same model's Mesa layers off
(``ms.policy.set_mesa(model, enable=False)``), i.e. the exact config's training.

The paper (Pan et al., arXiv 2111.11124) applies Mesa to the Transformer backbone; the heads
(convolutions, BN, ReLU of FPN / UperNet) stay exact here as there, so the whole-step ratio is
above the backbone's ~0.25-0.3x.
"""
from __future__ import annotations

import statistics
import time

import torch
from mmengine.config import Config
from mmengine.model import revert_sync_batchnorm
from mmengine.registry import init_default_scope
from mmengine.structures import PixelData

import mesa_ops as ms

__all__ = ["build_segmentor", "random_batch", "train_step_stats"]


def build_segmentor(config: str, crop: int, cfg_options: dict | None = None):
    """The config's segmentor (SyncBN reverted to BN, no pretrained weights), in train mode."""
    from mmseg.registry import MODELS

    init_default_scope("mmseg")
    cfg = Config.fromfile(config)
    if cfg_options:
        cfg.merge_from_dict(cfg_options)
    cfg.model.backbone.init_cfg = None
    if cfg.model.backbone.type == "MesaPVT":
        cfg.model.backbone.img_size = crop
    cfg.model.data_preprocessor.size = (crop, crop)
    model = revert_sync_batchnorm(MODELS.build(cfg.model))
    return model.train()


def random_batch(batch: int, crop: int, num_classes: int = 150, seed: int = 0):
    """(images (B, 3, crop, crop) normalised-like, list of SegDataSample with random labels)."""
    from mmseg.structures import SegDataSample

    g = torch.Generator().manual_seed(seed)
    images = torch.randn(batch, 3, crop, crop, generator=g)
    samples = []
    for _ in range(batch):
        s = SegDataSample()
        s.gt_sem_seg = PixelData(data=torch.randint(0, num_classes, (1, crop, crop), generator=g))
        s.set_metainfo(dict(img_shape=(crop, crop), pad_shape=(crop, crop), ori_shape=(crop, crop)))
        samples.append(s)
    return images, samples


def train_step_stats(config: str, crop: int = 512, batch: int = 2, mesa: bool = True, steps: int = 1,
                     model=None, cfg_options: dict | None = None) -> dict:
    """``steps`` + 1 train iterations of ``config``'s segmentor: the first one metered (and not
    timed: it is also the warm-up), then ``steps`` timed ones. Returns ``saved_bytes`` (of the
    metered step), ``backbone_saved_bytes`` (the part saved by the time the backbone returns: its
    activations and the input image), ``step_s`` (median of the timed steps; None when
    ``steps=0``), ``loss`` (first step), ``mesa_layers_on``.

    ``model``: an already built segmentor to reuse (its Mesa layers are switched per ``mesa`` only
    when off is asked: pass a fresh Mesa model for ``mesa=True``)."""
    if steps < 0:
        raise ValueError(f"steps={steps}: expected >= 0")
    if model is None:
        model = build_segmentor(config, crop, cfg_options)
    if not mesa:
        ms.policy.set_mesa(model, enable=False)
    on = sum(bool(m.enable) for m in model.modules() if isinstance(m, ms.layers.MESA_LAYERS))
    if mesa and on == 0:
        raise ValueError(f"{config}: mesa=True but the model has no Mesa layer enabled (use a -mesa8 config)")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    images, samples = random_batch(batch, crop)

    def step(meter=None):
        opt.zero_grad(set_to_none=True)
        losses = model.loss(images, samples)
        loss = sum(v for k, v in losses.items() if "loss" in k)
        if meter is not None:
            saved.append(meter.total_bytes)
        loss.backward()
        opt.step()
        return loss.item()

    # step 0: metered (hooks), also the warm-up (first-call allocations, kernel loading), not timed
    saved, backbone_saved = [], []
    with ms.SavedActivationMeter(model) as meter:
        # the backbone runs first (extract_feat): the total when it returns is its share
        hook = model.backbone.register_forward_hook(
            lambda mod, args, out: backbone_saved.append(meter.total_bytes))
        try:
            first_loss = step(meter)
        finally:
            hook.remove()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return dict(config=config, crop=crop, batch=batch, mesa=mesa, saved_bytes=saved[0],
                backbone_saved_bytes=backbone_saved[0],
                step_s=statistics.median(times) if times else None, loss=first_loss, mesa_layers_on=on,
                model=model)

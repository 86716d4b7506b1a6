# Semantic FPN + PVT-Tiny on ADE20K,
# with Mesa, 8-bit activations (configs/mesa/pvt_8bit.txt).
# PVT segmentation recipe: 512x512 crops, 8 GPUs x 4 images, AdamW lr 2e-4, wd 1e-4, poly 0.9, 40k iters.
_base_ = [
    './_base_/models/fpn_pvt.py', './_base_/datasets/ade20k.py', './_base_/default_runtime.py',
    './_base_/schedules/schedule_40k_adamw.py'
]
model = dict(
    backbone=dict(
        arch='tiny',
        ms_policy='configs/mesa/pvt_8bit.txt',
        init_cfg=dict(type='Pretrained', checkpoint='pretrained/pvt_tiny.pth')))
train_dataloader = dict(batch_size=4)

# UperNet + Swin-B (window 7, ImageNet-1K 224 px weights) on ADE20K,
# exact training (no Mesa).
# Swin segmentation recipe: 512x512 crops, 8 GPUs x 2 images, AdamW lr 6e-5, wd 0.01 (none on position
# tables and norms), 1500-iteration linear warm-up, poly 1.0, 160k iters, auxiliary FCN head weight 0.4.
_base_ = [
    './_base_/models/upernet_swin.py', './_base_/datasets/ade20k.py', './_base_/default_runtime.py',
    './_base_/schedules/schedule_160k_adamw_warmup.py'
]
model = dict(
    backbone=dict(
        arch='base',
        ms_policy=None,
        init_cfg=dict(type='Pretrained', checkpoint='pretrained/swin_base_patch4_window7_224.pth')),
    decode_head=dict(in_channels=[128, 256, 512, 1024]),
    auxiliary_head=dict(in_channels=512))
train_dataloader = dict(batch_size=2)

# mmseg's own UperNet + Swin-T config (mmseg 1.2.2, configs/swin/...), with the backbone's type
# swapped for this repo's Mesa Swin and Mesa 8-bit on: nothing else changes (mmseg's
# SwinTransformer arguments, its OpenMMLab checkpoint, heads, schedule, data).
_base_ = 'mmseg::swin/swin-tiny-patch4-window7-in1k-pre_upernet_8xb2-160k_ade20k-512x512.py'
custom_imports = dict(imports=['models.seg'], allow_failed_imports=False)
model = dict(backbone=dict(type='MesaSwinTransformer', ms_policy='mesa8'))

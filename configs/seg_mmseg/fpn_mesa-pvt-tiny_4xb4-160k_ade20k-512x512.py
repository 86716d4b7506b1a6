# Semantic FPN + PVT-Tiny on ADE20K written as mmseg's sem_fpn configs are (mmseg 1.2.2,
# configs/sem_fpn/fpn_r50_4xb4-160k_ade20k-512x512.py with another backbone, as its Twins /
# PoolFormer FPN configs do), the backbone in mmdet's PVT v1 arguments. For exact training drop
# ms_policy (or set it to None); mmdet's type would be 'PyramidVisionTransformer'.
_base_ = 'mmseg::sem_fpn/fpn_r50_4xb4-160k_ade20k-512x512.py'
custom_imports = dict(imports=['models.seg'], allow_failed_imports=False)
model = dict(
    pretrained=None,
    backbone=dict(
        _delete_=True,
        type='MesaPVT',
        num_layers=[2, 2, 2, 2],
        ms_policy='mesa8',
        init_cfg=dict(type='Pretrained',
                      checkpoint='https://github.com/whai362/PVT/releases/download/v2/pvt_tiny.pth')),
    neck=dict(in_channels=[64, 128, 320, 512]))

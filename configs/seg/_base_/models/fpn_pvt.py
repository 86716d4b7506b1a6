# Semantic FPN (Kirillov et al., 2019) on PVT (the PVT segmentation code's fpn_r50 with a PVT
# backbone): FPN neck (256 channels, 4 levels), FPNHead (128 channels), 150 ADE20K classes.
# SyncBN: reverted to BN by mmengine in single-process runs, replaced by BN by
# models.seg.build_config in CPU distributed runs.
norm_cfg = dict(type='SyncBN', requires_grad=True)
data_preprocessor = dict(
    type='SegDataPreProcessor',
    mean=[123.675, 116.28, 103.53],
    std=[58.395, 57.12, 57.375],
    bgr_to_rgb=True,
    pad_val=0,
    seg_pad_val=255,
    size=(512, 512))
model = dict(
    type='EncoderDecoder',
    data_preprocessor=data_preprocessor,
    backbone=dict(
        type='MesaPVT',
        arch='tiny',
        img_size=512,
        drop_path_rate=0.1,
        ms_policy=None,
        out_indices=(0, 1, 2, 3)),
    neck=dict(type='FPN', in_channels=[64, 128, 320, 512], out_channels=256, num_outs=4),
    decode_head=dict(
        type='FPNHead',
        in_channels=[256, 256, 256, 256],
        in_index=[0, 1, 2, 3],
        feature_strides=[4, 8, 16, 32],
        channels=128,
        dropout_ratio=0.1,
        num_classes=150,
        norm_cfg=norm_cfg,
        align_corners=False,
        loss_decode=dict(type='CrossEntropyLoss', use_sigmoid=False, loss_weight=1.0)),
    train_cfg=dict(),
    test_cfg=dict(mode='whole'))

# The PVT Semantic FPN schedule (whai362/PVT, segmentation/): AdamW lr 2e-4 (1e-4 x 2 for 8 GPUs
# instead of 4), weight decay 1e-4, poly decay power 0.9 to 0, 40k iterations (80k / 2).
optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=0.0002, weight_decay=0.0001),
    clip_grad=None)
param_scheduler = [
    dict(type='PolyLR', eta_min=0.0, power=0.9, begin=0, end=40000, by_epoch=False),
]
train_cfg = dict(type='IterBasedTrainLoop', max_iters=40000, val_interval=4000)
val_cfg = dict(type='ValLoop')
test_cfg = dict(type='TestLoop')
default_hooks = dict(
    timer=dict(type='IterTimerHook'),
    logger=dict(type='LoggerHook', interval=50, log_metric_by_epoch=False),
    param_scheduler=dict(type='ParamSchedulerHook'),
    checkpoint=dict(type='CheckpointHook', by_epoch=False, interval=4000),
    sampler_seed=dict(type='DistSamplerSeedHook'),
    visualization=dict(type='SegVisualizationHook'))

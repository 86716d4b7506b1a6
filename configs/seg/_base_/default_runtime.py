# Runtime of mmsegmentation 1.x, plus the import that registers this repo's backbones
# (models.seg: MesaPVT, MesaSwinTransformer; it also stubs mmcv._ext under mmcv-lite).
custom_imports = dict(imports=['models.seg'], allow_failed_imports=False)
default_scope = 'mmseg'
env_cfg = dict(
    cudnn_benchmark=True,
    mp_cfg=dict(mp_start_method='fork', opencv_num_threads=0),
    dist_cfg=dict(backend='nccl'),
)
vis_backends = [dict(type='LocalVisBackend')]
visualizer = dict(type='SegLocalVisualizer', vis_backends=vis_backends, name='visualizer')
log_processor = dict(by_epoch=False)
log_level = 'INFO'
load_from = None
resume = False

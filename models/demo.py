"""The demo model of ``scripts/demo.sh``: a small DeiT (2 blocks, width 64, 2 heads, patch 8) at
32 px with 10 classes, for DIGITS (scikit-learn's 8x8 digits, upscaled).

    model = models.create_model(DEMO_MODEL, **DEMO_KWARGS, img_size=DEMO_INPUT_SIZE, num_classes=10)

``tools/grad_fidelity.py --model demo`` and ``scripts/accuracy.sh`` build it from these constants
(``scripts/demo.sh`` spells the same arguments on its ``tools/train.py`` command line).
"""
from __future__ import annotations

__all__ = ["DEMO_NAME", "DEMO_MODEL", "DEMO_KWARGS", "DEMO_INPUT_SIZE", "DEMO_NUM_CLASSES"]

DEMO_NAME = "demo"
DEMO_MODEL = "deit_tiny_patch16_224"
DEMO_KWARGS = {"patch_size": 8, "depth": 2, "embed_dim": 64, "num_heads": 2}
DEMO_INPUT_SIZE = 32
DEMO_NUM_CLASSES = 10

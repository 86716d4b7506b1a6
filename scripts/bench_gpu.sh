#!/usr/bin/env bash
# The paper's memory column on one GPU: the bench stage of scripts/cuda_check.sh (batch 128,
# 224 px, fp16 AMP, AdamW, max_memory_allocated; DeiT-Ti/S, Swin-T, PVT-Ti; exact and Mesa with
# fused and explicit attention). Arguments go to cuda_check.sh (e.g. --quick).
exec bash "$(dirname "${BASH_SOURCE[0]}")/cuda_check.sh" --only bench "$@"

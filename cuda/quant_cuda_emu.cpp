// quant_cuda.cu compiled for the host (MESA_CUDA_EMULATION, cuda_emulation.h): the CUDA kernels
// run on CPU tensors, one block at a time, so tests/test_cuda_emulation.py checks them bit for
// bit against the CPU kernels on a machine without a GPU. Built only by that test (backend kind
// 'emu'), never used to train.
#include "quant_cuda.cu"

"""One autograd.Function per op: the forward is the plain op, bit for bit; only packed copies of
what backward needs are saved (``save_for_backward``), and backward dequantizes them.

Each ``*_fn`` takes the input(s), the parameters, the layer (its quantizer state) and returns the
output; the layers in :mod:`mesa_ops.layers` call them in training mode when compression is on.
"""
from .activation import dropout_fn, gelu_fn, relu_fn, softmax_fn
from .conv import conv2d_fn
from .cosine import normalize_fn, scale_fn
from .linear import linear_fn
from .matmul import matmul_fn
from .norm import batch_norm_fn, layer_norm_fn

__all__ = ["linear_fn", "conv2d_fn", "layer_norm_fn", "batch_norm_fn", "gelu_fn", "relu_fn",
           "softmax_fn", "matmul_fn", "normalize_fn", "scale_fn", "dropout_fn"]

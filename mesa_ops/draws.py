"""A quantizer's stochastic-rounding stream: the salt its seeds are drawn with and the draw
counter that advances them (issue 48's item 3, a GPU-resident counter for CUDA graphs, changes
this part alone).

The seed of a quantization is ``splitmix64(prefix ^ n)`` (:func:`mesa_ops.ops.make_seed`):
``prefix`` hashes torch's generator state with the quantizer's salt (the CRC-32 of
:meth:`DrawStream.salt_name`), ``n`` is the (1,) int64 ``draws`` buffer, advanced by one per
range update and re-read from ``iteration`` when someone else changed that buffer."""
from __future__ import annotations

import torch

from . import ops
from .packed import compiling


class DrawStream:
    """The salt and the draw counter of :class:`~mesa_ops.quant.QuantMixin` (a base class of it:
    the methods read the module's ``layer_name``, ``tag``, ``index``, ``describe`` and its
    ``iteration`` / ``draws`` buffers)."""

    def salt_name(self) -> str:
        """The string this quantizer's rounding seeds are salted with: :meth:`describe` (the
        layer's name, tag and index: the same in every process that builds the same model), and
        for a quantizer without a name (a layer made with ``enable=True`` and no policy, not
        numbered by :func:`mesa_ops.policy.assign_indices`) also its construction number in
        this process, so that no two layers draw one noise stream. A copy (``copy.deepcopy``)
        keeps the stream of its original."""
        return self._salt_entry()[1]

    def _salt(self) -> int:
        """The CRC-32 salt of this quantizer's seeds (of :meth:`salt_name`; cached per name)."""
        return self._salt_entry()[2]

    def _salt_entry(self):
        key = (self.layer_name, self.tag, self.index)
        cached = self.__dict__.get("_salt_cache")
        if cached is not None and cached[0] == key:
            return cached
        name = self.describe()
        if not self.layer_name:
            name = f"{name} #{self.__dict__.get('_instance', -1)}"
        if compiling():  # no side effects while dynamo traces (the name is all it needs)
            return key, name, None
        cached = self.__dict__["_salt_cache"] = (key, name, ops.salt_of(name))
        return cached

    # ---- the draw counter: a CPU buffer, or follows the iteration buffer ----------------
    @property
    def _draws(self) -> torch.Tensor:
        """The ``draws`` buffer, on the CPU (moved back once if something moved it, e.g.
        FSDP2's ``fully_shard``, which moves buffers by ``.data``)."""
        d = self._buffers["draws"]
        if d.device.type != "cpu":
            d = self._buffers["draws"] = d.cpu()
        return d

    def _seen_iteration(self, it: torch.Tensor) -> None:
        """Record ``iteration`` and ``draws`` as this quantizer last left them (tensors and
        versions; not pickled: :meth:`__getstate__`)."""
        d = self._draws
        self.__dict__["_it_seen"] = (it, it._version, d, d._version)

    def _draws_for(self, it: torch.Tensor) -> torch.Tensor:
        """The (1,) int64 CPU draw counter. When ``iteration`` was changed by anyone but this
        quantizer since it last used it (a user's copy_, a buffer replaced) and ``draws`` was
        not (an in-place load, e.g. torch.distributed.checkpoint's, writes both), the counter is
        first re-read from ``iteration``: so the rounding stream resumes however the state is
        restored. One host read then; none otherwise."""
        seen = self.__dict__.get("_it_seen")
        d = self._buffers["draws"]
        if seen is not None and seen[0] is it and seen[1] == it._version:
            # (the usual case: nothing changed; FSDP2's fully_shard moves the counter by .data,
            # keeping the tensor and its version: _draws moves it back)
            return d if seen[2] is d and d.device.type == "cpu" else self._draws
        d = self._draws
        if seen is None or (seen[2] is d and seen[3] == d._version):
            d[0] = int(float(it.reshape(-1)[0]))
        return d

    def _apply(self, fn, recurse=True):
        # .to() / .cuda() / .half() copy the buffers: the counter stays on the CPU (an int64
        # tensor: casts leave it), valid for the copies
        out = super()._apply(fn, recurse)
        if "iteration" in self._buffers:
            self._seen_iteration(self._buffers["iteration"])
        return out

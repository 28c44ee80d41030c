"""The compression stage of a store: :class:`CodecStore` encodes every shard on ``dump`` and
decodes it on ``load`` around an inner store (a tier or a pipeline) that holds the encoded
blocks (``compression.*`` options; the codecs are :mod:`ucm.compress`).

Callers see the raw geometry (``L`` shards of ``shape.raw_bytes``); the inner store has ``L``
shards of ``encoded_bytes``, so a layer-by-layer load or dump still moves one encoded shard.
Shard ``k`` is layer ``k`` (the learned codec's projection is per layer).

Identity: the inner store's namespace is the caller's mixed with the codec's digest, and tiers
with a block header record the codec's code, so blocks of another codec, other parameters or
another projection version are a clean miss, never decoded wrongly; so is a raw block for a
compressing store and the reverse.

Encoding refuses shards with NaN, infinite or too large values (``ucm.codecs.MAGNITUDE_LIMIT``): the block's dump fails (``refused``
counted) and nothing is stored. Buffers on a CUDA device are encoded there (Triton), so what
crosses to the host tiers is the encoded bytes.
"""
from __future__ import annotations

import hashlib
import time
from typing import Optional

import numpy as np

from ucm import compress, threads
from ucm.buffers import BufferPool
from ucm.compress import CodecSpec, KVShape
from ucm.store.base import BlockBuffers, BlockGeometry, KVStore, Stats, Task

CODEC_FIELDS = ("raw_bytes", "stored_bytes", "refused", "encode_seconds", "decoded_bytes",
                "decode_seconds")


def inner_namespace(namespace: bytes, spec: CodecSpec) -> bytes:
    """The namespace of the encoded blocks: the caller's mixed with the codec's identity."""
    return hashlib.blake2b(bytes(namespace) + spec.digest(), digest_size=16,
                           person=b"ucm-codec-ns").digest()


def inner_geometry(geometry: BlockGeometry, spec: CodecSpec, shape: KVShape) -> BlockGeometry:
    if geometry.shard_bytes != shape.raw_bytes:
        raise ValueError(f"compression: the store's shard is {geometry.shard_bytes} bytes, one "
                         f"layer of the KV shape {shape} is {shape.raw_bytes}; a compressing "
                         f"store needs one shard per layer")
    enc = compress.encoded_bytes(spec, shape)
    return BlockGeometry(geometry.n_shards * enc, enc)


def _matrix(bufs: BlockBuffers, n: int, nbytes: int):
    """The rows as one uint8 tensor ``[n, nbytes]`` (a view when the caller passed one 2-D
    buffer, else a copy)."""
    import torch

    keep = bufs.keep
    if isinstance(keep, np.ndarray) and keep.ndim == 2 and keep.shape[0] == n \
            and keep.shape[1] * keep.itemsize == nbytes and keep.flags.c_contiguous:
        return torch.from_numpy(keep.view(np.uint8)) if keep.flags.writeable else None
    if isinstance(keep, torch.Tensor) and keep.dim() == 2 and keep.shape[0] == n and \
            keep.is_contiguous() and keep.shape[1] * keep.element_size() == nbytes:
        return keep.view(torch.uint8)
    return None


def _stack(bufs: BlockBuffers, nbytes: int):
    import torch

    if bufs.is_cuda:
        return torch.stack([r.reshape(-1).view(torch.uint8) for r in bufs.rows])
    return torch.from_numpy(np.stack([np.asarray(r).reshape(-1).view(np.uint8) for r in bufs.rows]))



def _host_bytes(n: int):
    import torch

    return torch.empty(n, dtype=torch.uint8)

class CodecStore(KVStore):
    """``inner`` holds the encoded blocks; see the module doc."""

    name = "codec"

    def __init__(self, inner: KVStore, geometry: BlockGeometry, spec: CodecSpec, shape: KVShape,
                 namespace: bytes = bytes(16), io_threads: int = 4, wait_timeout_s: float = 30.0):
        super().__init__(geometry, wait_timeout_s, namespace)
        spec = spec.for_shape(shape)
        spec.check(shape)
        want = inner_geometry(geometry, spec, shape)
        if inner.geometry != want:
            raise ValueError(f"compression: the inner store's geometry {inner.geometry} is not the "
                             f"encoded one {want}")
        self.inner, self.spec, self.shape = inner, spec, shape
        self.raw = shape.raw_bytes
        self.enc = want.shard_bytes
        self._codec_stats = Stats(CODEC_FIELDS)
        self._exec = threads.pool(io_threads, "ucm-codec")
        # host buffers for encoded blocks being loaded, reused: fresh pages cost more than
        # the decode (a warm prompt's 45 MB of INT8 faulted in each time)
        self._staging = BufferPool(_host_bytes, keep=4)

    def _take_staging(self, n: int, width: int, device):
        import torch

        if str(device) != "cpu":
            return torch.empty((n, width), dtype=torch.uint8, device=device)
        return self._staging.take(n * width)[:n * width].view(n, width)

    def _give_staging(self, enc) -> None:
        if enc.device.type == "cpu":
            self._staging.give((enc._base if enc._base is not None else enc).reshape(-1))

    # -- encode / decode ------------------------------------------------------------------------
    def _encode(self, src, shards: range):
        """Encoded rows ``[n, len(shards) * enc]`` on the source's device, and ``ok [n]``."""
        import torch

        n = src.shape[0]
        out = torch.empty((n, len(shards) * self.enc), dtype=torch.uint8, device=src.device)
        ok = np.ones(n, dtype=bool)
        for j, layer in enumerate(shards):
            ok &= compress.encode(self.spec, self.shape, src[:, j * self.raw:(j + 1) * self.raw],
                                  out[:, j * self.enc:(j + 1) * self.enc], layer)
        return out, ok

    def _decode(self, enc, dst, shards: range) -> None:
        for j, layer in enumerate(shards):
            compress.decode(self.spec, self.shape, enc[:, j * self.enc:(j + 1) * self.enc],
                            dst[:, j * self.raw:(j + 1) * self.raw], layer)

    # -- the API --------------------------------------------------------------------------------
    def _dump(self, ids, offset, bufs: BlockBuffers, shards) -> Task:
        task = Task("dump", ids)
        task.add_part()
        self._exec.submit(self._dump_job, task, ids, bufs, shards)
        return task.seal()

    def _dump_job(self, task: Task, ids, bufs: BlockBuffers, shards) -> None:
        t0 = time.perf_counter()
        n, span = len(ids), len(shards) * self.raw
        try:
            src = _matrix(bufs, n, span)
            src = _stack(bufs, span) if src is None else src
            enc, ok = self._encode(src, shards)
        except Exception as exc:  # a source that cannot be read: every block fails
            task.finish_part((), {i: f"codec: {exc!r}" for i in range(n)})
            return
        refused = {int(i): "codec: NaN, infinite or too large values (not stored)" for i in np.flatnonzero(~ok)}
        self._codec_stats.add(refused=len(refused), encode_seconds=time.perf_counter() - t0,
                              raw_bytes=int(ok.sum()) * span,
                              stored_bytes=int(ok.sum()) * len(shards) * self.enc)
        keep = np.flatnonzero(ok)
        if not len(keep):
            task.finish_part((), refused)
            return
        inner = self.inner.dump(ids[keep], shards[0] * self.enc, enc[keep] if len(keep) < n else enc)

        def landed(t, keep=keep):
            r = t.wait(0)
            task.finish_part(keep[r.ok], {**refused, **{int(keep[i]): e for i, e in r.errors.items()}},
                             int(r.ok.sum()) * span)
        inner.on_done(landed)

    def _load(self, ids, offset, bufs: BlockBuffers, shards) -> Task:
        import torch

        task = Task("load", ids)
        n = len(ids)
        device = bufs.rows[0].device if bufs.is_cuda else "cpu"
        enc = self._take_staging(n, len(shards) * self.enc, device)
        task.add_part()
        t0 = time.perf_counter()
        inner = self.inner.load(ids, shards[0] * self.enc, enc)
        inner.on_done(lambda t: self._exec.submit(self._decode_job, task, t, enc, bufs, shards, t0))
        return task.seal()

    def _decode_job(self, task: Task, inner: Task, enc, bufs: BlockBuffers, shards, t0) -> None:
        import torch

        r = inner.wait(0)
        good = np.flatnonzero(r.ok)
        span = len(shards) * self.raw
        errors = dict(r.errors)
        try:
            if len(good):
                n = len(bufs.rows)
                dst = _matrix(bufs, n, span)
                if dst is not None and len(good) == n:
                    self._decode(enc, dst, shards)
                else:
                    out = torch.empty((len(good), span), dtype=torch.uint8, device=enc.device)
                    self._decode(enc[torch.as_tensor(good, device=enc.device)], out, shards)
                    for j, i in enumerate(good):
                        row = bufs.rows[i]
                        if isinstance(row, np.ndarray):
                            row.reshape(-1).view(np.uint8)[:] = out[j].cpu().numpy()
                        else:
                            row.reshape(-1).view(torch.uint8).copy_(out[j])
        except Exception as exc:
            errors.update({int(i): f"codec: {exc!r}" for i in good})
            good = good[:0]
        finally:
            self._give_staging(enc)
        self._codec_stats.add(decode_seconds=time.perf_counter() - t0, decoded_bytes=len(good) * span)
        task.finish_part(good, errors, len(good) * span)

    # -- encoded rows, for a caller that decodes into its own memory (the vLLM worker decodes
    #    straight into the paged cache: the decoded KV is written once) ------------------------
    @property
    def encoded_row_bytes(self) -> int:
        """Bytes of one whole encoded block (every shard)."""
        return self.inner.geometry.block_bytes

    def load_encoded(self, block_ids, dst) -> Task:
        """Load whole encoded blocks into the rows of ``dst`` (uint8 ``[n, encoded_row_bytes]``);
        decode them with :meth:`decode_scatter`."""
        return self.inner.load(block_ids, 0, dst)

    def borrow_encoded(self, block_ids):
        """The inner store's :meth:`~ucm.store.base.KVStore.borrow`: its rows hold encoded
        blocks."""
        return self.inner.borrow(block_ids)

    def decode_scatter(self, layout, src, block_indices, layers=None) -> None:
        """Decode encoded rows ``src`` (whole blocks, or the shards of ``layers``) straight into
        blocks ``block_indices`` of the paged cache ``layout`` (:func:`ucm.compress.decode_scatter`;
        shard ``k`` is layer ``k``); counted as decoded bytes."""
        t0 = time.perf_counter()
        compress.decode_scatter(layout, src, block_indices, self.spec, self.shape, layers)
        n = int((block_indices >= 0).sum()) * len(layout.select(layers))
        self._codec_stats.add(decode_seconds=time.perf_counter() - t0, decoded_bytes=n * self.raw)

    def layer_decoder(self, layout, src, block_indices):
        """:meth:`decode_scatter` of every layer, one layer per call ``f(k)``, prepared once
        (:func:`ucm.compress.layer_decoder`); counted as decoded bytes layer by layer."""
        run = compress.layer_decoder(layout, src, block_indices, self.spec, self.shape)
        n = int((block_indices >= 0).sum())

        def layer(k: int) -> None:
            t0 = time.perf_counter()
            run(k)
            self._codec_stats.add(decode_seconds=time.perf_counter() - t0,
                                  decoded_bytes=n * self.raw)
        return layer

    def lookup(self, block_ids) -> list[bool]:
        return self.inner.lookup(block_ids)

    def lookup_prefix(self, block_ids) -> int:
        return self.inner.lookup_prefix(block_ids)

    def commit(self, block_ids, success_flags) -> None:
        self.inner.commit(block_ids, success_flags)

    def prefetch(self, block_ids) -> None:
        self.inner.prefetch(block_ids)

    def borrow(self, block_ids):
        return None  # what the inner store holds in memory is encoded

    def generation(self) -> int:
        return self.inner.generation()

    def set_generation(self, value: int) -> int:
        return self.inner.set_generation(value)

    def prepare(self) -> None:
        self.inner.prepare()

    def flush(self) -> None:
        if hasattr(self.inner, "flush"):
            self.inner.flush()

    def stats(self) -> dict:
        out = dict(self.inner.stats())
        c = self._codec_stats.snapshot()
        c["method"] = self.spec.method
        c["ratio"] = self.enc / self.raw
        out[self.name] = c
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._exec.shutdown(wait=True)
        self.inner.close()
        super().close()

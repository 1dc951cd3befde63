"""Runtime-owned device memory: the workspace arena (one raw byte buffer per (device, stream),
grow-only) and the staging of small host tables.

Workspaces are carved from it as typed views at 256-byte aligned offsets, so after warm-up a
prefill allocates no device memory.  Views are valid until the next call on the same stream
(calls on one stream run in order, so reuse there is safe; other streams get other arenas).
"""

import threading

import torch

from ..layout import WORKSPACE_DTYPES, WORKSPACE_SLOT_BYTES

_ALIGN = 256
_TORCH_DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}


class WorkspaceArena:
    def __init__(self):
        self._lock = threading.Lock()
        self._buffers: dict[tuple[int, int], torch.Tensor] = {}
        # (device, stream, slots) → views of the current buffer (and their addresses, in ABI
        # order); dropped when a buffer grows.
        self._views: dict[tuple[int, int, int], dict[str, torch.Tensor]] = {}
        self._pointers: dict[tuple[int, int, int], tuple] = {}

    def buffer(self, device: torch.device, nbytes: int, stream: int) -> torch.Tensor:
        """The raw buffer of ``stream`` (a raw ``cudaStream_t``), at least ``nbytes``."""
        key = (device.index, stream)
        with self._lock:
            buf = self._buffers.get(key)
            if buf is None or buf.numel() < nbytes:
                buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
                self._buffers[key] = buf
                self._views = {k: v for k, v in self._views.items() if k[:2] != key}
                self._pointers = {k: v for k, v in self._pointers.items() if k[:2] != key}
            return buf

    def carve(self, device: torch.device, slots: int, stream: int) -> dict[str, torch.Tensor]:
        """Typed views of every workspace for ``slots`` (head, tile) slots, laid out per the ABI:
        workspace ``name`` has shape ``[slots, slot_bytes / itemsize]``.  ``stream`` is the raw
        stream the views are for."""
        views = self._views.get((device.index, stream, slots))
        if views is not None:
            return views
        offsets, cursor = {}, 0
        for name, per_slot in WORKSPACE_SLOT_BYTES.items():
            offsets[name] = cursor
            cursor += -(-per_slot * slots // _ALIGN) * _ALIGN
        buf = self.buffer(device, max(cursor, _ALIGN), stream)
        views = {}
        for name, per_slot in WORKSPACE_SLOT_BYTES.items():
            raw = buf[offsets[name] : offsets[name] + per_slot * slots]
            views[name] = raw.view(_TORCH_DTYPES[WORKSPACE_DTYPES[name]]).view(slots, -1)
        with self._lock:
            if self._buffers.get((device.index, stream)) is buf:
                self._views[(device.index, stream, slots)] = views
        return views


    def pointers(self, device: torch.device, slots: int, stream: int) -> tuple:
        """The addresses of ``carve``'s views, in ``WORKSPACE_DTYPES`` (kernel parameter) order."""
        key = (device.index, stream, slots)
        pointers = self._pointers.get(key)
        if pointers is None:
            views = self.carve(device, slots, stream)
            pointers = tuple(views[name].data_ptr() for name in WORKSPACE_DTYPES)
            with self._lock:
                if self._views.get(key) is views:
                    self._pointers[key] = pointers
        return pointers


class TableStaging:
    """Host→device upload of small int32 tables (CP segment plans) without pinning memory per
    call (``pin_memory`` costs ~100 µs): per (device, stream) a grow-only pinned host buffer and
    device buffer, and an event that guards the host buffer until its last copy has run."""

    def __init__(self):
        self._lock = threading.Lock()
        self._slots: dict[tuple[int, int], tuple] = {}

    def upload(self, values: torch.Tensor, device: torch.device, stream: torch.cuda.Stream) -> torch.Tensor:
        """Copy ``values`` (CPU int32, 1-D) to the device on ``stream`` (which must be current);
        the result stays valid until the next upload on the same stream, which is ordered
        after every use of it on that stream."""
        key, n = (device.index, stream.cuda_stream), values.numel()
        with self._lock:
            host, dev, copied = self._slots.get(key, (None, None, None))
            if copied is not None:
                copied.synchronize()  # the previous copy out of `host` has run (normally long ago)
            if host is None or host.numel() < n:
                size = max(n, 1024)
                host = torch.empty(size, dtype=torch.int32, pin_memory=True)
                dev = torch.empty(size, dtype=torch.int32, device=device)
            host[:n].copy_(values)
            dev[:n].copy_(host[:n], non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
            self._slots[key] = (host, dev, copied)
            return dev[:n]


ARENA = WorkspaceArena()
TABLE_STAGING = TableStaging()

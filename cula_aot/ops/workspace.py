"""Runtime-owned device memory: the workspace arena (one raw byte buffer per (device, stream),
grow-only), and the per-plan CP segment tables.

A call's workspaces are its slots' records (``layout.WORKSPACE_RECORD_BYTES`` each, the parts at
``layout.WORKSPACE_PART_OFFSETS``) from the start of the buffer, so after warm-up a prefill
allocates no device memory; typed per-part views (strided: one row per slot) serve tests and
tools.  Views are valid until the next call on the same stream
(calls on one stream run in order, so reuse there is safe; other streams get other arenas).
A buffer grows (is replaced) only for a call larger than any before on its stream: graphs
captured before read the old one, so a replacement during a capture keeps it alive, and a
graph user warms up with the largest call on the capture stream before capturing any graph
(a larger eager call after a capture would free what that graph reads).
"""

import threading

import torch

from ..layout import (
    WORKSPACE_DTYPES,
    WORKSPACE_PART_OFFSETS,
    WORKSPACE_RECORD_BYTES,
    WORKSPACE_RECORD_ORDER,
    WORKSPACE_SLOT_BYTES,
)

_ALIGN = 256
_TORCH_DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}


class WorkspaceArena:
    def __init__(self):
        self._lock = threading.Lock()
        self._buffers: dict[tuple[int, int], torch.Tensor] = {}
        # (device, stream, slots) → views of the current buffer (and the kernels' workspace
        # pointer); dropped when a buffer grows.
        self._views: dict[tuple[int, int, int], dict[str, torch.Tensor]] = {}
        self._pointers: dict[tuple[int, int, int], tuple] = {}
        # Buffers replaced while a CUDA graph was being captured on their stream: graphs captured
        # before may still address them, so they are never freed.
        self._retired: list[torch.Tensor] = []

    def buffer(self, device: torch.device, nbytes: int, stream: int) -> torch.Tensor:
        """The raw buffer of ``stream`` (a raw ``cudaStream_t``), at least ``nbytes``."""
        key = (device.index, stream)
        with self._lock:
            buf = self._buffers.get(key)
            if buf is None or buf.numel() < nbytes:
                if buf is not None and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                    self._retired.append(buf)
                buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
                self._buffers[key] = buf
                self._views = {k: v for k, v in self._views.items() if k[:2] != key}
                self._pointers = {k: v for k, v in self._pointers.items() if k[:2] != key}
            return buf

    def carve(self, device: torch.device, slots: int, stream: int) -> dict[str, torch.Tensor]:
        """Typed views of every workspace for ``slots`` (head, tile) slots: workspace ``name`` has
        shape ``[slots, slot_bytes / itemsize]``, rows one record apart.  ``stream`` is the raw
        stream the views are for."""
        views = self._views.get((device.index, stream, slots))
        if views is not None:
            return views
        buf = self.buffer(device, max(slots * WORKSPACE_RECORD_BYTES, _ALIGN), stream)
        records = buf[: slots * WORKSPACE_RECORD_BYTES].view(slots, WORKSPACE_RECORD_BYTES)
        views = {}
        for name, per_slot in WORKSPACE_SLOT_BYTES.items():
            offset = WORKSPACE_PART_OFFSETS[name]
            views[name] = records[:, offset : offset + per_slot].view(_TORCH_DTYPES[WORKSPACE_DTYPES[name]])
        with self._lock:
            if self._buffers.get((device.index, stream)) is buf:
                self._views[(device.index, stream, slots)] = views
        return views

    def pointers(self, device: torch.device, slots: int, stream: int) -> tuple:
        """The kernels' workspace parameters (``specs.WORKSPACE_POINTERS``): the first record."""
        key = (device.index, stream, slots)
        pointers = self._pointers.get(key)
        if pointers is None:
            views = self.carve(device, slots, stream)
            pointers = (views[WORKSPACE_RECORD_ORDER[0]].data_ptr(),)
            with self._lock:
                if self._views.get(key) is views:
                    self._pointers[key] = pointers
        return pointers


class SegmentTables:
    """Device copies of CP segment tables, one per plan (lengths, split, flags), built once:
    a repeated plan costs no table building and no upload, and a CUDA graph captured with it
    reads a buffer that lives as long as the process (entries a capture used are never
    evicted).  A new plan is uploaded on a private stream per device that carries nothing else,
    and the host waits for that copy alone (microseconds, never for compute work): an entry is
    complete once stored, so users on any stream, captures included (which may not touch events
    made outside them), need no wait.  A capture needs its plan's table to exist already: run
    the same call once before capturing (graph users warm up anyway: it also sizes the arena)."""

    LIMIT = 256

    def __init__(self):
        self._lock = threading.Lock()
        self._entries: dict = {}  # key -> [table, used by a capture]
        # Per device: the upload stream and a grow-only pinned host buffer (``pin_memory`` per
        # call costs ~100 µs; the buffer is free again once the host has waited for its copy).
        self._uploads: dict[int, tuple] = {}

    def get(self, key, build, device: torch.device, stream: torch.cuda.Stream):
        """The device table of plan ``key`` (``build()`` gives its int32 values on a miss), usable
        on ``stream`` (current); None when capturing a plan not seen before."""
        capturing = torch.cuda.is_current_stream_capturing()
        with self._lock:
            entry = self._entries.get(key)
        if entry is not None:
            entry[0].record_stream(stream)  # allocator bookkeeping: keeps it alive for this stream's work
            entry[1] = entry[1] or capturing
            return entry[0]
        if capturing:
            return None
        values = torch.tensor(build(), dtype=torch.int32)
        n = values.numel()
        with self._lock:
            upload, host = self._uploads.get(device.index, (None, None))
            if upload is None:
                upload = torch.cuda.Stream(device)
            if host is None or host.numel() < n:
                host = torch.empty(max(n, 1024), dtype=torch.int32, pin_memory=True)
            self._uploads[device.index] = (upload, host)
            host[:n].copy_(values)
            with torch.cuda.stream(upload):
                table = torch.empty(n, dtype=torch.int32, device=device)
                table.copy_(host[:n], non_blocking=True)
                done = torch.cuda.Event()
                done.record(upload)
            done.synchronize()  # the copy alone: nothing else runs on the upload stream
        table.record_stream(stream)
        with self._lock:
            if len(self._entries) >= self.LIMIT:
                self._entries = {k: e for k, e in self._entries.items() if e[1]}
            self._entries[key] = [table, False]
        return table


ARENA = WorkspaceArena()
SEGMENT_TABLES = SegmentTables()

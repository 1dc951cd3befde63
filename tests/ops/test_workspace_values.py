"""The shared K1/K2 launch values cover exactly the ABI names both kernels declare (CPU)."""

import torch

from cula_aot.layout import WORKSPACE_PART_OFFSETS, WORKSPACE_RECORD_BYTES
from cula_aot.ops import prepare
from cula_aot.ops.workspace import WorkspaceArena
from cula_aot.specs import K1_PARAMS, K2_PARAMS, SEQUENCE_SCALARS, WORKSPACE_POINTERS


def test_values_cover_the_shared_abi(monkeypatch):
    # A CPU arena: with the stream given explicitly the arena never touches CUDA.
    monkeypatch.setattr(prepare, "ARENA", WorkspaceArena())
    shared = {p.name for p in WORKSPACE_POINTERS + SEQUENCE_SCALARS} | {"cu_seqlens"}
    assert shared <= {p.name for p in K1_PARAMS} and shared <= {p.name for p in K2_PARAMS}
    cu = torch.tensor([0, 5, 40], dtype=torch.int64)
    ws, values, cu32 = prepare.workspace_values(torch.device("cpu"), 1, 40, 3, cu, 0)
    assert set(values) == shared | {"heads"}
    assert cu32.dtype == torch.int32 and values["cu_seqlens"] == cu32.data_ptr()
    assert values["num_seqs"] == 2 and values["total_slots"] == ws.total_slots == (40 + 15 * 2) // 16
    # One pointer, to the first slot's record; the parts of slot s at s·record + offset.
    assert values["workspace"] == ws.kd.data_ptr()
    assert ws.qd.data_ptr() == values["workspace"] + WORKSPACE_PART_OFFSETS["qd"]
    assert ws.gt.data_ptr() == values["workspace"] + WORKSPACE_PART_OFFSETS["gt"]
    assert ws.b[1].data_ptr() == values["workspace"] + WORKSPACE_RECORD_BYTES + WORKSPACE_PART_OFFSETS["b"]
    assert ws.inv.shape == (3 * ws.total_slots, 256) and ws.gt.dtype == ws.b.dtype == torch.float32
    _, fixed, none = prepare.workspace_values(torch.device("cpu"), 3, 17, 3, None, 0)
    assert none is None and fixed["cu_seqlens"] == 0 and fixed["num_seqs"] == 3 and fixed["total_slots"] == 6


def test_arena_reuses_views_per_stream_and_drops_them_when_it_grows():
    arena, cpu = WorkspaceArena(), torch.device("cpu")
    first = arena.carve(cpu, 8, stream=1)
    assert arena.carve(cpu, 8, stream=1) is first  # the per-call fast path: no new views
    other = arena.carve(cpu, 8, stream=2)
    assert other["qd"].data_ptr() != first["qd"].data_ptr()  # streams never share memory
    smaller = arena.carve(cpu, 4, stream=1)
    assert smaller["qd"].data_ptr() == first["qd"].data_ptr()  # same buffer, new shapes
    assert smaller["kd"].shape[0] == 4 and first["kd"].shape[0] == 8
    grown = arena.carve(cpu, 4096, stream=1)
    assert arena.carve(cpu, 8, stream=1) is not first  # views of the old buffer are gone
    assert arena.carve(cpu, 8, stream=1)["qd"].data_ptr() == grown["qd"].data_ptr()


def test_a_buffer_replaced_during_a_capture_stays_alive(monkeypatch):
    """Graphs captured before a larger call still address the old buffer: growth under capture
    keeps it (never freed), eager growth lets it go."""
    arena, capturing = WorkspaceArena(), [False]
    cuda = torch.device("cuda", 0)
    # A stand-in allocator: the arena's logic, not device memory, is under test.
    monkeypatch.setattr(torch, "empty", lambda n, dtype, device: torch.zeros(n, dtype=dtype))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    first = arena.buffer(cuda, 256, stream=1)
    second = arena.buffer(cuda, 512, stream=1)
    assert arena._retired == [] and first is not second
    capturing[0] = True
    assert arena.buffer(cuda, 512, stream=1) is second
    assert arena.buffer(cuda, 1024, stream=1).numel() == 1024
    assert len(arena._retired) == 1 and arena._retired[0] is second

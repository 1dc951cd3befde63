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


def test_stream_state_is_zeroed_once_and_kept_while_it_fits():
    # The epoch word must survive from call to call (a new zeroed state restarts it at 0, with all
    # ready flags 0 too, so no stale flag can equal the next epoch + 1).
    from cula_aot.layout import STREAM_EPOCH, STREAM_READY

    arena, cpu = WorkspaceArena(), torch.device("cpu")
    state = arena.stream_state(cpu, 8, stream=1)
    assert state.dtype == torch.int32 and state.numel() == STREAM_READY + 8 and not state.any()
    state[STREAM_EPOCH] = 41  # as a streamed K2 leaves it
    assert arena.stream_state(cpu, 4, stream=1) is state and state[STREAM_EPOCH] == 41
    assert arena.stream_state(cpu, 8, stream=2) is not state  # per stream
    workspace, state_pointer = arena.pointers(cpu, 8, stream=1)
    assert state_pointer == state.data_ptr() and workspace == arena.carve(cpu, 8, stream=1)["kd"].data_ptr()
    grown = arena.stream_state(cpu, 64, stream=1)
    assert grown is not state and not grown.any()
    assert arena.pointers(cpu, 8, stream=1)[1] == grown.data_ptr()  # cached pointers follow it

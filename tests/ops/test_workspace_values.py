"""The shared K1/K2 launch values cover exactly the ABI names both kernels declare (CPU)."""

import torch

from cula_aot.layout import WORKSPACE_DTYPES, WORKSPACE_SLOT_BYTES
from cula_aot.ops import prepare
from cula_aot.specs import K1_PARAMS, K2_PARAMS, SEQUENCE_SCALARS, WORKSPACE_POINTERS


class _CpuArena:
    def carve(self, device, slots):
        dtypes = {"bf16": torch.bfloat16, "f32": torch.float32}
        return {n: torch.empty(slots, WORKSPACE_SLOT_BYTES[n] // (2 if WORKSPACE_DTYPES[n] == "bf16" else 4),
                               dtype=dtypes[WORKSPACE_DTYPES[n]]) for n in WORKSPACE_DTYPES}


def test_values_cover_the_shared_abi(monkeypatch):
    monkeypatch.setattr(prepare, "ARENA", _CpuArena())
    shared = {p.name for p in WORKSPACE_POINTERS + SEQUENCE_SCALARS} | {"cu_seqlens"}
    assert shared <= {p.name for p in K1_PARAMS} and shared <= {p.name for p in K2_PARAMS}
    cu = torch.tensor([0, 5, 40], dtype=torch.int64)
    ws, values, cu32 = prepare.workspace_values(torch.device("cpu"), 1, 40, 3, cu)
    assert set(values) == shared | {"heads"}
    assert cu32.dtype == torch.int32 and values["cu_seqlens"] == cu32.data_ptr()
    assert values["num_seqs"] == 2 and values["total_slots"] == ws.total_slots == (40 + 15 * 2) // 16
    assert values["ws_gt"] == ws.gt.data_ptr()
    _, fixed, none = prepare.workspace_values(torch.device("cpu"), 3, 17, 3, None)
    assert none is None and fixed["cu_seqlens"] == 0 and fixed["num_seqs"] == 3 and fixed["total_slots"] == 6

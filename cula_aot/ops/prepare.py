"""Launch K1 (prepare) from torch tensors: slot planning, workspace carving, parameter values."""

import dataclasses
import functools

import torch

from ..layout import INPUT_BLOCK_COLS, D, fixed_total_slots, varlen_total_slots
from ..runtime.loader import default_loader
from ..specs import K1Spec, TileBoundSpec, k1_grid, tile_bound_grid
from .call import PrefillCall
from .checks import DEFAULT_SCALE
from .workspace import ARENA


@dataclasses.dataclass
class Workspaces:
    """K1's outputs for H heads × ``total_slots`` tile slots (slot = head · total_slots + tile).

    Views of the slot records: qd/kd/kr: bf16 ``[H·total_slots, 2048]`` raw K_INTER images; gt: fp32
    ``[·, 128]``; inv/mqk: bf16 ``[·, 256]`` row-major 16×16; b: fp32 ``[·, 16]`` σ(β) (0 = padding);
    rows are ``layout.WORKSPACE_RECORD_BYTES`` apart.
    """

    total_slots: int
    views: dict

    def __getattr__(self, name):
        try:
            return self.__dict__["views"][name]
        except KeyError:
            raise AttributeError(name) from None


def plan_slots(batch: int, seq_len: int, cu_seqlens) -> int:
    """Tile slots per head, from shapes alone (no GPU→CPU sync)."""
    if cu_seqlens is None:
        return fixed_total_slots(batch, seq_len)
    return varlen_total_slots(seq_len, cu_seqlens.numel() - 1)


def workspace_values(device, batch: int, seq_len: int, heads: int, cu_seqlens, stream: int):
    """Carve this call's workspaces on ``stream`` (raw) and the launch values K1 and K2 share
    (specs.WORKSPACE_POINTERS, specs.SEQUENCE_SCALARS, cu_seqlens).  Returns ``(Workspaces, values,
    cu32)``: keep ``cu32`` (the int32 device copy of cu_seqlens, or None) alive until the launches
    are issued."""
    total_slots = plan_slots(batch, seq_len, cu_seqlens)
    views = ARENA.carve(device, heads * total_slots, stream)
    cu32 = None if cu_seqlens is None else cu_seqlens.to(device=device, dtype=torch.int32)
    values = {
        "cu_seqlens": 0 if cu32 is None else cu32.data_ptr(),
        "workspace": ARENA.pointers(device, heads * total_slots, stream)[0],
        "seq_len": seq_len,
        "num_seqs": batch if cu32 is None else cu32.numel() - 1,
        "total_slots": total_slots,
        "heads": heads,
    }
    return Workspaces(total_slots, views), values, cu32


def contiguous_strides(heads: int) -> dict:
    """Token strides (elements) of contiguous q, k, v, g, out ([B, T, H, 128]) and beta ([B, T, H])."""
    return {"q": heads * D, "k": heads * D, "v": heads * D, "g": heads * D, "out": heads * D, "beta": heads}


def input_geometry(batch: int, seq_len: int, heads: int, strides: dict) -> dict:
    """K1's values for its inputs' layout: the TMA views of q, k, g as [rows, H·4 blocks of 32
    columns] with their own token strides (recipe names, see ``specs.token_tma``) and β's token
    stride."""
    return {
        "rows": batch * seq_len,
        "row_blocks": heads * D // INPUT_BLOCK_COLS,
        "q_row_bytes": strides["q"] * 2,
        "k_row_bytes": strides["k"] * 2,
        "g_row_bytes": strides["g"] * 2,
        "beta_row_stride": strides["beta"],
    }


@functools.lru_cache(maxsize=None)
def sm_count(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def prepare(q, k, g, beta, **options) -> Workspaces:
    """Run K1 alone on the current stream; returns its workspaces (views into the stream's arena).
    ``options``: ``kda_prefill``'s gate, ``scale``, ``cu_seqlens`` and input conventions, resolved
    as a prefill call resolves them (``PrefillCall``).  For tests and diagnostics:
    ``kda_prefill`` validates its inputs and runs K1 then K2."""
    call = PrefillCall.build(q, k, None, g, beta, **options)  # K1 reads no v
    x, cu_seqlens = call.inputs, call.cu_seqlens
    batch, seq_len, heads, _ = q.shape
    device = q.device
    kernel = default_loader().get(device, K1Spec(varlen=cu_seqlens is not None, gate=x.gate.name))
    stream = torch.cuda.current_stream(device).cuda_stream
    workspaces, common, _cu32 = workspace_values(device, batch, seq_len, heads, cu_seqlens, stream)
    kernel.launch(
        {
            **common,
            **input_geometry(batch, seq_len, heads, contiguous_strides(heads)),
            **k1_grid(common["total_slots"], heads, sm_count(device)),
            "q": q.data_ptr(),
            "k": k.data_ptr(),
            "g": x.g.data_ptr(),
            "beta": x.beta.data_ptr(),
            "a_log": x.gate.A_log.data_ptr(),
            "dt_bias": x.gate.dt_bias.data_ptr(),
            "scale": DEFAULT_SCALE if x.scale is None else float(x.scale),
            "lower_bound": float(x.gate.lower_bound),
            "flags": x.conventions,
        },
        stream,
    )
    return workspaces


__all__ = [
    "DEFAULT_SCALE",
    "Workspaces",
    "contiguous_strides",
    "input_geometry",
    "plan_slots",
    "prepare",
    "sm_count",
    "workspace_values",
]


def tile_bounds(workspaces: Workspaces, heads: int, device) -> torch.Tensor:
    """log2 of a bound of each tile's state map, per head and tile slot, from the workspaces
    ``prepare`` wrote on the current stream (``kernels/tile_bound.py``): fp32 ``[H, total_slots]``
    (slots in varlen gaps hold garbage).  For tests and diagnostics of certified truncation."""
    stream = torch.cuda.current_stream(device).cuda_stream
    total_slots = workspaces.total_slots
    bounds = torch.empty(heads, total_slots, dtype=torch.float32, device=device)
    default_loader().get(device, TileBoundSpec()).launch(
        {
            "workspace": ARENA.pointers(device, heads * total_slots, stream)[0],
            "bounds": bounds.data_ptr(),
            "total_slots": total_slots,
            "heads": heads,
            **tile_bound_grid(total_slots),
        },
        stream,
    )
    return bounds

"""Helpers shared by the tests: the input generators of ``cula_aot.testing`` (CONTRACT §8
distributions) under the names the tests import, and the kernels' tile slots."""

import torch

from cula_aot.layout import CHUNK, varlen_slot_base
from cula_aot.testing import cu_seqlens_of, fresh_seed, standard_inputs

__all__ = ["bits", "cu_seqlens_of", "fresh_seed", "in_layout", "standard_inputs", "tile_slots"]


def in_layout(state_kv, layout):
    """S ([.., K, V]) as a pool stores it, or back: "vk" keeps Sᵀ per head."""
    return state_kv.transpose(-1, -2) if layout == "vk" else state_kv


def bits(t):
    """The raw bits of a float32 or 16-bit tensor, for bitwise comparisons."""
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def tile_slots(lengths_or_batch, seq_len=None):
    """Kernel tile slot of every reference tile (reference order: sequence by sequence)."""
    slots = []
    if seq_len is not None:  # fixed: B sequences of seq_len
        per_seq = -(-seq_len // CHUNK)
        for b in range(lengths_or_batch):
            slots.extend(b * per_seq + t for t in range(per_seq))
        return slots
    cu = cu_seqlens_of(lengths_or_batch).tolist()
    for s, n in enumerate(lengths_or_batch):
        slots.extend(varlen_slot_base(cu, s) + t for t in range(-(-n // CHUNK)))
    return slots

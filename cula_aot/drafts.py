"""Speculative drafts of the fused decode layer (``kda_decode_layer(..., drafts=, verify=True)``):
the buffers a pool of states keeps beside it, in one home.

A verify call runs a request's T draft tokens from its committed state and writes, instead of a
new state, a compact record per token and head: the raw q, k, v and g inputs (bf16, as given) and
the update u (fp32), 1.5 KB against 32 KB for a bf16 state and 64 KB for an fp32 one; the next call
of the layer on that slot commits the ``num_accepted`` first tokens of it (k̂ and the decay α
computed again from the recorded inputs, S ← S·diag(α) + u k̂ᵀ, and the conv state's history)
before its own tokens.  Each slot has two banks, so a call writes its draft while its
peers may still read the pending one, and a mark per head saying which bank holds a pending draft
and how long it is (a commit keeps at most that many tokens; more is clamped and reported).
"""

from typing import NamedTuple

import torch

from .layout import D
from .specs import DRAFT_BANKS, DRAFT_ROWS, DRAFT_TOKENS


class Drafts(NamedTuple):
    """``records``: bf16 ``[slots, 2, 8, H, 6, 128]``; ``marks``: int32 ``[slots, H]``, 0 where a
    slot has no pending draft (zero a slot's row when the slot is given to a new request)."""

    records: torch.Tensor
    marks: torch.Tensor


def draft_shape(slots: int, heads: int) -> tuple:
    return (slots, DRAFT_BANKS, DRAFT_TOKENS, heads, DRAFT_ROWS, D)


def draft_buffers(slots: int, heads: int, device=None) -> Drafts:
    """Zeroed draft buffers for a pool of ``slots`` states of ``heads`` heads (24 KiB per slot and
    head: two banks of eight tokens)."""
    return Drafts(
        torch.zeros(draft_shape(slots, heads), dtype=torch.bfloat16, device=device),
        torch.zeros(slots, heads, dtype=torch.int32, device=device),
    )

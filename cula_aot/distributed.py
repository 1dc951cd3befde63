"""Context parallelism across GPUs: one prefill's tokens split contiguously over the ranks of a
``torch.distributed`` process group, one collective per call.

The batch's global token axis (its sequences back to back, as in ``cu_seqlens``) is cut into
consecutive rank slices of ``rank_tokens[r]`` tokens; rank r passes its slice of q, k, v, g, β and
gets its slice of o.  A sequence may span several ranks.  Its state flows across them through
the linear map a slice applies to it: with S in ``[K, V]`` form, a fragment of a sequence maps
its entry state to ``A·S + B`` (A ``[K, K]``, B ``[K, V]`` per head).  Each rank's only piece a
later rank needs is the map of its last fragment when that sequence continues past its slice:

1. **Local pass** (no communication): one varlen ``kda_prefill`` of every local fragment.
   Fragments whose sequence starts on this rank run from their real initial state, so their
   outputs are final and their map is (0, final state).  A first fragment continuing a sequence
   from an earlier rank runs from zero (its B) and, as one more sequence of the same call, from
   the identity with v = 0 (its A: the state map's matrix).
2. **Exchange**: one ``all_gather`` of every rank's (A, B) (zeros when its last sequence ends on
   it): 2·H·128·128 fp32 per rank, whatever T is.
3. **Carry**: a continuing first fragment's entry state is the chain S ← A_j·S + B_j over the
   ranks before it that hold the sequence (float64, from 0).
4. **Continuation pass**: that fragment alone again from its carry: its outputs, and its final
   state when the sequence ends here.

Intracard CP applies inside each local call (``intracard_cp``).  A middle rank prefills its slice
three times (zero start, identity start, carry), a sequence's first rank once.
"""

import torch
import torch.distributed as dist

from . import api
from .layout import D
from .ops.checks import fail

__all__ = ["kda_prefill_cp", "rank_fragments"]

# The local prefill (``cula_aot.kda_prefill``); a module attribute so that tests can run the
# exchange with a reference in its place.
local_prefill = api.kda_prefill


def rank_fragments(lengths, rank_tokens, rank: int) -> list[tuple[int, int, int]]:
    """Rank ``rank``'s fragments as (sequence, first local token, end local token), in token
    order, for global sequence ``lengths`` cut into consecutive slices of ``rank_tokens`` tokens.
    An empty sequence belongs to the rank whose slice holds its position (the last rank at T)."""
    starts = [sum(rank_tokens[:r]) for r in range(len(rank_tokens))]
    lo, hi = starts[rank], starts[rank] + rank_tokens[rank]
    last_rank = rank == len(rank_tokens) - 1
    out, a = [], 0
    for n, length in enumerate(lengths):
        b = a + length
        if length == 0:
            if lo <= a < hi or (last_rank and a == hi):
                out.append((n, a - lo, a - lo))
        elif max(a, lo) < min(b, hi):
            out.append((n, max(a, lo) - lo, min(b, hi) - lo))
        a = b
    return out


def _check(lengths, rank_tokens, world: int, local_tokens: int, rank: int):
    if not all(type(n) is int and n >= 0 for n in lengths):
        fail(f"lengths must be non-negative ints (the global sequence lengths, the same on every rank), got {lengths!r}")
    if len(rank_tokens) != world or not all(type(n) is int and n >= 0 for n in rank_tokens):
        fail(f"rank_tokens must hold one non-negative int per rank of the group ({world}), got {rank_tokens!r}")
    if sum(rank_tokens) != sum(lengths):
        fail(f"rank_tokens sum to {sum(rank_tokens)} but the sequences hold {sum(lengths)} tokens")
    if rank_tokens[rank] != local_tokens:
        fail(f"rank {rank} passes {local_tokens} tokens but rank_tokens[{rank}] = {rank_tokens[rank]}")


def kda_prefill_cp(q, k, v, g, beta, *, lengths, rank_tokens, group=None, initial_state=None,
                   output_final_state=False, state_layout="vk", intracard_cp="auto", **options):
    """KDA prefill of a batch split over the ranks of ``group`` (default: the world).

    q, k, v, g: this rank's bf16 ``[1, T_r, H, 128]`` slice of the global token axis; beta
    ``[1, T_r, H]``.  ``lengths``: the global sequence lengths (host ints) and ``rank_tokens``:
    tokens per rank (host ints summing to the same total), identical on every rank.
    ``initial_state``: fp32 or bf16 ``[N, H, 128, 128]`` in ``state_layout`` (or None: zeros), read
    only on the rank that holds a sequence's first token.  ``options``: the gate, the input
    conventions and ``scale``, as ``cula_aot.kda_prefill`` takes them.

    Returns ``(o, final_state)``: this rank's output slice, and with ``output_final_state`` an
    fp32 ``[N, H, 128, 128]`` (``state_layout``) whose rows are written for the sequences whose last
    token is on this rank (zeros elsewhere), else None.  Every rank must call it (one
    ``all_gather``, on the device for NCCL, through host copies for gloo)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[0] != 1:
        fail("q must be a [1, T_r, H, 128] tensor: this rank's slice of the batch's token axis")
    local_tokens, heads = q.shape[1], q.shape[2]
    lengths, rank_tokens = list(lengths), list(rank_tokens)
    _check(lengths, rank_tokens, world, local_tokens, rank)
    if state_layout not in ("vk", "kv"):
        fail(f"state_layout must be 'vk' or 'kv', got {state_layout!r}")
    num_seqs, device = len(lengths), q.device
    if initial_state is not None and tuple(initial_state.shape) != (num_seqs, heads, D, D):
        fail(f"initial_state must be [N, H, 128, 128] = {[num_seqs, heads, D, D]}, got {list(initial_state.shape)}")

    def as_kv(state):  # S in [K, V] form, fp32
        state = state.float()
        return state.transpose(-1, -2) if state_layout == "vk" else state

    fragments = rank_fragments(lengths, rank_tokens, rank)
    seq_starts = [sum(lengths[:n]) for n in range(num_seqs)]
    my_start, my_end = sum(rank_tokens[:rank]), sum(rank_tokens[:rank + 1])
    continuing_in = bool(fragments) and seq_starts[fragments[0][0]] < my_start
    continuing_out = bool(fragments) and seq_starts[fragments[-1][0]] + lengths[fragments[-1][0]] > my_end
    final_state = torch.zeros(num_seqs, heads, D, D, device=device) if output_final_state else None
    pair = torch.zeros(2, heads, D, D, device=device)  # this rank's (A, B) of a sequence continuing past it
    o = torch.empty_like(v)

    if fragments:
        # 1. Local pass: every fragment, and the continuing first fragment again from the identity
        # with v = 0, whose final state is its map's matrix A.
        zero = torch.zeros(heads, D, D, device=device)
        starts = [zero if (i == 0 and continuing_in) or initial_state is None else as_kv(initial_state[n])
                  for i, (n, _, _) in enumerate(fragments)]
        inputs = [q, k, v, g, beta]
        bounds = [a for _, a, _ in fragments] + [local_tokens]
        if continuing_in:
            _, a, b = fragments[0]
            extra = [x[:, a:b] for x in inputs]
            extra[2] = torch.zeros_like(extra[2])
            inputs = [torch.cat([x, e], 1) for x, e in zip(inputs, extra)]
            starts.append(torch.eye(D, device=device).expand(heads, D, D))
            bounds.append(local_tokens + b - a)
        o_all, finals = _prefill(inputs, torch.stack(starts), bounds, intracard_cp, options)
        o.copy_(o_all[:, :local_tokens])
        if continuing_out:
            if len(fragments) == 1 and continuing_in:  # a middle rank: (A, B) from identity and zero
                pair[0], pair[1] = finals[-1], finals[0]
            else:  # the sequence started here: its map is its final state (A = 0)
                pair[1] = finals[len(fragments) - 1]
        if final_state is not None:
            for i, (n, _, _) in enumerate(fragments):
                if seq_starts[n] + lengths[n] <= my_end and not (i == 0 and continuing_in):
                    final_state[n] = finals[i]

    # 2. Exchange.
    gathered = _all_gather(pair, world, group)

    if continuing_in:
        # 3. Carry: the chain over the earlier ranks that hold this sequence (an empty rank is
        # the identity map and is skipped).
        n, a, b = fragments[0]
        carry = torch.zeros(heads, D, D, dtype=torch.float64, device=device)
        for j in range(rank):
            if rank_tokens[j] and sum(rank_tokens[:j + 1]) > seq_starts[n]:
                carry = gathered[j, 0].double() @ carry + gathered[j, 1].double()
        # 4. Continuation pass: the first fragment from its carry.
        o_first, final_first = _prefill([x[:, a:b] for x in (q, k, v, g, beta)], carry.float()[None], [0, b - a],
                                        intracard_cp, options)
        o[:, a:b] = o_first
        if final_state is not None and seq_starts[n] + lengths[n] <= my_end:
            final_state[n] = final_first[0]
    if final_state is not None and state_layout == "vk":
        final_state = final_state.transpose(-1, -2).contiguous()
    return o, final_state


def _prefill(inputs, starts, bounds, intracard_cp, options):
    """One local varlen prefill from ``starts`` (``[n, H, K, V]``) over sequences ``bounds``."""
    cu = torch.tensor(bounds, dtype=torch.int32)
    return local_prefill(*inputs, initial_state=starts.contiguous(), output_final_state=True,
                         cu_seqlens=cu.to(inputs[0].device), cu_seqlens_cpu=cu, state_layout="kv",
                         intracard_cp=intracard_cp, **options)


def _all_gather(pair: torch.Tensor, world: int, group) -> torch.Tensor:
    """Every rank's ``pair`` stacked by rank: one collective (through the host for gloo)."""
    via_host = pair.is_cuda and dist.get_backend(group) == "gloo"
    local = pair.cpu() if via_host else pair
    out = torch.empty((world, *local.shape), dtype=local.dtype, device=local.device)
    dist.all_gather(list(out.unbind(0)), local, group=group)
    return out.to(pair.device) if via_host else out

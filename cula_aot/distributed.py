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

States are plain ``[N, ...]`` rows or, with ``state_indices``, slots of each rank's own pool: a
sequence's slot is read on the rank that holds its first token and written on the rank that
holds its last (on the device, the indices never read by the host).  An empty sequence keeps
its initial state without a prefill (``kda_prefill`` takes none).

Intracard CP applies inside each local call (``intracard_cp``).  A middle rank prefills its slice
three times (zero start, identity start, carry), a sequence's first rank once.
"""

import torch
import torch.distributed as dist

from . import api
from .layout import D
from .ops.checks import check_slot_indices, check_state, check_state_layout, fail

__all__ = ["kda_prefill_cp", "rank_fragments", "sequence_ranks"]

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


def sequence_ranks(lengths, rank_tokens) -> list[tuple[int, int]]:
    """(first rank, last rank) of every sequence: where its initial state is read and where its
    final state is written."""
    holders = [[] for _ in lengths]
    for rank in range(len(rank_tokens)):
        for n, _, _ in rank_fragments(lengths, rank_tokens, rank):
            holders[n].append(rank)
    return [(ranks[0], ranks[-1]) for ranks in holders]


def _check(lengths, rank_tokens, world: int, local_tokens: int, rank: int):
    if not all(type(n) is int and n >= 0 for n in lengths):
        fail(
            f"lengths must be non-negative ints (the global sequence lengths, the same on every rank), got {lengths!r}"
        )
    if len(rank_tokens) != world or not all(type(n) is int and n >= 0 for n in rank_tokens):
        fail(f"rank_tokens must hold one non-negative int per rank of the group ({world}), got {rank_tokens!r}")
    if sum(rank_tokens) != sum(lengths):
        fail(f"rank_tokens sum to {sum(rank_tokens)} but the sequences hold {sum(lengths)} tokens")
    if rank_tokens[rank] != local_tokens:
        fail(f"rank {rank} passes {local_tokens} tokens but rank_tokens[{rank}] = {rank_tokens[rank]}")


def _check_states(initial_state, final_state, state_indices, num_seqs, heads, device):
    """Plain ``[N, H, 128, 128]`` initial states, or pools addressed by ``state_indices`` (the same
    validators as the local prefill's, so nothing is refused late, after the exchange)."""
    if state_indices is None:
        if final_state is not None:
            fail(
                "final_state is a pool written at state_indices: pass state_indices (int32 [N], one slot per "
                "sequence), or leave final_state out and take the returned [N, H, 128, 128] rows"
            )
        if initial_state is not None:
            check_state("initial_state", initial_state, heads, device, rows=num_seqs, kernel_read=False)
        return
    check_slot_indices("state_indices", state_indices, num_seqs, device)
    if initial_state is None and final_state is None:
        fail("state_indices selects slots of a state pool: pass the pool as initial_state and/or final_state")
    for name, pool in (("initial_state", initial_state), ("final_state", final_state)):
        if pool is not None:
            check_state(name, pool, heads, device, kernel_read=False)


def kda_prefill_cp(
    q,
    k,
    v,
    g,
    beta,
    *,
    lengths,
    rank_tokens,
    group=None,
    initial_state=None,
    output_final_state=False,
    final_state=None,
    state_indices=None,
    state_layout="vk",
    intracard_cp="auto",
    **options,
):
    """KDA prefill of a batch split over the ranks of ``group`` (default: the world).

    q, k, v, g: this rank's bf16 ``[1, T_r, H, 128]`` slice of the global token axis; beta
    ``[1, T_r, H]``.  ``lengths``: the global sequence lengths (host ints) and ``rank_tokens``:
    tokens per rank (host ints summing to the same total), identical on every rank.
    ``options``: the gate, the input conventions and ``scale``, as ``cula_aot.kda_prefill`` takes
    them.  States are fp32 or bf16, per head in ``state_layout`` ("vk": ``[V, K]``, "kv": ``[K, V]``).

    Plain states: ``initial_state`` ``[N, H, 128, 128]`` (or None: zeros), read only on the rank
    that holds a sequence's first token.  Returns ``(o, final_state)``: this rank's output slice,
    and with ``output_final_state`` an fp32 ``[N, H, 128, 128]`` whose rows are written for the
    sequences whose last token is on this rank (zeros elsewhere), else None.

    State pools, as ``kda_prefill`` takes them: ``initial_state`` and/or ``final_state`` are this
    rank's own pools ``[slots, H, 128, 128]`` (each rank its own tensors) and ``state_indices``,
    int32 ``[N]`` on this rank's device, gives each global sequence a slot of them (the slots
    may differ between ranks).
    Sequence n's initial state is read from ``initial_state[state_indices[n]]`` on the rank that
    holds its first token only; its final state is written to ``final_state[state_indices[n]]``
    (``initial_state`` itself when ``output_final_state`` and no ``final_state``: in place) on
    the rank that holds its last token only.  A slot outside ``[0, slots)`` (-1 is the padding
    value) is a zero start and no write.  Every other slot of every rank's pools keeps its bits,
    so after the call a sequence's state lies in the pool of the rank where it ended.  Returns
    ``(o, the written pool)`` (None when nothing is written).  The indices are never read by the
    host.

    Every rank must call it (one ``all_gather``, on the device for NCCL, through host copies for
    gloo).  The split, the states and the indices are checked before any work, the rest by the
    local ``kda_prefill`` before the exchange and before any pool write (``KDAInputError`` names
    the argument)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[0] != 1:
        fail("q must be a [1, T_r, H, 128] tensor: this rank's slice of the batch's token axis")
    local_tokens, heads = q.shape[1], q.shape[2]
    lengths, rank_tokens = list(lengths), list(rank_tokens)
    _check(lengths, rank_tokens, world, local_tokens, rank)
    check_state_layout(state_layout)
    num_seqs, device = len(lengths), q.device
    _check_states(initial_state, final_state, state_indices, num_seqs, heads, device)
    if state_indices is not None and output_final_state and final_state is None:
        final_state = initial_state  # a pool's final states go back where they came from

    fragments = rank_fragments(lengths, rank_tokens, rank)
    seq_starts = [sum(lengths[:n]) for n in range(num_seqs)]
    my_start, my_end = sum(rank_tokens[:rank]), sum(rank_tokens[: rank + 1])
    continuing_in = bool(fragments) and seq_starts[fragments[0][0]] < my_start
    continuing_out = bool(fragments) and seq_starts[fragments[-1][0]] + lengths[fragments[-1][0]] > my_end
    ends_here = {n for n, _, _ in fragments if seq_starts[n] + lengths[n] <= my_end}
    finals = {}  # sequence -> final state ([H, K, V] fp32) of the sequences that end on this rank
    pair = torch.zeros(2, heads, D, D, device=device)  # this rank's (A, B) of a sequence continuing past it
    o = torch.empty_like(v)

    if fragments:
        zero = torch.zeros(heads, D, D, device=device)
        opened = [n for n, _, _ in fragments[int(continuing_in) :]]  # the sequences that start on this rank
        starts = ([zero] if continuing_in else []) + list(
            _read_states(initial_state, state_indices, opened, state_layout, heads, device)
        )
        # An empty sequence (it starts and ends here) keeps its initial state; kda_prefill takes none.
        finals.update((n, s) for (n, a, b), s in zip(fragments, starts) if a == b)
        run = [i for i, (_, a, b) in enumerate(fragments) if a < b]
        if run:
            # 1. Local pass: every fragment, and the continuing first fragment again from the
            # identity with v = 0, whose final state is its map's matrix A.
            inputs = [q, k, v, g, beta]
            bounds = [fragments[i][1] for i in run] + [local_tokens]
            run_starts = [starts[i] for i in run]
            if continuing_in:
                _, a, b = fragments[0]
                extra = [x[:, a:b] for x in inputs]
                extra[2] = torch.zeros_like(extra[2])
                inputs = [torch.cat([x, e], 1) for x, e in zip(inputs, extra)]
                run_starts.append(torch.eye(D, device=device).expand(heads, D, D))
                bounds.append(local_tokens + b - a)
            o_all, run_finals = _prefill(inputs, torch.stack(run_starts), bounds, intracard_cp, options)
            o.copy_(o_all[:, :local_tokens])
            if continuing_out:
                if len(fragments) == 1 and continuing_in:  # a middle rank: (A, B) from identity and zero
                    pair[0], pair[1] = run_finals[-1], run_finals[0]
                else:  # the sequence started here: its map is its final state (A = 0)
                    pair[1] = run_finals[len(run) - 1]
            finals.update(
                (fragments[i][0], run_finals[j])
                for j, i in enumerate(run)
                if fragments[i][0] in ends_here and not (i == 0 and continuing_in)
            )

    # 2. Exchange.
    gathered = _all_gather(pair, world, group)

    if continuing_in:
        # 3. Carry: the chain over the earlier ranks that hold this sequence (an empty rank is
        # the identity map and is skipped).
        n, a, b = fragments[0]
        carry = torch.zeros(heads, D, D, dtype=torch.float64, device=device)
        for j in range(rank):
            if rank_tokens[j] and sum(rank_tokens[: j + 1]) > seq_starts[n]:
                carry = gathered[j, 0].double() @ carry + gathered[j, 1].double()
        # 4. Continuation pass: the first fragment from its carry.
        o_first, final_first = _prefill(
            [x[:, a:b] for x in (q, k, v, g, beta)], carry.float()[None], [0, b - a], intracard_cp, options
        )
        o[:, a:b] = o_first
        if n in ends_here:
            finals[n] = final_first[0]

    if state_indices is not None:
        if final_state is not None and finals:
            _write_states(final_state, state_indices, finals, state_layout)
        return o, final_state
    if not output_final_state:
        return o, None
    out = torch.zeros(num_seqs, heads, D, D, device=device)
    for n, s in finals.items():
        out[n] = s
    return o, _from_kv(out, state_layout).contiguous()


def _to_kv(states, layout):
    """States in ``layout`` as S (``[.., K, V]``), fp32."""
    states = states.float()
    return states.transpose(-1, -2) if layout == "vk" else states


def _from_kv(states, layout):
    return states.transpose(-1, -2) if layout == "vk" else states


def _read_states(initial_state, state_indices, seqs, layout, heads, device):
    """The initial states (S, fp32) of sequences ``seqs``: zeros without ``initial_state``, its rows
    (plain) or its slots ``state_indices[seqs]`` (a pool: a slot outside it reads zeros)."""
    if initial_state is None or not seqs:
        return torch.zeros(len(seqs), heads, D, D, device=device)
    rows = torch.tensor(seqs, device=device)
    if state_indices is None:
        return _to_kv(initial_state.index_select(0, rows), layout)
    slots = state_indices.index_select(0, rows).long()
    inside = (slots >= 0) & (slots < initial_state.shape[0])
    read = initial_state.index_select(0, slots.clamp(0, initial_state.shape[0] - 1))
    return _to_kv(torch.where(inside[:, None, None, None], read, torch.zeros_like(read)), layout)


def _write_states(pool, state_indices, finals, layout):
    """``pool[state_indices[n]] = finals[n]`` (S, fp32, rounded once to the pool's dtype) in place
    for every slot inside the pool, with no host read of the indices."""
    rows = torch.tensor(list(finals), device=pool.device)
    slots = state_indices.index_select(0, rows).long()
    states = _from_kv(torch.stack(list(finals.values())), layout).to(pool.dtype)
    inside = (slots >= 0) & (slots < pool.shape[0])
    # index_copy_ needs every destination inside the pool: a slot outside it is sent to the first
    # inside one with that one's state, or (none inside) to a slot with its own contents, so
    # the duplicate destinations write identical bits.
    first = inside.int().argmax().view(1)  # 0 when none is inside
    spare = slots.index_select(0, first).clamp(0, pool.shape[0] - 1)
    fill = torch.where(
        inside.index_select(0, first)[:, None, None, None], states.index_select(0, first), pool.index_select(0, spare)
    )
    pool.index_copy_(0, torch.where(inside, slots, spare), torch.where(inside[:, None, None, None], states, fill))


def _prefill(inputs, starts, bounds, intracard_cp, options):
    """One local varlen prefill from ``starts`` (``[n, H, K, V]``) over sequences ``bounds``."""
    cu = torch.tensor(bounds, dtype=torch.int32)
    return local_prefill(
        *inputs,
        initial_state=starts.contiguous(),
        output_final_state=True,
        cu_seqlens=cu.to(inputs[0].device),
        cu_seqlens_cpu=cu,
        state_layout="kv",
        intracard_cp=intracard_cp,
        **options,
    )


def _all_gather(pair: torch.Tensor, world: int, group) -> torch.Tensor:
    """Every rank's ``pair`` stacked by rank: one collective (through the host for gloo)."""
    via_host = pair.is_cuda and dist.get_backend(group) == "gloo"
    local = pair.cpu() if via_host else pair
    out = torch.empty((world, *local.shape), dtype=local.dtype, device=local.device)
    dist.all_gather(list(out.unbind(0)), local, group=group)
    return out.to(pair.device) if via_host else out

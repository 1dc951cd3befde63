"""``cula_aot.distributed.kda_prefill_cp`` on the CPU: real process groups (gloo, 1–4 processes)
with the float64 reference recurrence in place of the local kernels, so the split, the exchange,
the carry chain and the continuation pass are checked exactly against one prefill of the whole
batch (slow decay: the state lives across every rank), with plain states and with every rank's
own state pool."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cula_aot import KDAInputError, distributed, reference
from tests.helpers import bits, cu_seqlens_of, fresh_seed, in_layout, standard_inputs

HEADS = 2


def reference_prefill(
    q,
    k,
    v,
    g,
    beta,
    *,
    initial_state,
    output_final_state,
    cu_seqlens,
    cu_seqlens_cpu,
    state_layout,
    intracard_cp,
    A_log=None,
    dt_bias=None,
    lower_bound=None,
    gate="safe",
    **_,
):
    """The local prefill's contract in float64 (``[N, H, K, V]`` states)."""
    assert state_layout == "kv" and output_final_state and torch.equal(cu_seqlens, cu_seqlens_cpu)
    assert q.shape[1] > 0 and bool((cu_seqlens_cpu.diff() > 0).all()), "kda_prefill refuses empty sequences"
    o, s = reference.kda_recurrent(
        q,
        k,
        v,
        g,
        beta,
        A_log=A_log,
        dt_bias=dt_bias,
        lower_bound=lower_bound,
        initial_state=initial_state.double(),
        cu_seqlens=cu_seqlens_cpu,
        gate_kind=gate,
    )
    return o, s.float()


def _problem(seed, lengths, gate):
    x = standard_inputs(1, sum(lengths), HEADS, seed=seed, slow_decay=True, gate=gate, n_states=len(lengths))
    options = {"gate": gate, "A_log": x.get("A_log"), "dt_bias": x.get("dt_bias"), "lower_bound": x.get("lower_bound")}
    tensors = [x[name].double() for name in ("q", "k", "v", "g", "beta")]
    return tensors, options, x["initial_state"]


def _worker(rank, world, init_file, seed, lengths, rank_tokens, gate, layout):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        distributed.local_prefill = reference_prefill
        tensors, options, s0 = _problem(seed, lengths, gate)
        start = sum(rank_tokens[:rank])
        mine = [t[:, start : start + rank_tokens[rank]] for t in tensors]
        init = in_layout(s0, layout)
        o, final = distributed.kda_prefill_cp(
            *mine,
            lengths=lengths,
            rank_tokens=rank_tokens,
            initial_state=init,
            output_final_state=True,
            state_layout=layout,
            **options,
        )
        cu = cu_seqlens_of(lengths)
        want_o, want_s = reference.kda_recurrent(
            *tensors,
            **{k: v for k, v in options.items() if k != "gate"},
            initial_state=s0.double(),
            cu_seqlens=cu,
            gate_kind=gate,
        )
        assert o.shape == (1, rank_tokens[rank], HEADS, 128)
        if rank_tokens[rank]:
            assert reference.rel_rmse(o, want_o[:, start : start + rank_tokens[rank]]) < 1e-6, rank
        got = in_layout(final, layout)
        ends = [
            n
            for n, _, b in distributed.rank_fragments(lengths, rank_tokens, rank)
            if sum(lengths[: n + 1]) <= start + rank_tokens[rank]
        ]
        for n in range(len(lengths)):
            if n in ends:
                assert reference.rel_rmse(got[n], want_s[n]) < 1e-6, (rank, n)
            else:
                assert not got[n].any(), (rank, n)  # not this rank's to write
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "lengths, rank_tokens, gate, layout",
    [
        ([40], [40], "safe", "vk"),  # one rank: the plain prefill
        ([97], [30, 31, 36], "softplus", "vk"),  # one sequence over three ranks: a middle rank
        ([20, 0, 45, 8, 30], [33, 0, 40, 30], "safe", "kv"),  # varlen, an empty sequence and an empty rank
        ([10, 50, 5], [12, 12, 12, 29], "softplus", "kv"),  # a sequence over three ranks inside a batch
    ],
)
def test_split_over_ranks_equals_one_prefill(lengths, rank_tokens, gate, layout):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(
            _worker,
            args=(len(rank_tokens), os.path.join(tmp, "pg"), fresh_seed(), lengths, rank_tokens, gate, layout),
            nprocs=len(rank_tokens),
            join=True,
        )


def test_fragments_cover_every_token_once():
    lengths, rank_tokens = [5, 0, 7, 3, 0], [4, 4, 0, 7]
    covered = []
    for rank in range(len(rank_tokens)):
        start = sum(rank_tokens[:rank])
        for n, a, b in distributed.rank_fragments(lengths, rank_tokens, rank):
            assert 0 <= a <= b <= rank_tokens[rank]
            covered += [(n, start + t) for t in range(a, b)]
    assert covered == [
        (n, t) for n, length in enumerate(lengths) for t in range(sum(lengths[:n]), sum(lengths[:n]) + length)
    ]
    # empty sequences: on the rank holding their position, the last rank at the end
    assert (1, 1, 1) in distributed.rank_fragments(lengths, rank_tokens, 1)
    assert (4, 7, 7) in distributed.rank_fragments(lengths, rank_tokens, 3)
    # sequence 0 spans ranks 0-1 (tokens 0-4), 2 spans 1-3 (tokens 5-11; rank 2 is empty)
    assert distributed.sequence_ranks(lengths, rank_tokens) == [(0, 1), (1, 1), (1, 3), (3, 3), (3, 3)]


def test_bad_splits_are_refused_before_any_work():
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'pg')}", rank=0, world_size=1)
        try:
            tensors, options, _ = _problem(0, [16], "safe")
            for kwargs, message in [
                (dict(lengths=[16], rank_tokens=[8, 8]), "one non-negative int per rank"),
                (dict(lengths=[16], rank_tokens=[15]), "sum to 15"),
                (dict(lengths=[8, 8.0], rank_tokens=[16]), "non-negative ints"),
            ]:
                with pytest.raises(KDAInputError, match=message):
                    distributed.kda_prefill_cp(*tensors, **kwargs, **options)
        finally:
            dist.destroy_process_group()


def _random_backing(size, dtype, gen):
    """Random states for a rank's own pool, one head more per slot: the pool is ``[:, :HEADS]``,
    its slots padded apart."""
    return torch.randn(size, HEADS + 1, 128, 128, generator=gen).to(dtype)


def _pool_worker(rank, world, init_file, seed, lengths, rank_tokens, slots, size, gate, layout, dtype, separate):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        own = [(slot + rank) % size if slot >= 0 else -1 for slot in slots]  # each rank's own slot numbers
        distributed.local_prefill = reference_prefill
        tensors, options, s0 = _problem(seed, lengths, gate)
        start = sum(rank_tokens[:rank])
        mine = [t[:, start : start + rank_tokens[rank]] for t in tensors]
        # Random slots everywhere (another rank's values would give wrong results if read), the
        # true initial state only in the slots of the sequences this rank starts.
        gen = torch.Generator().manual_seed(seed + 1 + rank)
        backing = _random_backing(size, dtype, gen)
        pool = backing[:, :HEADS]
        for n, slot in enumerate(own):
            if slot >= 0 and distributed.sequence_ranks(lengths, rank_tokens)[n][0] == rank:
                pool[slot] = in_layout(s0[n], layout).to(dtype)
        target_backing = _random_backing(size, dtype, gen) if separate else backing
        target = target_backing[:, :HEADS] if separate else pool
        pool_before, target_backing_before = backing.clone(), target_backing.clone()
        indices = torch.tensor(own, dtype=torch.int32)
        o, final = distributed.kda_prefill_cp(
            *mine,
            lengths=lengths,
            rank_tokens=rank_tokens,
            initial_state=pool,
            final_state=target if separate else None,
            output_final_state=not separate,
            state_indices=indices,
            state_layout=layout,
            **options,
        )
        assert final is target
        # The reference starts from the pool's values (bf16-rounded for a bf16 pool), zeros for -1.
        s_start = torch.stack(
            [s0[n].to(dtype).float() if slot >= 0 else torch.zeros_like(s0[n]) for n, slot in enumerate(slots)]
        )
        want_o, want_s = reference.kda_recurrent(
            *tensors,
            **{k: v for k, v in options.items() if k != "gate"},
            initial_state=s_start.double(),
            cu_seqlens=cu_seqlens_of(lengths),
            gate_kind=gate,
        )
        if rank_tokens[rank]:
            assert reference.rel_rmse(o, want_o[:, start : start + rank_tokens[rank]]) < 1e-6, rank
        written = {
            slot: n
            for n, slot in enumerate(own)
            if slot >= 0 and distributed.sequence_ranks(lengths, rank_tokens)[n][1] == rank
        }
        for slot, n in written.items():
            got = in_layout(target[slot].float(), layout)
            assert reference.rel_rmse(got, want_s[n]) < (1e-6 if dtype == torch.float32 else 2**-8), (rank, n)
        kept = [slot for slot in range(size) if slot not in written]
        assert torch.equal(bits(target_backing[kept]), bits(target_backing_before[kept])), rank  # not this rank's
        assert torch.equal(bits(target_backing[:, HEADS]), bits(target_backing_before[:, HEADS])), "padding written"
        if separate:
            assert torch.equal(bits(backing), bits(pool_before)), rank
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "lengths, rank_tokens, slots, size, gate, layout, dtype, separate",
    [
        # one sequence over three ranks, in place
        ([97], [30, 31, 36], [2], 4, "softplus", "vk", torch.float32, False),
        # a sequence over three ranks with no slot: a zero start, and its last rank writes nothing
        ([10, 30, 5, 20], [12, 20, 12, 21], [3, -1, 0, 5], 6, "safe", "kv", torch.bfloat16, True),
        # an empty sequence (its state stays), an empty rank, a last rank whose only sequence has no slot
        ([20, 0, 45, 8, 30], [33, 0, 40, 30], [4, 1, 0, 6, -1], 7, "safe", "vk", torch.bfloat16, False),
        # one rank: the plain prefill through a permuted pool into another
        ([40, 24], [64], [1, 0], 3, "softplus", "kv", torch.float32, True),
    ],
)
def test_pools_split_over_ranks_equal_one_prefill(lengths, rank_tokens, slots, size, gate, layout, dtype, separate):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(
            _pool_worker,
            args=(
                len(rank_tokens),
                os.path.join(tmp, "pg"),
                fresh_seed(),
                lengths,
                rank_tokens,
                slots,
                size,
                gate,
                layout,
                dtype,
                separate,
            ),
            nprocs=len(rank_tokens),
            join=True,
        )


def test_bad_pools_are_refused_before_any_work(monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("a local prefill ran before the arguments were checked")

    monkeypatch.setattr(distributed, "local_prefill", no_work)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'pg')}", rank=0, world_size=1)
        try:
            tensors, options, _ = _problem(0, [16], "safe")
            split = dict(lengths=[16], rank_tokens=[16], **options)
            pool = torch.randn(3, HEADS, 128, 128)
            before = pool.clone()
            index = torch.tensor([1], dtype=torch.int32)
            for kwargs, message in [
                (dict(initial_state=pool, state_indices=index.long()), "state_indices must be torch.int32"),
                (
                    dict(initial_state=pool, state_indices=torch.tensor([1, 2], dtype=torch.int32)),
                    r"state_indices must have shape \[1\]",
                ),
                (dict(state_indices=index, output_final_state=True), "pass the pool as initial_state"),
                (dict(initial_state=pool[:1], final_state=pool), "final_state is a pool written at state_indices"),
                (
                    dict(initial_state=pool.half(), state_indices=index),
                    "initial_state must be torch.float32 or torch.bfloat16",
                ),
                (dict(initial_state=pool[:, :1], state_indices=index), r"initial_state must have shape \[slots >= 1, "),
                (dict(initial_state=pool[:0], state_indices=index), "slots >= 1"),
                (
                    dict(initial_state=pool, final_state=pool[0], state_indices=index),
                    r"final_state must have shape \[slots >= 1, ",
                ),
                (
                    dict(initial_state=pool, output_final_state=True),
                    r"initial_state must have shape \[1, \d+, 128, 128\] \(one state per sequence\)",
                ),
            ]:
                with pytest.raises(KDAInputError, match=message):
                    distributed.kda_prefill_cp(*tensors, **split, **kwargs)
            assert torch.equal(pool, before)
        finally:
            dist.destroy_process_group()

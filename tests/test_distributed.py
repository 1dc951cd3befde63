"""``cula_aot.distributed.kda_prefill_cp`` on the CPU: real process groups (gloo, 1–4 processes)
with the float64 reference recurrence in place of the local kernels, so the split, the exchange,
the carry chain and the continuation pass are checked exactly against one prefill of the whole
batch (slow decay: the state lives across every rank)."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cula_aot import KDAInputError, distributed, reference
from cula_aot.testing import cu_seqlens_of, fresh_seed, standard_inputs

HEADS = 2


def reference_prefill(q, k, v, g, beta, *, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu,
                      state_layout, intracard_cp, A_log=None, dt_bias=None, lower_bound=None, gate="safe", **_):
    """The local prefill's contract in float64 (``[N, H, K, V]`` states)."""
    assert state_layout == "kv" and output_final_state and torch.equal(cu_seqlens, cu_seqlens_cpu)
    o, s = reference.kda_recurrent(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                                   initial_state=initial_state.double(), cu_seqlens=cu_seqlens_cpu, gate_kind=gate)
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
        mine = [t[:, start:start + rank_tokens[rank]] for t in tensors]
        init = s0.transpose(-1, -2) if layout == "vk" else s0
        o, final = distributed.kda_prefill_cp(*mine, lengths=lengths, rank_tokens=rank_tokens, initial_state=init,
                                              output_final_state=True, state_layout=layout, **options)
        cu = cu_seqlens_of(lengths)
        want_o, want_s = reference.kda_recurrent(*tensors, **{k: v for k, v in options.items() if k != "gate"},
                                                 initial_state=s0.double(), cu_seqlens=cu, gate_kind=gate)
        assert o.shape == (1, rank_tokens[rank], HEADS, 128)
        if rank_tokens[rank]:
            assert reference.rel_rmse(o, want_o[:, start:start + rank_tokens[rank]]) < 1e-6, rank
        got = final.transpose(-1, -2) if layout == "vk" else final
        ends = [n for n, _, b in distributed.rank_fragments(lengths, rank_tokens, rank)
                if sum(lengths[:n + 1]) <= start + rank_tokens[rank]]
        for n in range(len(lengths)):
            if n in ends:
                assert reference.rel_rmse(got[n], want_s[n]) < 1e-6, (rank, n)
            else:
                assert not got[n].any(), (rank, n)  # not this rank's to write
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("lengths, rank_tokens, gate, layout", [
    ([40], [40], "safe", "vk"),  # one rank: the plain prefill
    ([97], [30, 31, 36], "softplus", "vk"),  # one sequence over three ranks: a middle rank
    ([20, 0, 45, 8, 30], [33, 0, 40, 30], "safe", "kv"),  # varlen, an empty sequence and an empty rank
    ([10, 50, 5], [12, 12, 12, 29], "softplus", "kv"),  # a sequence over three ranks inside a batch
])
def test_split_over_ranks_equals_one_prefill(lengths, rank_tokens, gate, layout):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(len(rank_tokens), os.path.join(tmp, "pg"), fresh_seed(), lengths, rank_tokens, gate,
                                layout), nprocs=len(rank_tokens), join=True)


def test_fragments_cover_every_token_once():
    lengths, rank_tokens = [5, 0, 7, 3, 0], [4, 4, 0, 7]
    covered = []
    for rank in range(len(rank_tokens)):
        start = sum(rank_tokens[:rank])
        for n, a, b in distributed.rank_fragments(lengths, rank_tokens, rank):
            assert 0 <= a <= b <= rank_tokens[rank]
            covered += [(n, start + t) for t in range(a, b)]
    assert covered == [(n, t) for n, length in enumerate(lengths) for t in range(sum(lengths[:n]), sum(lengths[:n]) + length)]
    # empty sequences: on the rank holding their position, the last rank at the end
    assert (1, 1, 1) in distributed.rank_fragments(lengths, rank_tokens, 1)
    assert (4, 7, 7) in distributed.rank_fragments(lengths, rank_tokens, 3)


def test_bad_splits_are_refused_before_any_work():
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'pg')}", rank=0, world_size=1)
        try:
            tensors, options, _ = _problem(0, [16], "safe")
            for kwargs, message in [(dict(lengths=[16], rank_tokens=[8, 8]), "one non-negative int per rank"),
                                    (dict(lengths=[16], rank_tokens=[15]), "sum to 15"),
                                    (dict(lengths=[8, 8.0], rank_tokens=[16]), "non-negative ints")]:
                with pytest.raises(KDAInputError, match=message):
                    distributed.kda_prefill_cp(*tensors, **kwargs, **options)
        finally:
            dist.destroy_process_group()

"""``cula_aot.distributed.kda_prefill_cp`` on the GPU: 2–4 processes on one device through the
gloo backend, the real kernels in every local pass, against the float64 reference and against
one ``kda_prefill`` of the whole batch (slow decay, poisoned outputs are not needed: every
output is a fresh tensor, checked finite), with plain states and with every process's own state
pool (its other slots fingerprinted bitwise)."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import cula_aot
from cula_aot import distributed, reference
from tests.helpers import bits, cu_seqlens_of, fresh_seed, in_layout, standard_inputs

pytestmark = pytest.mark.gpu
HEADS = 4
BOUND = 5e-3


def _problem(seed, lengths, gate):
    """The whole batch (the same on every process: generated on the CPU) and its gate options."""
    x = standard_inputs(
        1,
        sum(lengths),
        HEADS,
        device="cuda",
        seed=seed,
        slow_decay=True,
        gate=gate,
        n_states=len(lengths),
        generator_device="cpu",
    )
    return x, {name: x[name] for name in ("A_log", "dt_bias", "lower_bound", "gate") if name in x}


def _worker(rank, world, init_file, seed, lengths, rank_tokens, gate, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        x, options = _problem(seed, lengths, gate)
        start = sum(rank_tokens[:rank])
        mine = [x[name][:, start : start + rank_tokens[rank]].clone() for name in ("q", "k", "v", "g", "beta")]
        o, final = distributed.kda_prefill_cp(
            *mine,
            lengths=lengths,
            rank_tokens=rank_tokens,
            initial_state=x["initial_state"].transpose(-1, -2).contiguous(),
            output_final_state=True,
            **options,
        )
        torch.cuda.synchronize()
        torch.save({"o": o.cpu(), "final": final.transpose(-1, -2).cpu()}, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "lengths, rank_tokens, gate",
    [
        ([4096], [2048, 2048], "safe"),
        ([3000], [1000, 1000, 1000], "softplus"),  # a middle rank
        ([700, 2500, 33, 900], [1100, 1100, 1033, 900], "safe"),  # varlen over four ranks
    ],
)
def test_split_over_processes_on_one_gpu(lengths, rank_tokens, gate):
    seed = fresh_seed()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(
            _worker,
            args=(len(rank_tokens), os.path.join(tmp, "pg"), seed, lengths, rank_tokens, gate, tmp),
            nprocs=len(rank_tokens),
            join=True,
        )
        parts = [torch.load(os.path.join(tmp, f"{r}.pt")) for r in range(len(rank_tokens))]
    x, options = _problem(seed, lengths, gate)
    args = [x[name] for name in ("q", "k", "v", "g", "beta")]
    cu = cu_seqlens_of(lengths)
    o_one, s_one = cula_aot.kda_prefill(
        *args,
        **options,
        initial_state=x["initial_state"].transpose(-1, -2).contiguous(),
        output_final_state=True,
        cu_seqlens=cu.cuda(),
        cu_seqlens_cpu=cu,
    )
    ref_o, ref_s = reference.kda_chunked(
        *args,
        A_log=x.get("A_log"),
        dt_bias=x.get("dt_bias"),
        lower_bound=x.get("lower_bound"),
        initial_state=x["initial_state"],
        cu_seqlens=cu,
        gate_kind=gate,
    )
    o = torch.cat([p["o"] for p in parts], 1).cuda()
    final = sum(p["final"] for p in parts).cuda()  # each row written by exactly one rank
    assert torch.isfinite(o).all() and torch.isfinite(final).all()
    err_o, err_s = reference.rel_rmse(o, ref_o), reference.rel_rmse(final, ref_s)
    vs_one = reference.rel_rmse(o, o_one), reference.rel_rmse(final, s_one.transpose(-1, -2))
    print(
        f"CP over {len(rank_tokens)} processes, {gate}: o rel-RMSE {err_o:.2e}, state {err_s:.2e}; against one "
        f"prefill o {vs_one[0]:.2e}, state {vs_one[1]:.2e}"
    )
    assert err_o <= BOUND and err_s <= BOUND


POOL_SLOTS = 6


def _pool_worker(rank, world, init_file, seed, lengths, rank_tokens, gate, slots, dtype, layout, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        x, options = _problem(seed, lengths, gate)
        start = sum(rank_tokens[:rank])
        mine = [x[name][:, start : start + rank_tokens[rank]].clone() for name in ("q", "k", "v", "g", "beta")]
        # This process's own pool: random slots, the true initial state where it starts a sequence.
        gen = torch.Generator().manual_seed(seed + 1 + rank)
        pool = torch.randn(POOL_SLOTS, HEADS, 128, 128, generator=gen).to(dtype).cuda()
        for n, slot in enumerate(slots):
            if slot >= 0 and distributed.sequence_ranks(lengths, rank_tokens)[n][0] == rank:
                pool[slot] = in_layout(x["initial_state"][n], layout).to(dtype)
        before = pool.clone()
        o, final = distributed.kda_prefill_cp(
            *mine,
            lengths=lengths,
            rank_tokens=rank_tokens,
            initial_state=pool,
            output_final_state=True,
            state_layout=layout,
            state_indices=torch.tensor(slots, dtype=torch.int32, device="cuda"),
            **options,
        )
        torch.cuda.synchronize()
        assert final is pool
        torch.save({"o": o.cpu(), "pool": pool.cpu(), "before": before.cpu()}, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "lengths, rank_tokens, gate, slots, dtype, layout",
    [
        # rank 0's only ending sequence has no slot; the other spans all three ranks
        ([1200, 3000], [1400, 1400, 1400], "softplus", [-1, 2], torch.bfloat16, "vk"),
        ([700, 2500, 33, 900], [1100, 1100, 1033, 900], "safe", [5, 0, -1, 3], torch.float32, "kv"),
    ],
)
def test_pools_split_over_processes_on_one_gpu(lengths, rank_tokens, gate, slots, dtype, layout):
    seed = fresh_seed()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(
            _pool_worker,
            args=(
                len(rank_tokens),
                os.path.join(tmp, "pg"),
                seed,
                lengths,
                rank_tokens,
                gate,
                slots,
                dtype,
                layout,
                tmp,
            ),
            nprocs=len(rank_tokens),
            join=True,
        )
        parts = [torch.load(os.path.join(tmp, f"{r}.pt")) for r in range(len(rank_tokens))]
    x, options = _problem(seed, lengths, gate)
    args = [x[name] for name in ("q", "k", "v", "g", "beta")]
    cu = cu_seqlens_of(lengths)
    # The pool's values (bf16-rounded for a bf16 pool), zeros for the sequence with no slot.
    s_start = torch.stack(
        [s.to(dtype).float() if slot >= 0 else torch.zeros_like(s) for s, slot in zip(x["initial_state"], slots)]
    )
    ref_o, ref_s = reference.kda_chunked(
        *args,
        A_log=x.get("A_log"),
        dt_bias=x.get("dt_bias"),
        lower_bound=x.get("lower_bound"),
        initial_state=s_start,
        cu_seqlens=cu,
        gate_kind=gate,
    )
    indices = torch.tensor(slots, dtype=torch.int32, device="cuda")
    pool_one = torch.zeros(POOL_SLOTS, HEADS, 128, 128, dtype=dtype, device="cuda")
    for n, slot in enumerate(slots):
        if slot >= 0:
            pool_one[slot] = in_layout(s_start[n], layout).to(dtype)
    o_one, _ = cula_aot.kda_prefill(
        *args,
        **options,
        initial_state=pool_one,
        output_final_state=True,
        state_indices=indices,
        state_layout=layout,
        cu_seqlens=cu.cuda(),
        cu_seqlens_cpu=cu,
    )
    o = torch.cat([p["o"] for p in parts], 1).cuda()
    assert torch.isfinite(o).all()
    err_o, vs_one_o = reference.rel_rmse(o, ref_o), reference.rel_rmse(o, o_one)
    err_s = vs_one_s = 0.0
    for rank, part in enumerate(parts):
        ends = [n for n in range(len(lengths)) if distributed.sequence_ranks(lengths, rank_tokens)[n][1] == rank]
        written = {slots[n]: n for n in ends if slots[n] >= 0}
        for slot, n in written.items():
            got = part["pool"][slot].cuda()
            err_s = max(err_s, reference.rel_rmse(in_layout(got.float(), layout), ref_s[n]))
            vs_one_s = max(vs_one_s, reference.rel_rmse(got.float(), pool_one[slot].float()))
        kept = [slot for slot in range(POOL_SLOTS) if slot not in written]
        assert torch.equal(bits(part["pool"][kept]), bits(part["before"][kept])), rank  # not this rank's to write
    print(
        f"CP pools over {len(rank_tokens)} processes, {gate}, {dtype} {layout}: o rel-RMSE {err_o:.2e}, "
        f"state {err_s:.2e}; against one prefill o {vs_one_o:.2e}, state {vs_one_s:.2e}"
    )
    # a bf16 pool rounds each written state once more: up to 2^-9 of each element
    assert err_o <= BOUND and err_s <= BOUND + (2**-8 if dtype == torch.bfloat16 else 0)

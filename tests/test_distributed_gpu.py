"""``cula_aot.distributed.kda_prefill_cp`` on the GPU: 2–4 processes on one device through the
gloo backend, the real kernels in every local pass, against the float64 reference and against
one ``kda_prefill`` of the whole batch (slow decay, poisoned outputs are not needed: every
output is a fresh tensor, checked finite)."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import cula_aot
from cula_aot import distributed, reference
from cula_aot.testing import cu_seqlens_of, fresh_seed, standard_inputs

pytestmark = pytest.mark.gpu
HEADS = 4
BOUND = 5e-3


def _worker(rank, world, init_file, seed, lengths, rank_tokens, gate, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        x = standard_inputs(1, sum(lengths), HEADS, device="cuda", seed=seed, slow_decay=True, gate=gate,
                            n_states=len(lengths), generator_device="cpu")
        options = {name: x[name] for name in ("A_log", "dt_bias", "lower_bound", "gate") if name in x}
        start = sum(rank_tokens[:rank])
        mine = [x[name][:, start:start + rank_tokens[rank]] for name in ("q", "k", "v", "g", "beta")]
        o, final = distributed.kda_prefill_cp(*mine, lengths=lengths, rank_tokens=rank_tokens,
                                              initial_state=x["initial_state"].transpose(-1, -2).contiguous(),
                                              output_final_state=True, **options)
        torch.cuda.synchronize()
        torch.save({"o": o.cpu(), "final": final.transpose(-1, -2).cpu()}, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("lengths, rank_tokens, gate", [
    ([4096], [2048, 2048], "safe"),
    ([3000], [1000, 1000, 1000], "softplus"),  # a middle rank
    ([700, 2500, 33, 900], [1100, 1100, 1033, 900], "safe"),  # varlen over four ranks
])
def test_split_over_processes_on_one_gpu(lengths, rank_tokens, gate):
    seed = fresh_seed()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(len(rank_tokens), os.path.join(tmp, "pg"), seed, lengths, rank_tokens, gate, tmp),
                 nprocs=len(rank_tokens), join=True)
        parts = [torch.load(os.path.join(tmp, f"{r}.pt")) for r in range(len(rank_tokens))]
    x = standard_inputs(1, sum(lengths), HEADS, device="cuda", seed=seed, slow_decay=True, gate=gate,
                        n_states=len(lengths), generator_device="cpu")
    options = {name: x[name] for name in ("A_log", "dt_bias", "lower_bound", "gate") if name in x}
    args = [x[name] for name in ("q", "k", "v", "g", "beta")]
    cu = cu_seqlens_of(lengths)
    o_one, s_one = cula_aot.kda_prefill(*args, **options, initial_state=x["initial_state"].transpose(-1, -2).contiguous(),
                                        output_final_state=True, cu_seqlens=cu.cuda(), cu_seqlens_cpu=cu)
    ref_o, ref_s = reference.kda_chunked(*args, A_log=x.get("A_log"), dt_bias=x.get("dt_bias"),
                                         lower_bound=x.get("lower_bound"), initial_state=x["initial_state"],
                                         cu_seqlens=cu, gate_kind=gate)
    o = torch.cat([p["o"] for p in parts], 1).cuda()
    final = sum(p["final"] for p in parts).cuda()  # each row written by exactly one rank
    assert torch.isfinite(o).all() and torch.isfinite(final).all()
    err_o, err_s = reference.rel_rmse(o, ref_o), reference.rel_rmse(final, ref_s)
    vs_one = reference.rel_rmse(o, o_one), reference.rel_rmse(final, s_one.transpose(-1, -2))
    print(f"CP over {len(rank_tokens)} processes, {gate}: o rel-RMSE {err_o:.2e}, state {err_s:.2e}; against one "
          f"prefill o {vs_one[0]:.2e}, state {vs_one[1]:.2e}")
    assert err_o <= BOUND and err_s <= BOUND

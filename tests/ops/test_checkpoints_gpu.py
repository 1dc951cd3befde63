"""Prefix-cache checkpoints on the GPU (``kda_prefill(checkpoint_every=...)``): in every path
(K1 + K2 at 32 and 64 columns, the fused kernel, intracard CP), fp32 and bf16 pools, both
layouts, the safe and the softplus gate (each with its own fused twin), slow decay.

A checkpoint at token t must be the final state of a prefill of the first t tokens: bitwise
where that prefill runs the same path (the serial ones), and within the float64 bound where it
does not (CP, whose segments fall elsewhere).  The pool is poisoned (NaN) and every slot not
named is checked bitwise untouched; o and the final state must be bitwise those of the same call
without checkpoints.  Chunked prefill with ``checkpoint_offsets`` must give the checkpoints of
one whole call; misaligned offsets and slots outside the pool are reported and write nothing.
"""

import pytest
import torch

import cula_aot
from cula_aot import reference
from cula_aot.layout import STATUS_CHECKPOINT_MISALIGNED, STATUS_SLOT_OUT_OF_RANGE, checkpoint_tiles
from cula_aot.ops.prefill import prefill
from tests.helpers import bits, cu_seqlens_of, fresh_seed, in_layout, standard_inputs

pytestmark = pytest.mark.gpu

BOUND = 5e-3
HEADS = 4
# Each path's options; "cp" splits the sequences into four segments.
PATHS = {
    "k2_32": dict(intracard_cp=False, fused=False, v_block=32),
    "k2_64": dict(intracard_cp=False, fused=False, v_block=64),
    "fused": dict(intracard_cp=False, fused=True),
    "cp": dict(intracard_cp=4),
}


def _args(x):
    return x["q"], x["k"], x["v"], x["g"], x["beta"]


def _gate(x):
    """The gate's arguments (no lower bound under the softplus gate)."""
    return {
        "A_log": x["A_log"],
        "dt_bias": x["dt_bias"],
        "lower_bound": x.get("lower_bound"),
        "gate": x.get("gate", "safe"),
    }


def _poisoned_pool(slots, dtype):
    """A NaN pool whose slots are one head apart more than packed."""
    return torch.full((slots, HEADS + 1, 128, 128), float("nan"), device="cuda", dtype=dtype)[:, :HEADS]


def _schedule(lengths, every, offsets=None, columns=None):
    """[(sequence, column, tokens into this call)] of every checkpoint the call writes."""
    out = []
    for n, length in enumerate(lengths):
        offset = 0 if offsets is None else offsets[n]
        for tile, column in checkpoint_tiles(length, offset, 0, every, columns or 1 << 30):
            out.append((n, column, (tile + 1) * 16))
    return out


def _prefix_batch(x, lengths, prefixes, s0):
    """The prefixes (sequence n's first t tokens, from its initial state) as one varlen batch."""
    starts = cu_seqlens_of(lengths).tolist()
    rows = torch.cat([torch.arange(starts[n], starts[n] + t) for n, t in prefixes]).cuda()
    inputs = [a[:, rows] for a in _args(x)]
    return inputs, cu_seqlens_of([t for _, t in prefixes]), s0[[n for n, _ in prefixes]]


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["vk", "kv"])
@pytest.mark.parametrize("gate", ["safe", "softplus"])
def test_checkpoints_are_prefix_final_states(path, dtype, layout, gate):
    every = 256 if path == "cp" else 64
    lengths = [3000, 40, 2100, 300] if path == "cp" else [700, 33, 1, 260]
    x = standard_inputs(1, sum(lengths), HEADS, device="cuda", slow_decay=True, n_states=len(lengths), gate=gate)
    cu = cu_seqlens_of(lengths)
    s0 = x["initial_state"]
    schedule = _schedule(lengths, every)
    columns = max(c for _, c, _ in schedule)  # the longest sequence's last checkpoint: j >= M, skipped
    gen = torch.Generator().manual_seed(fresh_seed())
    slots = len(schedule) + 3
    perm = torch.randperm(slots, generator=gen).tolist()
    indices = torch.full((len(lengths), columns), -1, dtype=torch.int32)
    named = {}
    for i, (n, c, t) in enumerate(schedule):
        if c < columns and i % 5 != 3:  # some -1 entries
            indices[n, c] = perm[i]
            named[perm[i]] = (n, t)
    pool = _poisoned_pool(slots, dtype)
    before = pool._base.clone()  # the padding head too
    status = torch.zeros(1, dtype=torch.int32, device="cuda")
    common = dict(
        **_gate(x),
        initial_state=in_layout(s0, layout).contiguous(),
        output_final_state=True,
        cu_seqlens=cu.cuda(),
        cu_seqlens_cpu=cu,
        state_layout=layout,
        **PATHS[path],
    )
    o, final = prefill(
        *_args(x),
        **common,
        status=status,
        checkpoint_every=every,
        checkpoint_pool=pool,
        checkpoint_indices=indices.cuda(),
    )
    o_plain, final_plain = prefill(*_args(x), **common)
    torch.cuda.synchronize()
    assert int(status.item()) == 0
    assert torch.equal(bits(o), bits(o_plain)) and torch.equal(bits(final), bits(final_plain))
    untouched = [s for s in range(slots) if s not in named]
    assert torch.equal(bits(pool[untouched]), bits(before[untouched][:, :HEADS]))
    assert torch.equal(bits(pool._base[:, HEADS]), bits(before[:, HEADS])), "padding written"

    # The same path's prefill of each prefix: bitwise on the serial paths.
    prefixes = list(named.values())
    inputs, cu_p, s0_p = _prefix_batch(x, lengths, prefixes, s0)
    _, final_p = prefill(
        *inputs,
        **{
            **common,
            "initial_state": in_layout(s0_p, layout).contiguous(),
            "cu_seqlens": cu_p.cuda(),
            "cu_seqlens_cpu": cu_p,
        },
    )
    got = pool[list(named)]
    if path != "cp":
        assert torch.equal(bits(got), bits(final_p.to(dtype))), path
    # And float64 on every path.
    _, ref = reference.kda_chunked(
        *inputs,
        A_log=x["A_log"],
        dt_bias=x["dt_bias"],
        lower_bound=x.get("lower_bound"),
        initial_state=s0_p,
        cu_seqlens=cu_p.cuda(),
        gate_kind=gate,
    )
    err = reference.rel_rmse(in_layout(got.float(), layout), ref)
    vs_prefix = reference.rel_rmse(got.float(), final_p.to(dtype).float())
    print(
        f"checkpoints {gate} {path} {dtype} {layout}: {len(named)} written, rel-RMSE vs float64 {err:.2e}, "
        f"vs the prefix prefill {vs_prefix:.2e}"
    )
    assert err <= BOUND + (2**-8 if dtype == torch.bfloat16 else 0)


@pytest.mark.parametrize("path", ["k2_32", "fused", "cp"])
def test_chunked_prefill_with_offsets_matches_one_call(path):
    """Two chunks of each request, the second from the first's final state in an fp32 pool and its
    offsets: the checkpoints land where one call over the whole requests puts them."""
    every = 128
    lengths, cut = ([2600, 900], [1024, 448]) if path == "cp" else ([1000, 530], [400, 256])
    x = standard_inputs(1, sum(lengths), HEADS, device="cuda", slow_decay=True)
    whole_schedule = _schedule(lengths, every)
    columns = max(c for _, c, _ in whole_schedule) + 1
    slot_of = {(n, c): i for i, (n, c, _) in enumerate(whole_schedule)}
    whole_indices = torch.full((2, columns), -1, dtype=torch.int32)
    for (n, c), slot in slot_of.items():
        whole_indices[n, c] = slot
    options = dict(**_gate(x), state_layout="vk", **PATHS[path])
    cu = cu_seqlens_of(lengths)
    whole_pool = _poisoned_pool(len(slot_of), torch.float32)
    prefill(
        *_args(x),
        **options,
        cu_seqlens=cu.cuda(),
        cu_seqlens_cpu=cu,
        checkpoint_every=every,
        checkpoint_pool=whole_pool,
        checkpoint_indices=whole_indices.cuda(),
    )

    starts = cu.tolist()
    chunk_pool = _poisoned_pool(len(slot_of), torch.float32)
    states = torch.zeros(2, HEADS, 128, 128, device="cuda")
    for part, offsets in ((0, [0, 0]), (1, cut)):
        spans = [
            (starts[n] + (0 if part == 0 else cut[n]), starts[n] + (cut[n] if part == 0 else lengths[n]))
            for n in range(2)
        ]
        rows = torch.cat([torch.arange(a, b) for a, b in spans]).cuda()
        chunk_lengths = [b - a for a, b in spans]
        # This call's columns: its j-th checkpoint is the request's (columns before the chunk) + j.
        done = [sum(1 for m, _, t in whole_schedule if m == n and t <= offsets[n]) for n in range(2)]
        chunk_indices = torch.full((2, columns), -1, dtype=torch.int32)
        for n in range(2):
            for j in range(columns - done[n]):
                chunk_indices[n, j] = slot_of.get((n, done[n] + j), -1)
        cu_c = cu_seqlens_of(chunk_lengths)
        status = torch.zeros(1, dtype=torch.int32, device="cuda")
        prefill(
            *[a[:, rows] for a in _args(x)],
            **options,
            cu_seqlens=cu_c.cuda(),
            cu_seqlens_cpu=cu_c,
            initial_state=states,
            final_state=states,
            state_indices=torch.arange(2, dtype=torch.int32).cuda(),
            status=status,
            checkpoint_every=every,
            checkpoint_pool=chunk_pool,
            checkpoint_indices=chunk_indices.cuda(),
            checkpoint_offsets=torch.tensor(offsets, dtype=torch.int32).cuda(),
        )
        assert int(status.item()) == 0
    torch.cuda.synchronize()
    assert not torch.isnan(whole_pool).any() and not torch.isnan(chunk_pool).any()
    diff = reference.rel_rmse(chunk_pool, whole_pool)
    print(f"chunked checkpoints {path}: {len(slot_of)} slots, rel-RMSE vs one call {diff:.2e}")
    if path == "cp":  # segments fall differently in the chunks
        assert diff <= BOUND
    else:  # tiles fall on the same tokens, the chunk's start state is the fp32 state
        assert torch.equal(bits(chunk_pool), bits(whole_pool))


@pytest.mark.parametrize("path", ["k2_32", "fused", "cp"])
def test_misaligned_offsets_and_bad_slots_are_reported(path):
    lengths = [1200, 600] if path == "cp" else [300, 300]
    every = 64
    x = standard_inputs(1, sum(lengths), HEADS, device="cuda")
    pool = _poisoned_pool(8, torch.bfloat16)
    before = pool.clone()
    indices = torch.tensor([[0, 1, 2, 3], [4, 1 << 20, -7, 5]], dtype=torch.int32).cuda()
    offsets = torch.tensor([8, 0], dtype=torch.int32).cuda()  # sequence 0 misaligned: none of its slots
    status = torch.zeros(1, dtype=torch.int32, device="cuda")
    cu = cu_seqlens_of(lengths)
    prefill(
        *_args(x),
        **_gate(x),
        cu_seqlens=cu.cuda(),
        cu_seqlens_cpu=cu,
        status=status,
        checkpoint_every=every,
        checkpoint_pool=pool,
        checkpoint_indices=indices,
        checkpoint_offsets=offsets,
        **PATHS[path],
    )
    torch.cuda.synchronize()
    assert int(status.item()) == STATUS_CHECKPOINT_MISALIGNED | STATUS_SLOT_OUT_OF_RANGE
    assert torch.equal(bits(pool[[0, 1, 2, 3, 6, 7]]), bits(before[[0, 1, 2, 3, 6, 7]]))
    assert not torch.isnan(pool[[4, 5]]).any()


def test_graph_replay_follows_the_indices_and_the_op_and_fwd_agree():
    lengths = [600, 130]
    every = 128
    x = standard_inputs(1, sum(lengths), HEADS, device="cuda", slow_decay=True)
    cu = cu_seqlens_of(lengths).cuda()
    pool = torch.zeros(12, HEADS, 128, 128, device="cuda")
    indices = torch.tensor([[0, 1, 2, 3], [4, -1, -1, -1]], dtype=torch.int32, device="cuda")
    out = torch.empty_like(x["v"])
    kwargs = dict(
        **_gate(x), cu_seqlens=cu, out=out, checkpoint_every=every, checkpoint_pool=pool, checkpoint_indices=indices
    )
    cula_aot.kda_prefill(*_args(x), **kwargs)  # warm: plans and kernels
    expect = pool[[0, 1, 2, 3, 4]].clone()
    pool.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cula_aot.kda_prefill(*_args(x), **kwargs)
    indices.copy_(torch.tensor([[7, 8, 9, 10], [11, -1, -1, -1]], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(bits(pool[[7, 8, 9, 10, 11]]), bits(expect))
    assert not pool[:7].any()

    # fwd and the pool op write the same checkpoints.
    for run in ("fwd", "op"):
        pool.zero_()
        states = torch.zeros(2, HEADS, 128, 128, device="cuda")
        slots = torch.arange(2, dtype=torch.int32, device="cuda")
        if run == "fwd":
            cula_aot.fwd(
                *_args(x),
                None,
                torch.empty_like(x["v"]),
                x["A_log"],
                x["dt_bias"],
                x["lower_bound"],
                cu_seqlens=cu,
                checkpoint_every=every,
                checkpoint_pool=pool,
                checkpoint_indices=indices,
            )
        else:
            torch.ops.cula_aot.kda_prefill_pool(
                *_args(x),
                x["A_log"],
                x["dt_bias"],
                x["lower_bound"],
                states,
                slots,
                cu_seqlens=cu,
                checkpoint_every=every,
                checkpoint_pool=pool,
                checkpoint_indices=indices,
            )
        torch.cuda.synchronize()
        assert torch.equal(bits(pool[[7, 8, 9, 10, 11]]), bits(expect)), run

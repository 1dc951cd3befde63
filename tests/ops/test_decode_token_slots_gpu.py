"""kda_decode with per-token state slots (vLLM's speculative-decoding contract) on the GPU.

``state_indices`` is int32 ``[N, T]``: sequence n reads its state from slot
``state_indices[n, c]`` (c = ``num_accepted[n] − 1``, clamped to [0, T−1], or 0 without
``num_accepted``) and writes the state after token t to slot ``state_indices[n, t]`` (skipped
for a slot outside the pool); a read slot outside the pool makes the row padding.  Every case
draws fresh inputs (token-strided views of one fused projection), NaN-poisons ``out``, and uses
a pool with spare slots; the bound is CONTRACT §8's 1e-2 against the float64 recurrence.
"""

import pytest
import torch

import cula_aot
from cula_aot import reference
from cula_aot.errors import KDAInputError
from cula_aot.layout import STATUS_DRAFT_OUT_OF_RANGE, STATUS_SLOT_OUT_OF_RANGE
from cula_aot.ops.decode import decode
from cula_aot.specs import DECODE_CHUNK_VARIANTS, DECODE_VARIANTS
from tests.decode_helpers import decode_reference, from_pool_layout, fused_inputs
from tests.helpers import bits, fresh_seed

pytestmark = pytest.mark.gpu

BOUND = 1e-2
D = 128
TOKEN_INPUTS = ("q", "k", "v", "g", "beta")
VARIANTS = list(DECODE_VARIANTS)


def _pool(slots, heads, dtype, *, pad=0, guard=0, seed=0):
    """A pool of ``slots`` 0.1·N(0,1) states, each slot padded by ``pad`` elements, cut from a
    buffer of ``slots + guard`` slots: returns (pool, buffer), so that a store past the pool's end
    shows up in the buffer's guard slots."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    per_slot = heads * D * D
    total = slots + guard
    storage = torch.empty(total * (per_slot + pad), device="cuda", dtype=dtype)
    buffer = storage.as_strided((total, heads, D, D), (per_slot + pad, D * D, D, 1))
    buffer.copy_((0.1 * torch.randn(total, heads, D, D, generator=gen, device="cuda")).to(dtype))
    return buffer[:slots], buffer


def _slot_table(n, tokens, slots, gen):
    """int32 ``[N, T]`` (CPU) of N·T distinct slots out of ``slots``; the others stay spare."""
    return torch.randperm(slots, generator=gen)[: n * tokens].view(n, tokens).to(torch.int32)


def _accepted(n, tokens, gen):
    """vLLM's accepted-token counts, 1..T per sequence (CPU int32)."""
    return torch.randint(1, tokens + 1, (n,), generator=gen, dtype=torch.int32)


def _at_offset(t, offset):
    """``t`` (CPU int32) on the GPU as a view ``offset`` elements into a buffer of -7s."""
    buffer = torch.full((offset + t.numel() + 3,), -7, dtype=torch.int32, device="cuda")
    view = buffer[offset : offset + t.numel()].view(t.shape)
    view.copy_(t)
    return view


def _gate_args(x, gate):
    if gate == "softplus":
        return dict(gate="softplus", A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=None)
    return dict(gate="safe", A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=x["lower_bound"])


def _inputs(n, tokens, heads, seed, *, slow_decay=False):
    x = fused_inputs(n, tokens, heads, device="cuda", seed=seed)
    if slow_decay:  # α ≈ 1: the read slot's state and every earlier token's update survive each step
        x.update(A_log=torch.full((heads,), -4.0, device="cuda"), lower_bound=-0.05)
    return x


def _call(x, gate_args, pool, table, *, layout, accepted=None, variant=None, **kw):
    return decode(
        *(x[name] for name in TOKEN_INPUTS),
        **gate_args,
        state_pool=pool,
        state_indices=table,
        num_accepted=accepted,
        state_layout=layout,
        variant=variant,
        **kw,
    )


def _verify(x, gate_args, out, pool, before, table, cols, layout, report):
    """Outputs and pool after a call against the float64 recurrence started from each row's read
    slot ``table[n, cols[n]]`` (``before``: the pool before the call; ``table``/``cols`` on the CPU,
    as passed): valid rows' outputs within BOUND and finite, padding rows' outputs zero, the state
    after token t in slot ``table[n, t]`` within BOUND per slot, every other slot bitwise
    unchanged.  Returns the report with the errors."""
    n, tokens = table.shape
    slots = pool.shape[0]
    read = table[torch.arange(n), cols.long()].long()
    valid = [i for i in range(n) if 0 <= read[i] < slots]
    padding = [i for i in range(n) if i not in valid]
    s0 = from_pool_layout(before[read[valid]].to(torch.float64), layout)
    ref_o, ref_s = decode_reference(**{name: x[name][valid] for name in TOKEN_INPUTS}, **gate_args, initial_state=s0)
    assert torch.isfinite(out[valid]).all(), f"{report}: unwritten or non-finite output"
    err_o = reference.rel_rmse(out[valid], ref_o)
    if padding:
        assert bool((out[padding] == 0).all()), f"{report}: padding rows' outputs are not zero"
    writes = [(int(table[i, t]), j, t) for j, i in enumerate(valid) for t in range(tokens) if 0 <= table[i, t] < slots]
    err_s = 0.0
    for slot, j, t in writes:
        err_s = max(err_s, reference.rel_rmse(from_pool_layout(pool[slot], layout), ref_s[j, t]))
    report += f": o rel-RMSE {err_o:.2e}, worst written slot rel-RMSE {err_s:.2e} ({len(writes)} slots)"
    written = {slot for slot, _, _ in writes}
    untouched = [s for s in range(slots) if s not in written]
    assert torch.equal(bits(pool[untouched]), bits(before[untouched])), f"{report}: a slot no token writes changed"
    print(report)
    assert err_o <= BOUND and err_s <= BOUND, report
    return report


def _run_case(
    n,
    tokens,
    heads,
    dtype,
    layout,
    *,
    variant=None,
    pad=0,
    padding=(),
    skipped=(),
    gate="safe",
    slow_decay=False,
    accepted=True,
    index_offset=0,
    label="",
):
    """One 2-D call: ``padding`` rows get read slot -1 (their other columns keep real slots, which
    must stay untouched), ``skipped`` rows get write slot -1 in a column other than their read one.
    ``index_offset``: the table and the counts start that many int32 elements into larger buffers
    (their pointers off 16-byte boundaries: the kernel adds the element offset on the device).
    A status word is passed and must stay clear (-1 is never reported)."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    x = _inputs(n, tokens, heads, seed, slow_decay=slow_decay)
    gate_args = _gate_args(x, gate)
    slots = n * tokens + 5
    pool, _ = _pool(slots, heads, dtype, pad=pad, seed=seed + 1)
    table = _slot_table(n, tokens, slots, gen)
    counts = _accepted(n, tokens, gen)
    cols = counts - 1 if accepted else torch.zeros(n, dtype=torch.int32)
    for i in padding:
        table[i, int(cols[i])] = -1
    for i in skipped:
        if tokens > 1:
            table[i, (int(cols[i]) + 1) % tokens] = -1
    before = pool.clone()
    out = torch.full((n, tokens, heads, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    status = torch.zeros(1, dtype=torch.int32, device="cuda")
    o = _call(
        x,
        gate_args,
        pool,
        _at_offset(table, index_offset),
        layout=layout,
        accepted=_at_offset(counts, index_offset) if accepted else None,
        variant=variant,
        out=out,
        status=status,
    )
    torch.cuda.synchronize()
    assert o.data_ptr() == out.data_ptr()
    report = f"token slots {label} seed={seed}"
    assert int(status.item()) == 0, f"{report}: status {int(status.item())} for in-range counts and -1 slots"
    return _verify(x, gate_args, out, pool, before, table, cols, layout, report)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["vk", "kv"])
def test_every_variant_writes_each_token_state(variant, dtype, layout):
    """Every (v_block, items) kernel, both pool dtypes and layouts, T = 1, 3 and 8 (a padded slot
    stride at T = 8, index tables 12 bytes off a 16-byte boundary at T = 3): a padding row and a
    row with a skipped write slot."""
    for tokens in (1, 3, 8):
        _run_case(
            6,
            tokens,
            8,
            dtype,
            layout,
            variant=variant,
            pad=8 if tokens == 8 else 0,
            padding=(4,),
            skipped=(1,),
            index_offset=3 if tokens == 3 else 0,
            label=f"variant={variant} T={tokens} {str(dtype)[6:]} {layout}",
        )


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_slow_decay_every_variant(variant, tokens):
    """Slow decay (A_log = −4, lower_bound = −0.05): the read slot's state stays in every output
    and every written state, so reading the wrong column cannot hide behind the decay."""
    for dtype, layout in ((torch.bfloat16, "vk"), (torch.float32, "kv")):
        _run_case(
            7,
            tokens,
            8,
            dtype,
            layout,
            variant=variant,
            pad=4 if dtype == torch.float32 else 0,
            padding=(0,),
            skipped=(3, 6),
            slow_decay=True,
            label=f"slow decay variant={variant} T={tokens} {str(dtype)[6:]} {layout}",
        )


@pytest.mark.parametrize("slow_decay", [False, True])
@pytest.mark.parametrize("variant", VARIANTS)
def test_softplus_gate(variant, slow_decay):
    """fla's unbounded gate, standard draws and slow decay (A_log = −4: α ≈ 0.99)."""
    for dtype, layout in ((torch.float32, "vk"), (torch.bfloat16, "kv")):
        _run_case(
            5,
            5,
            4,
            dtype,
            layout,
            variant=variant,
            padding=(2,),
            skipped=(0,),
            gate="softplus",
            slow_decay=slow_decay,
            label=f"softplus slow={slow_decay} variant={variant} {str(dtype)[6:]} {layout}",
        )


DEFAULT_PICK_CASES = [  # (N, T, H, pool dtype, layout, num_accepted given)
    (3, 2, 8, torch.bfloat16, "vk", True),  # where plain decode would pick the chunk kernel
    (9, 4, 16, torch.bfloat16, "vk", False),
    (33, 3, 64, torch.bfloat16, "vk", True),
    (64, 1, 32, torch.float32, "kv", True),
    (16, 8, 4, torch.float32, "vk", False),
    (40, 2, 1, torch.bfloat16, "kv", True),
]


@pytest.mark.parametrize("case", range(len(DEFAULT_PICK_CASES)))
def test_default_variant(case):
    """variant=None (kda_decode's own pick) over batch and head counts that select each kernel
    form, including bf16 "vk" pools at T = 2..4 (the chunk kernel's ground for 1-D indices)."""
    n, tokens, heads, dtype, layout, accepted = DEFAULT_PICK_CASES[case]
    _run_case(
        n,
        tokens,
        heads,
        dtype,
        layout,
        padding=(n - 1,),
        skipped=(0,),
        accepted=accepted,
        slow_decay=case % 2 == 0,
        label=f"default pick N={n} T={tokens} H={heads} {str(dtype)[6:]} {layout} accepted={accepted}",
    )


@pytest.mark.parametrize("accepted", [False, True])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["vk", "kv"])
def test_equals_plain_decode_with_intermediates(layout, dtype, variant, accepted):
    """A 2-D call is bitwise a plain call from the read slots (``state_indices[n, c]``) with
    intermediate states, by the same kernel variant: the same outputs, slot ``state_indices[n, t]``
    holds intermediate t, and no other slot changes."""
    n, heads = 5, 8
    for tokens in (1, 4, 8):
        seed = fresh_seed()
        gen = torch.Generator().manual_seed(seed)
        x = _inputs(n, tokens, heads, seed, slow_decay=True)
        gate_args = _gate_args(x, "safe")
        slots = n * tokens + 3
        pool, _ = _pool(slots, heads, dtype, pad=8 if tokens == 4 else 0, seed=seed + 1)
        plain_pool, _ = _pool(slots, heads, dtype, pad=8 if tokens == 4 else 0, seed=seed + 1)
        table = _slot_table(n, tokens, slots, gen)
        counts = _accepted(n, tokens, gen)
        cols = counts - 1 if accepted else torch.zeros(n, dtype=torch.int32)
        table[3, int(cols[3])] = -1  # a padding row
        read = table[torch.arange(n), cols.long()]
        before = pool.clone()
        out = torch.full((n, tokens, heads, D), float("nan"), device="cuda", dtype=torch.bfloat16)
        plain_out = out.clone()
        inter = torch.full((n, tokens, heads, D, D), float("nan"), device="cuda", dtype=dtype)
        _call(
            x,
            gate_args,
            pool,
            table.cuda(),
            layout=layout,
            accepted=counts.cuda() if accepted else None,
            variant=variant,
            out=out,
        )
        decode(
            *(x[name] for name in TOKEN_INPUTS),
            **gate_args,
            state_pool=plain_pool,
            state_indices=read.cuda(),
            state_layout=layout,
            variant=variant,
            out=plain_out,
            intermediate_states=inter,
        )
        torch.cuda.synchronize()
        report = f"2-D vs plain+intermediates variant={variant} T={tokens} {str(dtype)[6:]} {layout} seed={seed}"
        assert torch.equal(bits(out), bits(plain_out)), f"{report}: outputs differ"
        rows, steps = zip(*[(i, t) for i in range(n) if i != 3 for t in range(tokens)])
        written = table[list(rows), list(steps)].long()
        assert torch.equal(bits(pool[written]), bits(inter[list(rows), list(steps)])), f"{report}: slot != intermediate"
        untouched = [s for s in range(slots) if s not in set(written.tolist())]
        assert torch.equal(bits(pool[untouched]), bits(before[untouched])), f"{report}: an unwritten slot changed"


@pytest.mark.parametrize("variant", VARIANTS)
def test_hostile_counts_and_slots(variant):
    """num_accepted of 0, T + 3, INT32_MIN and INT32_MAX set ``STATUS_DRAFT_OUT_OF_RANGE`` and read
    the clamped column (0, T − 1, 0, T − 1); a write slot of slots + 7 sets ``STATUS_SLOT_OUT_OF_RANGE`` and stores
    nothing (the guard slots past the pool stay bitwise the same); a read slot past the pool makes
    its row padding.  Each anomaly alone, so each bit is attributed."""
    n, tokens, heads, dtype, layout = 5, 4, 8, torch.float32, "vk"
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    x = _inputs(n, tokens, heads, seed, slow_decay=True)
    gate_args = _gate_args(x, "safe")
    slots = n * tokens + 4
    table = _slot_table(n, tokens, slots, gen)

    def run(counts, cols, table, label):
        pool, buffer = _pool(slots, heads, dtype, guard=10, seed=seed + 1)
        before, guard_before = pool.clone(), buffer[slots:].clone()
        out = torch.full((n, tokens, heads, D), float("nan"), device="cuda", dtype=torch.bfloat16)
        status = torch.zeros(1, dtype=torch.int32, device="cuda")
        _call(
            x,
            gate_args,
            pool,
            table.cuda(),
            layout=layout,
            accepted=counts.cuda(),
            variant=variant,
            out=out,
            status=status,
        )
        torch.cuda.synchronize()
        report = f"hostile {label} variant={variant} seed={seed}"
        assert torch.equal(bits(buffer[slots:]), bits(guard_before)), f"{report}: a store landed past the pool"
        _verify(x, gate_args, out, pool, before, table, cols, layout, report)
        return int(status.item())

    counts = torch.tensor([0, tokens + 3, -(2**31), 2, 2**31 - 1], dtype=torch.int32)
    cols = torch.tensor([0, tokens - 1, 0, 1, tokens - 1], dtype=torch.int32)
    assert run(counts, cols, table, "bad counts") == STATUS_DRAFT_OUT_OF_RANGE

    good = torch.tensor([1, 4, 2, 3, 2], dtype=torch.int32)
    bad_slot = table.clone()
    bad_slot[3, 0] = slots + 7  # row 3 reads column 2: only its token-0 store is out of range
    assert run(good, good - 1, bad_slot, "write slot past the pool") == STATUS_SLOT_OUT_OF_RANGE

    past = table.clone()
    past[1, 3] = slots + 2  # row 1's read slot (count 4): the whole row is padding
    status = run(good, good - 1, past, "read slot past the pool")
    assert status == STATUS_SLOT_OUT_OF_RANGE, f"status {status}"

    padded = table.clone()
    padded[1, 3] = -1  # row 1 is padding: its write slots are not examined (CONTRACT §10)
    padded[1, 0] = slots + 9
    assert run(good, good - 1, padded, "padding row with a write slot past the pool") == 0


def test_refusals_write_nothing():
    """num_accepted with 1-D indices, intermediate_states with 2-D ones, the chunk kernel forced on
    2-D indices, and malformed 2-D indices or counts are refused before anything is written."""
    n, tokens, heads = 4, 3, 8
    x = _inputs(n, tokens, heads, fresh_seed())
    gate_args = _gate_args(x, "safe")
    slots = n * tokens + 2
    table = _slot_table(n, tokens, slots, torch.Generator().manual_seed(0)).cuda()
    counts = torch.ones(n, dtype=torch.int32, device="cuda")
    wide = torch.zeros(n, 2 * tokens, dtype=torch.int32, device="cuda")
    wide[:, :tokens] = table
    inter = torch.zeros(n, tokens, heads, D, D, device="cuda", dtype=torch.bfloat16)
    cases = [
        ("num_accepted with 1-D indices", dict(state_indices=table[:, 0].contiguous())),
        ("intermediate_states with 2-D indices", dict(accepted=None, intermediate_states=inter)),
        ("intermediate_states with 2-D indices and counts", dict(intermediate_states=inter)),
        ("chunk variant on 2-D indices", dict(variant=("chunk", *DECODE_CHUNK_VARIANTS[0]))),
        ("int64 indices", dict(state_indices=table.long())),
        ("[N, T + 1] indices", dict(state_indices=torch.zeros(n, tokens + 1, dtype=torch.int32, device="cuda"))),
        ("rows not contiguous", dict(state_indices=wide[:, :tokens])),  # stride (2T, 1)
        ("int64 num_accepted", dict(accepted=counts.long())),
        ("num_accepted [N + 1]", dict(accepted=torch.ones(n + 1, dtype=torch.int32, device="cuda"))),
        ("num_accepted on the CPU", dict(accepted=counts.cpu())),
    ]
    for label, kw in cases:
        kw = {"state_indices": table, "accepted": counts, **kw}
        indices = kw.pop("state_indices")
        pool, _ = _pool(slots, heads, torch.bfloat16, seed=1)
        before = pool.clone()
        out = torch.full((n, tokens, heads, D), 7.0, device="cuda", dtype=torch.bfloat16)
        with pytest.raises(KDAInputError):
            _call(x, gate_args, pool, indices, layout="vk", out=out, **kw)
            pytest.fail(f"{label}: not refused")
        torch.cuda.synchronize()
        assert torch.equal(bits(pool), bits(before)) and bool((out == 7.0).all()), f"{label}: written before refusal"
        assert bool((inter == 0).all()), f"{label}: intermediate_states written"


def test_token_major_input():
    """q, k, v, g ``[N·T, H, 128]`` with ``num_tokens`` (vLLM's flat token batch) is bitwise the
    ``[N, T, H, 128]`` call: outputs and every slot."""
    n, tokens, heads, layout = 6, 3, 8, "kv"
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    x = _inputs(n, tokens, heads, seed)
    gate_args = _gate_args(x, "safe")
    slots = n * tokens + 4
    pool, _ = _pool(slots, heads, torch.float32, seed=seed + 1)
    flat_pool = pool.clone()
    table = _slot_table(n, tokens, slots, gen).cuda()
    counts = _accepted(n, tokens, gen).cuda()
    o = _call(x, gate_args, pool, table, layout=layout, accepted=counts)
    flat = {name: x[name].flatten(0, 1) for name in TOKEN_INPUTS}
    o_flat = _call(flat, gate_args, flat_pool, table, layout=layout, accepted=counts, num_tokens=tokens)
    torch.cuda.synchronize()
    assert o_flat.shape == (n * tokens, heads, D)
    assert torch.equal(bits(o_flat), bits(o.flatten(0, 1))) and torch.equal(bits(flat_pool), bits(pool))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_capture_and_replay_with_new_counts(dtype):
    """One captured kda_decode, replayed after new inputs, slot tables, pool contents and
    num_accepted values are copied into its buffers: bitwise an eager call on the same values, and
    right against the float64 recurrence (the counts are read on the device at every replay)."""
    n, tokens, heads, layout = 24, 4, 16, "vk"
    slots = n * tokens + 8
    seed = fresh_seed()
    x = _inputs(n, tokens, heads, seed, slow_decay=True)
    gate_args = _gate_args(x, "safe")
    pool, _ = _pool(slots, heads, dtype, seed=seed)
    table = _slot_table(n, tokens, slots, torch.Generator().manual_seed(seed)).cuda()
    counts = torch.ones(n, dtype=torch.int32, device="cuda")
    out = torch.empty(n, tokens, heads, D, device="cuda", dtype=torch.bfloat16)

    def step(state_pool, result=None):
        return cula_aot.kda_decode(
            *(x[name] for name in TOKEN_INPUTS),
            **gate_args,
            state_pool=state_pool,
            state_indices=table,
            num_accepted=counts,
            state_layout=layout,
            out=result,
        )

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(pool, out)  # warm-up: loads the kernel
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        step(pool, out)
    torch.cuda.synchronize()
    for trial in range(3):
        gen = torch.Generator().manual_seed(seed + 10 + trial)
        fresh = fused_inputs(n, tokens, heads, device="cuda", seed=seed + 20 + trial)
        for name in TOKEN_INPUTS + ("dt_bias",):
            x[name].copy_(fresh[name])
        new_table = _slot_table(n, tokens, slots, gen)
        new_counts = _accepted(n, tokens, gen)
        new_table[3, int(new_counts[3]) - 1] = -1  # a padding row
        table.copy_(new_table)
        counts.copy_(new_counts)
        pool.copy_(_pool(slots, heads, dtype, seed=seed + 30 + trial)[0])
        before = pool.clone()
        expect_pool = pool.clone()
        expect = step(expect_pool)
        graph.replay()
        torch.cuda.synchronize()
        report = f"graph replay {trial} {str(dtype)[6:]} seed={seed}"
        assert torch.equal(bits(out), bits(expect)), f"{report}: outputs differ from an eager call"
        assert torch.equal(bits(pool), bits(expect_pool)), f"{report}: pool differs from an eager call"
        _verify(x, gate_args, out, pool, before, new_table, new_counts - 1, layout, report)

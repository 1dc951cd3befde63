"""The cached fast paths (``ops.prefill_plans._SerialPlan``, ``_CPPlan``) on the CPU: a fake loader
over the real manifest records captures the packed parameter buffers, so the launch values, the
per-call re-checks and the plan cache are checked without a GPU."""

import struct
from types import SimpleNamespace

import pytest
import torch

import cula_aot
from cula_aot import KDAInputError, layout
from cula_aot.layout import (
    FLAG_BETA_PROBABILITY,
    FLAG_BF16_FINAL,
    FLAG_BF16_INIT,
    FLAG_FINAL_STATE,
    FLAG_INDEXED_FINAL,
    FLAG_INDEXED_INIT,
    FLAG_INITIAL_STATE,
    FLAG_LONGEST_FIRST,
    FLAG_QK_AS_GIVEN,
    FLAG_STATUS,
    FLAG_VARLEN,
)
from cula_aot.ops import cp_plan, paths, plan_cache, prefill_checks, prefill_plans, prepare
from cula_aot.ops import prefill as prefill_module
from cula_aot.runtime.loader import LoadedKernel
from cula_aot.runtime.manifest import Manifest
from tests.helpers import cu_seqlens_of, standard_inputs


class _Recorder:
    def __init__(self):
        self.launches = []
        self.zeroed = []  # (address, 32-bit words) of each device memset, in order

    def loader(self, manifest):
        recorder = self

        class FakeLoader:
            def get(self, device, spec):
                name, record = manifest.record(spec)
                kernel = LoadedKernel(name, record, function=None)
                kernel.launch_packed = lambda packed, grid, stream, smem_bytes=None, dependent=False: (
                    recorder.launches.append((kernel, packed, grid, dependent))
                )
                return kernel

        return FakeLoader()

    def values(self, index):
        kernel, packed, grid, _ = self.launches[index]
        decoded = kernel.packer.struct.unpack(packed)
        return kernel, dict(zip(kernel.packer.names, decoded)), grid


@pytest.fixture
def recorder(monkeypatch, manifest_path):
    rec = _Recorder()
    loader = rec.loader(Manifest(manifest_path) if not hasattr(Manifest, "discover") else Manifest.discover())
    # Each name patched on the module that looks it up: the loader in prefill (the entry resolves
    # the kernels), the device rule in prefill_checks, the stream in prefill_plans, the SM count
    # in prepare; a fresh plan cache.
    monkeypatch.setattr(prefill_module, "default_loader", lambda: loader)
    monkeypatch.setattr(prefill_checks, "check_device", lambda device: None)
    monkeypatch.setattr(prefill_plans, "_raw_stream", lambda device: 0)
    monkeypatch.setattr(
        prefill_plans, "_zero_words", lambda address, count, stream: rec.zeroed.append((address, count))
    )
    monkeypatch.setattr(prepare, "sm_count", lambda device: 132)
    monkeypatch.setattr(plan_cache, "PLANS", plan_cache.PlanCache())
    # TMA descriptors: a recognisable encoding of (address, dims, strides) instead of the driver's.
    from cula_aot.runtime import tma

    monkeypatch.setattr(
        tma,
        "_encode",
        lambda recipe, base, dims, strides, what: struct.pack("<QQQQQQ", base, *dims, *strides).ljust(128, b"\0"),
    )
    return rec


def _call(x, **kw):
    """``kda_prefill``, or with the path overrides (``fused``, ``v_block``) the internal entry."""
    kw.setdefault("lower_bound", x["lower_bound"])
    entry = prefill_module.prefill if "fused" in kw or "v_block" in kw else cula_aot.kda_prefill
    return entry(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"], **kw)


def test_repeated_signature_reuses_one_plan_with_per_call_pointers(recorder):
    heads = 4
    x = standard_inputs(1, 40, heads, seed=1)
    cu = cu_seqlens_of([7, 33])
    pool = torch.zeros(5, heads, 128, 128, dtype=torch.bfloat16)
    idx = torch.tensor([3, -1], dtype=torch.int32)
    # intracard_cp=False: with host lengths, "auto" decides per call from the values (no plan).
    o1, f1 = _call(
        x,
        cu_seqlens=cu,
        initial_state=pool,
        state_indices=idx,
        output_final_state=True,
        state_layout="kv",
        intracard_cp=False,
    )
    assert f1 is pool and len(plan_cache.PLANS) == 1
    y = standard_inputs(1, 40, heads, seed=2)  # new tensors, same signature
    o2, _ = _call(
        y,
        cu_seqlens=cu,
        initial_state=pool,
        state_indices=idx,
        output_final_state=True,
        state_layout="kv",
        intracard_cp=False,
        scale=0.5,
    )
    assert len(plan_cache.PLANS) == 1 and len(recorder.launches) == 4
    k1, v1, grid1 = recorder.values(2)
    k2, v2, grid2 = recorder.values(3)
    assert k1.name == "k1_prepare_varlen1_gatesafe" and k2.name.startswith("k2_recurrence_varlen1")
    total_slots = (40 + 15 * 2) // 16
    assert grid1 == (total_slots, heads, 1) and grid2[1:] == (heads, 2)
    assert v1["beta"] == y["beta"].data_ptr() and v1["scale"] == 0.5 and v1["cu_seqlens"] == cu.data_ptr()
    assert struct.unpack("<QQQQQQ", v1["tma_q"][:48]) == (y["q"].data_ptr(), 32, 40, heads * 4, heads * 256, 64)
    assert v1["beta_row_stride"] == heads and v1["total_slots"] == total_slots
    assert v2["v"] == y["v"].data_ptr() and v2["out"] == o2.data_ptr() and v2["state_indices"] == idx.data_ptr()
    assert v2["initial_state"] == v2["final_state"] == pool.data_ptr()
    assert (
        v2["flags"]
        == FLAG_INITIAL_STATE
        | FLAG_INDEXED_INIT
        | FLAG_FINAL_STATE
        | FLAG_INDEXED_FINAL
        | FLAG_BF16_INIT
        | FLAG_BF16_FINAL
        | FLAG_LONGEST_FIRST
    )
    assert (v2["init_stride_k"], v2["init_stride_v"], v2["init_slot_stride"]) == (128, 1, heads * 128 * 128)
    assert (v2["init_slots"], v2["final_slots"], v2["status"]) == (5, 5, 0)  # the pool bounds its indices
    # Same workspaces on both calls: the arena's cached addresses.
    assert recorder.values(1)[1]["workspace"] == v2["workspace"] and v1["workspace"] == v2["workspace"]
    # K1 waits for whatever ran before it; K2 starts as K1's programmatic dependent.
    assert [launch[3] for launch in recorder.launches] == [False, True, False, True]


def test_fused_plan_is_one_launch_with_the_inputs_descriptors_states_and_flags(recorder):
    from cula_aot.specs import fused_spec

    heads = 4
    x = standard_inputs(1, 40, heads, seed=1)
    cu = cu_seqlens_of([7, 33])
    pool = torch.zeros(5, heads, 128, 128, dtype=torch.bfloat16)
    idx = torch.tensor([3, -1], dtype=torch.int32)
    kw = dict(
        A_log=x["A_log"],
        dt_bias=x["dt_bias"],
        lower_bound=x["lower_bound"],
        cu_seqlens=cu,
        initial_state=pool,
        state_indices=idx,
        output_final_state=True,
        state_layout="kv",
        intracard_cp=False,
        fused=True,
    )
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    prefill_module.prefill(*args, **kw)
    o, f = prefill_module.prefill(*args, **kw, scale=0.5)
    assert f is pool and len(plan_cache.PLANS) == 1 and len(recorder.launches) == 2
    kernel, values, grid = recorder.values(1)
    assert kernel.name == fused_spec().name and grid == (1, heads, 2)
    assert kernel.block == (fused_spec().block[0], 1, 1)
    assert struct.unpack("<QQQQQQ", values["tma_g"][:48]) == (x["g"].data_ptr(), 32, 40, heads * 4, heads * 256, 64)
    assert values["beta"] == x["beta"].data_ptr() and values["beta_row_stride"] == heads and values["scale"] == 0.5
    assert values["v"] == x["v"].data_ptr() and values["out"] == o.data_ptr() and values["cu_seqlens"] == cu.data_ptr()
    assert (
        values["initial_state"] == values["final_state"] == pool.data_ptr()
        and values["state_indices"] == idx.data_ptr()
    )
    assert (
        values["flags"]
        == FLAG_INITIAL_STATE
        | FLAG_INDEXED_INIT
        | FLAG_FINAL_STATE
        | FLAG_INDEXED_FINAL
        | FLAG_BF16_INIT
        | FLAG_BF16_FINAL
        | FLAG_LONGEST_FIRST
        | FLAG_VARLEN
    )
    assert (values["init_stride_k"], values["init_stride_v"], values["seq_len"], values["num_seqs"]) == (128, 1, 40, 2)
    # No workspaces and no dependent launch: the fused kernel reads only the caller's tensors.
    assert recorder.launches[1][3] is False and "workspace" not in values
    # Fixed-length input runs the same kernel, rows of seq_len tokens: no FLAG_VARLEN.
    y = standard_inputs(2, 32, heads, seed=3)
    prefill_module.prefill(
        y["q"],
        y["k"],
        y["v"],
        y["g"],
        y["beta"],
        A_log=y["A_log"],
        dt_bias=y["dt_bias"],
        lower_bound=y["lower_bound"],
        intracard_cp=False,
        fused=True,
    )
    kernel, values, grid = recorder.values(2)
    assert kernel.name == fused_spec().name and grid == (1, heads, 2)
    assert values["flags"] & FLAG_VARLEN == 0 and (values["seq_len"], values["num_seqs"]) == (32, 2)


def test_k1_walks_several_tiles_per_cta_on_a_small_gpu(recorder, monkeypatch):
    from cula_aot.specs import k1_grid

    # One SM: 16 resident CTAs in K1_WAVES = 4 waves, so 56 tiles take 4 per CTA (K1 then K2:
    # on one SM the item count alone would pick the fused kernel).
    monkeypatch.setattr(prepare, "sm_count", lambda device: 1)
    monkeypatch.setattr(paths, "auto_fused", lambda heads, num_seqs, tokens, sm_count, uniform=False: False)
    heads = 4
    x = standard_inputs(1, 200, heads, seed=9)
    cu = cu_seqlens_of([90, 110])
    _call(x, cu_seqlens=cu, intracard_cp=False)
    k1, values, grid = recorder.values(0)
    total_slots = (200 + 15 * 2) // 16
    expected = k1_grid(total_slots, heads, 1)
    assert expected["tiles_per_cta"] == 4
    assert values["tiles_per_cta"] == 4 and grid == (expected["k1_ctas"], heads, 1) == (4, heads, 1)


@pytest.mark.parametrize("intracard_cp", [False, "auto"])
def test_a_varlen_batch_of_equal_tile_counts_runs_fused_and_each_call_takes_its_lengths_plan(
    recorder, monkeypatch, intracard_cp
):
    # 8 sequences x 2 heads on 16 SMs: one wave of 16-tile items, fused only when the lengths say
    # that no item outlasts the rest (a ragged batch of the same shape takes K1 then K2).
    monkeypatch.setattr(prepare, "sm_count", lambda device: 16)
    x = standard_inputs(1, 8 * 256, 2, seed=11)
    even, ragged = cu_seqlens_of([256] * 8), cu_seqlens_of([128] * 4 + [384] * 4)  # ragged, but not enough to split
    assert paths.equal_tile_counts(even.tolist()) and not paths.equal_tile_counts(ragged.tolist())
    assert paths.equal_tile_counts([0, 250, 506])  # 16 tiles each, unequal lengths
    validations = []
    real_validate = prefill_module.validate
    monkeypatch.setattr(prefill_module, "validate", lambda *a, **kw: validations.append(1) or real_validate(*a, **kw))
    seen = []
    for cu in (even, ragged, even, ragged):
        recorder.launches.clear()
        _call(x, cu_seqlens=cu, cu_seqlens_cpu=cu.clone(), intracard_cp=intracard_cp)
        seen.append([kernel.record["kernel"] for kernel, *_ in recorder.launches])
    assert seen == [["fused_prefill"], ["k1_prepare", "k2_recurrence"]] * 2, seen
    assert len(validations) == 2  # the last two calls ran from the plans their lengths picked
    # Without host lengths the batch may be ragged: K1 then K2.
    recorder.launches.clear()
    _call(x, cu_seqlens=even, check_seqlens="off", intracard_cp=intracard_cp)
    assert [kernel.record["kernel"] for kernel, *_ in recorder.launches] == ["k1_prepare", "k2_recurrence"]


def test_strided_views_and_a_new_signature_make_a_new_plan(recorder):
    heads, T = 2, 33
    x = standard_inputs(1, T, heads, seed=3)
    fused = torch.zeros(1, T, 4 * heads * 128 + 64, dtype=torch.bfloat16)
    views = {
        n: fused[..., i * heads * 128 : (i + 1) * heads * 128].unflatten(-1, (heads, 128))
        for i, n in enumerate(("q", "k", "v", "g"))
    }
    views["beta"] = fused[..., 4 * heads * 128 : 4 * heads * 128 + heads]
    _call({**x, **views})
    _call(x)
    assert len(plan_cache.PLANS) == 2
    _, v1, _ = recorder.values(0)
    _, v2, _ = recorder.values(1)
    row = fused.stride(1)
    assert struct.unpack("<QQQQQQ", v1["tma_k"][:48]) == (views["k"].data_ptr(), 32, T, heads * 4, 2 * row, 64)
    assert v1["beta_row_stride"] == row and v2["v_row_stride"] == row and v2["out_row_stride"] == heads * 128


def test_plan_hit_still_checks_addresses_and_scalars_before_launch(recorder):
    x = standard_inputs(1, 32, 2, seed=4)
    out = torch.empty_like(x["v"])
    _call(x, out=out)
    n = len(recorder.launches)
    with pytest.raises(KDAInputError, match="lower_bound must be in"):
        _call(x, out=out, lower_bound=0.5)
    with pytest.raises(KDAInputError, match="out must not alias an input"):
        _call(x, out=x["q"])
    shifted = torch.zeros(32 * 256 + 8, dtype=torch.bfloat16)[4 : 4 + 32 * 256].view(1, 32, 2, 128)
    shifted.copy_(x["k"])
    with pytest.raises(KDAInputError, match="k must start on a 16-byte boundary"):
        _call({**x, "k": shifted}, out=out)
    assert len(recorder.launches) == n and len(plan_cache.PLANS) == 1


def test_host_cu_seqlens_values_are_checked_on_every_call(recorder):
    x = standard_inputs(1, 40, 2, seed=5)
    cu = cu_seqlens_of([10, 30])
    _call(x, cu_seqlens=cu, cu_seqlens_cpu=cu.clone(), intracard_cp=False)
    with pytest.raises(KDAInputError, match="non-decreasing"):
        _call(x, cu_seqlens=cu, cu_seqlens_cpu=torch.tensor([0, 50, 40], dtype=torch.int32), intracard_cp=False)
    assert len(plan_cache.PLANS) == 1
    _call(x, cu_seqlens=cu, cu_seqlens_cpu=cu.clone())  # "auto" with host lengths: a plan of its own
    assert len(plan_cache.PLANS) == 2
    with pytest.raises(KDAInputError, match="non-decreasing"):  # its cached path checks the values too
        _call(x, cu_seqlens=cu, cu_seqlens_cpu=torch.tensor([0, 50, 40], dtype=torch.int32))


def test_auto_reuses_its_serial_plan_while_the_lengths_stay_serial(recorder, monkeypatch):
    # 4096 tokens in all at H4: [1024] * 4 stays serial, [16, 4080] splits.
    x = standard_inputs(1, 4096, 4, seed=6)
    serial_cu, split_cu = cu_seqlens_of([1024] * 4), cu_seqlens_of([16, 4080])
    assert paths.planned_split([1024] * 4, 4, None) == 1
    assert paths.planned_split([16, 4080], 4, None) > 1
    _call(x, cu_seqlens=serial_cu, cu_seqlens_cpu=serial_cu.clone())
    plan = plan_cache.PLANS.plans()[0]
    assert plan.split is None and len(recorder.launches) == 2  # re-planned per call
    validations = []
    real_validate = prefill_module.validate
    monkeypatch.setattr(prefill_module, "validate", lambda *a, **kw: validations.append(1) or real_validate(*a, **kw))
    _call(x, cu_seqlens=serial_cu, cu_seqlens_cpu=serial_cu.clone())
    assert not validations and len(recorder.launches) == 4  # the cached plan: K1, K2

    # Same signature, lengths that the planner splits: the full path plans CP for them (stopped
    # there: the CP launches need a GPU).
    class Planned(Exception):
        pass

    def plan_spy(seqs, s_split):
        raise Planned(s_split)

    monkeypatch.setattr(cp_plan, "plan", plan_spy)
    with pytest.raises(Planned) as planned:
        _call(x, cu_seqlens=split_cu, cu_seqlens_cpu=split_cu.clone())
    assert validations and planned.value.args[0] > 1
    assert plan_cache.PLANS.plans()[0] is plan


class _Tables:
    """SEGMENT_TABLES on the CPU: one int32 tensor per plan key, built once."""

    def __init__(self):
        self.entries = {}

    def get(self, key, build, device, stream):
        if key not in self.entries:
            self.entries[key] = torch.tensor(build(), dtype=torch.int32)
        return self.entries[key]


@pytest.fixture
def tables(recorder, monkeypatch):
    """The CP path on the CPU: fake segment tables and a current stream of raw address 0."""
    fake = _Tables()
    monkeypatch.setattr(prefill_plans, "SEGMENT_TABLES", fake)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=0))
    return fake


@pytest.fixture
def slow_path(monkeypatch):
    """Counts the full path's validations and CP plannings."""
    calls = {"validate": 0, "plan": 0}

    def counting(module, name):
        real = getattr(module, name)

        def spy(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)

    counting(prefill_module, "validate")
    counting(cp_plan, "plan")
    return calls


# The CP chain's per-call scratch buffers (pre_scan transition pairs, merged carries), by launch.
_SCRATCH = ({}, {"final_state"}, {"prescan", "carries"}, {"initial_state"})


def _cp_launches(recorder, first):
    """The four launches of one CP call from launch ``first``: (kernel name, grid, dependent,
    values without the scratch pointers), after checking the scratch buffers link them."""
    launches = [recorder.values(first + i) for i in range(4)]
    (_, prescan, _), (_, merge, _), (_, recurrence, _) = launches[1:]
    assert prescan["final_state"] == merge["prescan"] and merge["carries"] == recurrence["initial_state"]
    return [
        (
            kernel.name,
            grid,
            recorder.launches[first + i][3],
            {n: value for n, value in values.items() if n not in _SCRATCH[i]},
        )
        for i, (kernel, values, grid) in enumerate(launches)
    ]


_SPLIT, _OTHER_SPLIT, _SERIAL = [16, 4080], [32, 4064], [1024] * 4  # 4096 tokens at H4: s_split 8, 8, 1


@pytest.mark.parametrize("fixed", [False, True], ids=["varlen", "fixed"])
def test_repeated_cp_call_reuses_its_plan_and_packs_the_same_values(recorder, tables, slow_path, fixed):
    heads = 4
    x = standard_inputs(1, 8192 if fixed else 4096, heads, seed=11)
    out, final = torch.empty_like(x["v"]), torch.zeros(1 if fixed else 2, heads, 128, 128)
    cu = None if fixed else cu_seqlens_of(_SPLIT)
    lengths = {} if fixed else {"cu_seqlens": cu, "cu_seqlens_cpu": cu.clone()}
    _call(x, out=out, final_state=final, **lengths)
    assert slow_path == {"validate": 1, "plan": 1} and len(tables.entries) == 1
    _call(x, out=out, final_state=final, **lengths)
    assert slow_path == {"validate": 1, "plan": 1} and len(tables.entries) == 1  # the cached plan
    first, second = _cp_launches(recorder, 0), _cp_launches(recorder, 4)
    assert len(recorder.launches) == 8 and first == second
    names = [name for name, *_ in first]
    assert names[0].startswith("k1_prepare") and names[2].startswith("cp_merge")
    assert "prescan1" in names[1] and "segmented1_prescan0" in names[3]
    assert [dependent for _, _, dependent, _ in first] == [False, True, True, True]
    table = next(iter(tables.entries.values())).data_ptr()
    assert first[1][3]["segments"] == table and first[3][3]["out"] == out.data_ptr()
    assert first[3][3]["final_state"] == final.data_ptr()


def test_new_lengths_plan_again_with_their_own_tables(recorder, tables, slow_path):
    x = standard_inputs(1, 4096, 4, seed=12)
    out = torch.empty_like(x["v"])
    cus = {n: cu_seqlens_of(lengths) for n, lengths in enumerate((_SPLIT, _OTHER_SPLIT))}

    def call(lengths):
        cu = cus[lengths is _OTHER_SPLIT]
        n = len(recorder.launches)
        _call(x, cu_seqlens=cu, cu_seqlens_cpu=cu.clone(), out=out)
        return _cp_launches(recorder, n)

    a = call(_SPLIT)
    b = call(_OTHER_SPLIT)
    assert slow_path == {"validate": 2, "plan": 2} and len(tables.entries) == 2
    table_a, table_b = (t.data_ptr() for t in tables.entries.values())
    assert a[1][3]["segments"] == table_a and b[1][3]["segments"] == table_b
    host_cu = [0, *_OTHER_SPLIT[:1], 4096]
    want = prefill_plans._segment_tables(cp_plan.plan(cp_plan.sequences(1, 4096, host_cu), 8), 0, 0)
    rows = [v for row in want[0] + want[1] for v in row] + want[2]
    # Then the host lengths at the next 16-byte boundary: K1 reads those, not the device cu_seqlens.
    cu_at = 16 * -(-4 * len(rows) // 16)
    assert list(tables.entries.values())[1].tolist() == rows + [0] * (cu_at // 4 - len(rows)) + host_cu
    assert b[0][3]["cu_seqlens"] == table_b + cu_at
    # Both plans stay cached: the first lengths again are a hit on their own plan and table.
    assert call(_SPLIT) == a and slow_path["validate"] == 2


def test_cp_plan_hit_still_checks_scalars_and_addresses_before_launch(recorder, tables, slow_path):
    x = standard_inputs(1, 4096, 4, seed=13)
    cu, out = cu_seqlens_of(_SPLIT), torch.empty_like(x["v"])
    _call(x, cu_seqlens=cu, cu_seqlens_cpu=cu.clone(), out=out)
    n = len(recorder.launches)
    with pytest.raises(KDAInputError, match="lower_bound must be in"):
        _call(x, cu_seqlens=cu, cu_seqlens_cpu=cu.clone(), out=out, lower_bound=0.5)
    with pytest.raises(KDAInputError, match="out must not alias an input"):
        _call(x, cu_seqlens=cu, cu_seqlens_cpu=cu.clone(), out=x["q"])
    with pytest.raises(KDAInputError, match="non-decreasing"):
        _call(x, cu_seqlens=cu, cu_seqlens_cpu=torch.tensor([0, 4080, 16], dtype=torch.int32), out=out)
    # Every rejection came from the cached plans' per-call checks, before any launch.
    assert len(recorder.launches) == n and slow_path["validate"] == 1


@pytest.mark.parametrize("order", [(_SPLIT, _SERIAL), (_SERIAL, _SPLIT)], ids=["cp_first", "serial_first"])
def test_auto_switches_between_cached_serial_and_cp_plans(recorder, tables, slow_path, order):
    x = standard_inputs(1, 4096, 4, seed=14)
    kinds = []
    for lengths in order * 3:
        cu = cu_seqlens_of(lengths)
        n = len(recorder.launches)
        _call(x, cu_seqlens=cu, cu_seqlens_cpu=cu.clone())
        kinds.append(len(recorder.launches) - n)
    assert kinds == [4 if lengths is _SPLIT else 2 for lengths in order * 3]
    # One full path per kind of lengths, then the cached serial and CP plans alternate.
    assert slow_path == {"validate": 2, "plan": 1}
    assert len(tables.entries) == 1


def test_planned_split_searches_each_length_set_once(monkeypatch):
    monkeypatch.setattr(prepare, "sm_count", lambda device: 132)
    searches = []
    real = cp_plan.auto_split
    monkeypatch.setattr(cp_plan, "auto_split", lambda *a: searches.append(a) or real(*a))
    paths._cached_split.cache_clear()
    first = paths.planned_split([16, 4080], 4, None)
    assert paths.planned_split([16, 4080], 4, None) == first and len(searches) == 1
    assert paths.planned_split([1024] * 4, 4, None) == 1 and len(searches) == 2
    # A different GPU (SM count) is a different answer, so a different entry.
    monkeypatch.setattr(prepare, "sm_count", lambda device: 66)
    paths.planned_split([16, 4080], 4, None)
    assert len(searches) == 3


@pytest.mark.parametrize("fused", [False, True])
def test_a_status_word_is_passed_and_flagged_on_every_launch(recorder, fused):
    heads = 4
    x = standard_inputs(1, 40, heads, seed=21)
    pool = torch.zeros(3, heads, 128, 128)
    idx = torch.tensor([2, 0], dtype=torch.int32)
    status = torch.zeros(4, dtype=torch.int32)[:1]
    cula_aot.ops.prefill.prefill(
        x["q"],
        x["k"],
        x["v"],
        x["g"],
        x["beta"],
        A_log=x["A_log"],
        dt_bias=x["dt_bias"],
        lower_bound=x["lower_bound"],
        cu_seqlens=cu_seqlens_of([7, 33]),
        initial_state=pool,
        state_indices=idx,
        output_final_state=True,
        intracard_cp=False,
        fused=fused,
        status=status,
    )
    _, values, _ = recorder.values(len(recorder.launches) - 1)
    assert values["status"] == status.data_ptr() and values["flags"] & FLAG_STATUS
    assert (values["init_slots"], values["final_slots"]) == (3, 3)
    # Another signature without it: no word, no flag.
    cula_aot.ops.prefill.prefill(
        x["q"],
        x["k"],
        x["v"],
        x["g"],
        x["beta"],
        A_log=x["A_log"],
        dt_bias=x["dt_bias"],
        lower_bound=x["lower_bound"],
        cu_seqlens=cu_seqlens_of([7, 33]),
        output_final_state=True,
        intracard_cp=False,
        fused=fused,
    )
    _, values, _ = recorder.values(len(recorder.launches) - 1)
    assert values["status"] == 0 and not values["flags"] & FLAG_STATUS
    assert values["final_slots"] == 2  # the allocated final state: one slot per sequence


@pytest.mark.parametrize("path", ["serial", "cp", "auto"])
def test_input_conventions_reach_k1_and_key_the_plan(recorder, tables, slow_path, path):
    """The convention bits go to K1 (K2 and the CP kernels read only its records); "auto" on a
    shape the fused kernel would take runs it for the default conventions only."""
    batch, seq_len, heads = (8, 1024, 16) if path == "auto" else (1, 2048, 4)  # auto: a fused row of the benchmark
    x = standard_inputs(batch, seq_len, heads, seed=5)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    kw = dict(
        A_log=x["A_log"],
        dt_bias=x["dt_bias"],
        lower_bound=x["lower_bound"],
        output_final_state=True,
        intracard_cp=4 if path == "cp" else False,
        fused=None if path == "auto" else False,
    )
    seen = []
    for beta_sigmoid, qk_l2norm in [(True, True), (False, True), (True, False), (False, False), (True, True)]:
        first = len(recorder.launches)
        prefill_module.prefill(*args, **kw, beta_sigmoid=beta_sigmoid, qk_l2norm=qk_l2norm)
        kernel, values, _ = recorder.values(first)
        want = (0 if beta_sigmoid else FLAG_BETA_PROBABILITY) | (0 if qk_l2norm else FLAG_QK_AS_GIVEN)
        if path == "auto" and not want:
            assert kernel.name.startswith("fused_prefill")
            assert values["flags"] & (FLAG_BETA_PROBABILITY | FLAG_QK_AS_GIVEN) == 0
        else:
            assert kernel.name.startswith("k1_prepare") and values["flags"] == want
        seen.append(len(plan_cache.PLANS))
    assert seen[3] > seen[0] and seen[4] == seen[3]  # one plan per convention; the first one reused
    with pytest.raises(KDAInputError, match="beta_sigmoid must be True or False"):
        prefill_module.prefill(*args, **kw, beta_sigmoid=1)
    with pytest.raises(KDAInputError, match="qk_l2norm must be True or False"):
        prefill_module.prefill(*args, **kw, qk_l2norm=None)
    launches = len(recorder.launches)
    with pytest.raises(KDAInputError, match="the fused kernel runs beta as logits"):
        prefill_module.prefill(*args, **{**kw, "intracard_cp": False, "fused": True}, beta_sigmoid=False)
    assert len(recorder.launches) == launches


def test_fp32_gate_and_beta_reach_the_kernels_as_bf16(recorder):
    """vLLM-style: a precomputed fp32 log-decay and fp32 β probabilities; the kernels read bf16
    copies (one rounding each), and a bf16 call with those values launches identically."""
    heads = 2
    x = standard_inputs(1, 40, heads, seed=9)
    g = -torch.rand(1, 40, heads, 128) * 3
    beta = torch.rand(1, 40, heads)
    common = dict(
        A_log=None,
        dt_bias=None,
        lower_bound=None,
        gate="precomputed",
        beta_sigmoid=False,
        intracard_cp=False,
        fused=False,
    )
    prefill_module.prefill(x["q"], x["k"], x["v"], g, beta, **common)
    _, values, _ = recorder.values(0)
    prefill_module.prefill(x["q"], x["k"], x["v"], g.to(torch.bfloat16), beta.to(torch.bfloat16), **common)
    _, values_bf16, _ = recorder.values(2)
    # the descriptors and pointers differ by address only; everything else packs the same
    same = {n for n in values if n not in ("g", "beta", "tma_g", "out") and values[n] == values_bf16[n]}
    assert same == {n for n in values if n not in ("g", "beta", "tma_g", "out")}
    assert values["beta_row_stride"] == heads  # the bf16 copy of beta is packed
    with pytest.raises(KDAInputError, match="g must be torch.bfloat16"):  # only fp32 is rounded for the caller
        prefill_module.prefill(x["q"], x["k"], x["v"], g.half(), beta, **common)


@pytest.mark.parametrize("path", ["serial", "fused", "cp"])
def test_checkpoints_run_the_checkpointing_twin_and_a_call_without_them_the_plain_kernel(recorder, tables, path):
    from cula_aot.layout import FLAG_BF16_CHECKPOINT, FLAG_CHECKPOINT_OFFSETS

    heads = 4
    lengths = [16, 4080] if path == "cp" else [7, 33]
    x = standard_inputs(1, sum(lengths), heads, seed=31)
    cu = cu_seqlens_of(lengths)
    pool = torch.zeros(6, heads + 1, 128, 128, dtype=torch.bfloat16)[:, :heads]  # padded slots
    indices = torch.full((2, 3), -1, dtype=torch.int32)
    offsets = torch.tensor([16, 0], dtype=torch.int32)
    kw = dict(
        cu_seqlens=cu,
        cu_seqlens_cpu=cu.clone(),
        state_layout="kv",
        output_final_state=True,
        intracard_cp=8 if path == "cp" else False,
        fused=path == "fused",
    )
    checkpointed = dict(
        checkpoint_every=32, checkpoint_pool=pool, checkpoint_indices=indices, checkpoint_offsets=offsets
    )
    for with_checkpoints in (True, False, True):
        first = len(recorder.launches)
        prefill_module.prefill(
            x["q"],
            x["k"],
            x["v"],
            x["g"],
            x["beta"],
            A_log=x["A_log"],
            dt_bias=x["dt_bias"],
            lower_bound=x["lower_bound"],
            **kw,
            **(checkpointed if with_checkpoints else {}),
        )
        launched = [recorder.values(i) for i in range(first, len(recorder.launches))]
        chain = launched[-1]  # K2, the fused kernel or the CP recurrence: the one that writes them
        assert chain[0].name.endswith(f"checkpointing{int(with_checkpoints)}"), chain[0].name
        for kernel, values, _ in launched[:-1]:  # K1, the pre_scan, the merge: never
            assert "checkpointing1" not in kernel.name and values.get("checkpoint_every", 0) == 0
        values = chain[1]
        if with_checkpoints:
            assert values["checkpoints"] == pool.data_ptr() and values["checkpoint_indices"] == indices.data_ptr()
            assert values["checkpoint_offsets"] == offsets.data_ptr()
            assert (values["checkpoint_every"], values["checkpoint_columns"], values["checkpoint_slots"]) == (32, 3, 6)
            assert values["checkpoint_slot_stride"] == pool.stride(0) == (heads + 1) * 128 * 128
            assert (values["checkpoint_stride_k"], values["checkpoint_stride_v"]) == (128, 1)  # kv
            assert (
                values["flags"] & (FLAG_BF16_CHECKPOINT | FLAG_CHECKPOINT_OFFSETS)
                == FLAG_BF16_CHECKPOINT | FLAG_CHECKPOINT_OFFSETS
            )
        else:
            assert values["checkpoints"] == values["checkpoint_indices"] == values["checkpoint_offsets"] == 0
            assert values["checkpoint_every"] == 0
            assert values["flags"] & (FLAG_BF16_CHECKPOINT | FLAG_CHECKPOINT_OFFSETS) == 0


@pytest.mark.parametrize("path", ["serial", "fused", "cp"])
def test_a_call_whose_sequences_reach_no_checkpoint_runs_the_plain_kernels(recorder, tables, slow_path, path):
    # Checkpoints every 64 tokens without offsets: a batch whose host lengths all stay below 64
    # writes none, so it runs the plain chain (the twin's loop costs where it writes nothing);
    # the same signature with a sequence that reaches 64 runs the twin, each from its own plan.
    heads = 4
    short, reaching = ([16, 4080], [16, 4080]) if path == "cp" else ([40, 40], [10, 70])
    every = 8192 if path == "cp" else 64
    x = standard_inputs(1, sum(short), heads, seed=32)
    pool = torch.zeros(3, heads, 128, 128)
    indices = torch.zeros(2, 1, dtype=torch.int32)
    kw = dict(
        output_final_state=True,
        intracard_cp=8 if path == "cp" else "auto",
        fused=path == "fused" or None,
        checkpoint_every=every,
        checkpoint_pool=pool,
        checkpoint_indices=indices,
    )

    def chain(lengths, **extra):
        first = len(recorder.launches)
        cu = cu_seqlens_of(lengths)
        host = {} if "check_seqlens" in extra else {"cu_seqlens_cpu": cu.clone()}
        prefill_module.prefill(
            x["q"],
            x["k"],
            x["v"],
            x["g"],
            x["beta"],
            A_log=x["A_log"],
            dt_bias=x["dt_bias"],
            lower_bound=x["lower_bound"],
            cu_seqlens=cu,
            **host,
            **kw,
            **extra,
        )
        kernel, values, _ = recorder.values(len(recorder.launches) - 1)
        assert first < len(recorder.launches)
        return kernel.name.endswith("checkpointing1"), values["checkpoint_every"]

    if path == "cp":  # a CP plan is its lengths' own: the period decides
        assert chain(short) == (False, 0)
        kw["checkpoint_every"] = 4080
        assert chain(short) == (True, 4080)
        return
    assert (
        paths.checkpoints_reached(SimpleNamespace(checkpoints=SimpleNamespace(every=64, flags=0)), True, [0, 40, 80])
        is False
    )
    assert chain(short) == (False, 0)
    validations = slow_path["validate"]
    assert chain(reaching) == (True, 64)
    assert chain(short) == (False, 0) and chain(reaching) == (True, 64)
    assert slow_path["validate"] == validations + 1  # the last two calls ran from their lengths' plans
    # Lengths on the device only, or offsets (device values): the host cannot tell, so the twin runs.
    assert chain(short, check_seqlens="off") == (True, 64)
    assert chain(short, checkpoint_offsets=torch.zeros(2, dtype=torch.int32)) == (True, 64)


def test_a_fixed_length_batch_shorter_than_the_period_runs_the_plain_kernel(recorder):
    heads = 2
    x = standard_inputs(2, 48, heads, seed=33)
    pool = torch.zeros(4, heads, 128, 128)
    indices = torch.zeros(2, 1, dtype=torch.int32)
    for every, twin in ((64, False), (48, True), (64, False)):
        recorder.launches.clear()
        prefill_module.prefill(
            x["q"],
            x["k"],
            x["v"],
            x["g"],
            x["beta"],
            A_log=x["A_log"],
            dt_bias=x["dt_bias"],
            lower_bound=x["lower_bound"],
            intracard_cp=False,
            fused=False,
            checkpoint_every=every,
            checkpoint_pool=pool,
            checkpoint_indices=indices,
        )
        kernel, values, _ = recorder.values(1)
        assert kernel.name.endswith(f"checkpointing{int(twin)}") and values["checkpoint_every"] == (
            every if twin else 0
        )


@pytest.mark.parametrize("fixed", [False, True], ids=["varlen", "fixed"])
def test_truncated_pieces_without_the_fused_kernel_launch_k1_the_bounds_and_the_walking_k2(recorder, tables, fixed):
    heads = 4
    x = standard_inputs(1, 8192 if fixed else 4096, heads, seed=13)
    out, final = torch.empty_like(x["v"]), torch.zeros(1 if fixed else 2, heads, 128, 128)
    init = torch.zeros_like(final)
    cu = None if fixed else cu_seqlens_of(_SPLIT)
    lengths = {} if fixed else {"cu_seqlens": cu, "cu_seqlens_cpu": cu.clone()}
    for _ in range(2):  # the second call reuses the plan and its table
        _call(x, out=out, initial_state=init, final_state=final, intracard_cp="truncated", fused=False, **lengths)
    assert len(recorder.launches) == 6 and len(tables.entries) == 1
    (k1, k1_values, _), (bound, bound_values, bound_grid), (k2, k2_values, k2_grid) = (
        recorder.values(i) for i in range(3)
    )
    assert [recorder.launches[i][3] for i in range(3)] == [False, False, True]
    assert k1.name.startswith("k1_prepare") and bound.name == "tile_bound" and "_walk1_" in k2.name
    total_slots = prepare.plan_slots(1, 8192 if fixed else 4096, cu)
    # The bounds follow the H·total_slots records in the arena, where the walking K2 finds them.
    workspace = k1_values["workspace"]
    assert bound_values["workspace"] == workspace == k2_values["workspace"]
    assert bound_values["bounds"] == workspace + heads * total_slots * prefill_plans.WORKSPACE_RECORD_BYTES
    assert bound_grid == (-(-total_slots // 4), heads, 1) and bound_values["total_slots"] == total_slots
    split = cp_plan.pieces_split(1 if fixed else 2, heads, 132, 4)
    host_cu = [0, 8192] if fixed else [0, *_SPLIT[:1], 4096]
    pieces = cp_plan.plan(cp_plan.sequences(1, 8192 if fixed else 4096, None if fixed else host_cu), split)
    rows = prefill_plans._piece_rows(pieces, FLAG_INITIAL_STATE, FLAG_FINAL_STATE)
    table = next(iter(tables.entries.values()))
    assert table.tolist()[: len(rows) * len(rows[0])] == [v for row in rows for v in row]
    assert k2_values["segments"] == table.data_ptr() and k2_grid[1:] == (heads, len(rows))
    assert k2_values["initial_state"] == init.data_ptr() and k2_values["final_state"] == final.data_ptr()
    # Every piece may start from its sequence's initial state; only each sequence's last writes the final one.
    assert all(row[layout.SEG_FLAGS] & FLAG_INITIAL_STATE for row in rows)
    last = {len(seq) - 1 + sum(len(s) for s in pieces[:n]) for n, seq in enumerate(pieces)}
    assert [i for i, row in enumerate(rows) if row[layout.SEG_FLAGS] & FLAG_FINAL_STATE] == sorted(last)


def test_truncated_pieces_refuse_checkpoints(recorder, tables):
    x = standard_inputs(1, 4096, 2, seed=14)
    pool = torch.zeros(4, 2, 128, 128)
    with pytest.raises(KDAInputError, match="truncated"):
        _call(
            x,
            intracard_cp="truncated",
            checkpoint_every=1024,
            checkpoint_pool=pool,
            checkpoint_indices=torch.zeros(1, 4, dtype=torch.int32),
        )


@pytest.mark.parametrize("fixed", [False, True], ids=["varlen", "fixed"])
def test_truncated_pieces_zero_the_ready_flags_then_launch_the_fused_pieces(recorder, tables, fixed):
    heads = 4
    x = standard_inputs(1, 8192 if fixed else 4096, heads, seed=15)
    out, final = torch.empty_like(x["v"]), torch.zeros(1 if fixed else 2, heads, 128, 128)
    init = torch.zeros_like(final)
    cu = None if fixed else cu_seqlens_of(_SPLIT)
    lengths = {} if fixed else {"cu_seqlens": cu, "cu_seqlens_cpu": cu.clone()}
    for _ in range(2):  # the second call reuses the plan and its table
        _call(x, out=out, initial_state=init, final_state=final, intracard_cp="truncated", **lengths)
    assert len(recorder.launches) == 2 and len(tables.entries) == 1 and len(recorder.zeroed) == 2
    kernel, values, grid = recorder.values(0)
    assert kernel.name.startswith("fused_pieces") and recorder.launches[0][3] is False
    host_cu = [0, 8192] if fixed else [0, *_SPLIT[:1], 4096]
    seqs = cp_plan.sequences(1, 8192 if fixed else 4096, None if fixed else host_cu)
    piece = cp_plan.fused_piece_tiles([n for _, n, _ in seqs], heads, 132)
    pieces = cp_plan.fused_pieces(seqs, piece)
    rows = prefill_plans._fused_piece_rows(pieces, FLAG_INITIAL_STATE, FLAG_FINAL_STATE)
    table = next(iter(tables.entries.values()))
    assert table.tolist()[: len(rows) * len(rows[0])] == [v for row in rows for v in row]
    assert values["segments"] == table.data_ptr() and grid == (1, heads, len(rows))
    # The ticket counters (one per head) and the ready flags of the items of rows with a successor
    # are zeroed before the launch; those items' end states follow.
    successors = [bool(row[layout.SEG_FLAGS] & layout.FLAG_SUCCESSOR) for row in rows]
    control = heads + sum(successors) * heads
    assert recorder.zeroed[0] == (values["ready"], control)
    gap = values["carries"] - values["ready"]
    assert gap >= 4 * control and gap % 256 == 0
    assert values["initial_state"] == init.data_ptr() and values["final_state"] == final.data_ptr()
    assert values["flags"] == 0  # the rows carry the state flags
    # The rows with a successor first (their exchange slots are the first), and every row's
    # predecessor before it: the piece before it in the same sequence.
    assert successors == sorted(successors, reverse=True) and sum(successors) == len(rows) - len(pieces)
    for r, row in enumerate(rows):
        before = row[layout.SEG_PREDECESSOR]
        if row[layout.SEG_SEQ_OFFSET] == 0:
            assert before == -1
        else:
            assert 0 <= before < r and successors[before] and rows[before][layout.SEG_SEQ] == row[layout.SEG_SEQ]
            assert rows[before][layout.SEG_SEQ_OFFSET] + rows[before][layout.SEG_TOKENS] == row[layout.SEG_SEQ_OFFSET]
    assert all(row[layout.SEG_FLAGS] & FLAG_INITIAL_STATE for row in rows)
    finals = [bool(row[layout.SEG_FLAGS] & FLAG_FINAL_STATE) for row in rows]
    assert sum(finals) == len(pieces) and all(f != s for f, s in zip(finals, successors))


def test_truncated_pieces_with_the_fused_kernel_refuse_other_conventions(recorder, tables):
    x = standard_inputs(1, 4096, 2, seed=16)
    with pytest.raises(KDAInputError, match="fused kernel runs beta as logits"):
        _call(x, intracard_cp="truncated", fused=True, beta_sigmoid=False)


def test_fused_pieces_of_other_head_counts_get_their_own_tables(recorder, tables):
    # The same lengths at H64 and H96 cut into different pieces (the planner weighs H) under the
    # same walking split (2): each call must launch over its own rows, not a table cached for the
    # other.
    cu = cu_seqlens_of(_SPLIT)
    grids = []
    assert cp_plan.pieces_split(2, 64, 132, 4) == cp_plan.pieces_split(2, 96, 132, 4)
    for heads in (64, 96):
        x = standard_inputs(1, 4096, heads, seed=17)
        _call(x, cu_seqlens=cu, cu_seqlens_cpu=cu.clone(), output_final_state=True, intracard_cp="truncated")
        kernel, values, grid = recorder.values(len(recorder.launches) - 1)
        seqs = cp_plan.sequences(1, 4096, cu.tolist())
        pieces = cp_plan.fused_pieces(seqs, cp_plan.fused_piece_tiles([n for _, n, _ in seqs], heads, 132))
        rows = prefill_plans._fused_piece_rows(pieces, 0, FLAG_FINAL_STATE)
        table = next(t for t in tables.entries.values() if t.data_ptr() == values["segments"])
        assert table.tolist()[: len(rows) * len(rows[0])] == [v for row in rows for v in row]
        grids.append(grid)
    assert len(tables.entries) == 2 and grids[0][2] != grids[1][2]

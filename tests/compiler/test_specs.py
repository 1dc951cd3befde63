import dataclasses

import pytest

from cula_aot.specs import (
    GATES,
    K2_DEFAULT_V_BLOCK,
    K2_SEGMENTED_V_BLOCKS,
    K2_V_BLOCKS,
    K2_WARP_COLUMNS,
    K2_WIDE_V_BLOCK,
    K1Spec,
    K2Spec,
    abi_layout,
    auto_v_block,
    default_specs,
    segmented_v_block,
)


def test_the_spec_list_names_no_head_count():
    specs = default_specs()
    # H is a launch value (the grid's second dimension): no specialization is per head count.
    assert not any("heads" in s.args for s in specs) and all("heads" in s.grid for s in specs)
    k1 = {s.varlen for s in specs if isinstance(s, K1Spec)}
    k2 = {(s.varlen, s.v_block) for s in specs if isinstance(s, K2Spec)}
    assert k1 == {False, True}
    assert k2 == {(v, b) for v in (False, True) for b in K2_V_BLOCKS}
    assert {K2_DEFAULT_V_BLOCK, *K2_SEGMENTED_V_BLOCKS} <= set(K2_V_BLOCKS)
    # One K2 warp per 16 V columns: blocks are whole warps and tile the 128 columns.
    assert all(128 % b == 0 and b % K2_WARP_COLUMNS == 0 for b in K2_V_BLOCKS)
    segmented = [s for s in specs if isinstance(s, K2Spec) and s.segmented]
    assert sorted((s.v_block, s.prescan, s.checkpointing, s.walk) for s in segmented) == sorted(
        [(b, p, False, False) for b in K2_SEGMENTED_V_BLOCKS for p in (False, True)]
        + [(b, False, True, False) for b in K2_SEGMENTED_V_BLOCKS]
        + [(b, False, False, True) for b in K2_SEGMENTED_V_BLOCKS]
    )
    # Every chain the runtime launches has its checkpoint twin, and nothing else does.
    from cula_aot.specs import fused_spec, segmented_k2_spec, serial_k2_spec

    launched = (
        [serial_k2_spec(v, b) for v in (False, True) for b in K2_V_BLOCKS]
        + [segmented_k2_spec(b) for b in K2_SEGMENTED_V_BLOCKS]
        + [fused_spec(g) for g in GATES]
    )
    twins = {s for s in specs if getattr(s, "checkpointing", False)}
    assert twins == {dataclasses.replace(s, checkpointing=True) for s in launched}
    assert set(launched) <= set(specs)
    assert not any(s.prescan for s in specs if isinstance(s, K2Spec) and not s.segmented)
    assert all(s.block == (2 * s.v_block, 1, 1) for s in specs if isinstance(s, K2Spec))


def test_names_cover_every_codegen_argument():
    specs = default_specs()
    assert len({s.name for s in specs}) == len(specs)
    for spec in specs:
        fields = [f.name for f in dataclasses.fields(spec)]
        assert list(spec.args) == fields
        for field in fields:
            assert field in spec.name, f"{spec.name} does not name codegen argument {field}"
        # changing any one argument changes the name
        for field in fields:
            value = getattr(spec, field)
            if isinstance(value, str):  # the gate: the next one
                changed = GATES[(GATES.index(value) + 1) % len(GATES)]
            else:
                changed = (not value) if isinstance(value, bool) else value + 1
            try:
                other = dataclasses.replace(spec, **{field: changed})
            except ValueError:  # not a valid specialization (a pre_scan that is not segmented)
                assert field in ("prescan", "segmented", "multicast", "v_block", "wgmma", "checkpointing", "walk")
                continue
            assert other.name != spec.name
    assert K1Spec(varlen=True).name == "k1_prepare_varlen1_gatesafe"
    assert K1Spec(varlen=False, gate="softplus").name == "k1_prepare_varlen0_gatesoftplus"
    assert (
        K2Spec(varlen=False, v_block=32).name
        == "k2_recurrence_varlen0_v_block32_segmented0_prescan0_stages3_multicast0_wgmma0_walk0_checkpointing0"
    )
    assert K2Spec(varlen=False, v_block=32).grid == (4, "heads", "num_seqs")


def test_multicast_k2_is_one_cluster_per_sequence_and_head():
    pytest.importorskip("cutlass")  # the slice size is the kernel's (build extra)
    from cula_aot.kernels.k2_recurrence import multicast_slice_bytes, stage_bytes
    from cula_aot.specs import K2_MULTICAST_V_BLOCKS, K2_WGMMA_V_BLOCK, serial_k2_spec

    for vb in K2_MULTICAST_V_BLOCKS:
        spec = K2Spec(varlen=True, v_block=vb, multicast=True)
        # The cluster spans the grid's V blocks exactly: its CTAs share the sequence and head.
        assert spec.cluster == (spec.grid[0], 1, 1) and spec.cluster[0] > 1
        for prescan in (False, True):
            part = multicast_slice_bytes(stage_bytes(prescan), spec.cluster[0])
            assert part % 16 == 0 and part * spec.cluster[0] == stage_bytes(prescan)
        assert serial_k2_spec(True, vb) == dataclasses.replace(spec, wgmma=vb == K2_WGMMA_V_BLOCK)
    assert multicast_slice_bytes(stage_bytes(False), 4) == 3472  # a 32-column cluster would split too
    assert serial_k2_spec(True, 32).cluster == serial_k2_spec(True, 16).cluster == (1, 1, 1)
    with pytest.raises(ValueError, match="multicast"):
        K2Spec(varlen=True, v_block=16, multicast=True)
    with pytest.raises(ValueError, match="slices"):
        multicast_slice_bytes(stage_bytes(False), 8)  # 13 888 B is not 8 × a 16-byte multiple
    built = {(s.varlen, s.v_block) for s in default_specs() if isinstance(s, K2Spec) and s.multicast}
    assert built == {(vl, vb) for vl in (False, True) for vb in K2_MULTICAST_V_BLOCKS}


def test_abi_layout_offsets_respect_alignment():
    records = abi_layout(K1Spec.params + K2Spec.params)
    cursor = 0
    for r in records:
        assert r["offset"] % r["align"] == 0 and r["offset"] >= cursor
        cursor = r["offset"] + r["size"]
    assert [r["name"] for r in records][:3] == ["tma_q", "tma_k", "tma_g"]


def test_auto_v_block_widens_only_many_cta_grids():
    # CONTRACT §7 rows on a 132-SM H200: one long sequence stays at 32 columns, 8 × 1024 at H = 64 widens.
    assert auto_v_block(64, 1, 132) == K2_DEFAULT_V_BLOCK
    assert auto_v_block(96, 1, 132) == K2_DEFAULT_V_BLOCK
    assert auto_v_block(64, 8, 132) == K2_WIDE_V_BLOCK
    assert auto_v_block(4, 32, 132) == K2_DEFAULT_V_BLOCK
    # The measured boundary (2026-12-02): 64 at 1.94 and 2.33 waves, 32 at 1.55.
    assert auto_v_block(16, 20, 132) == auto_v_block(64, 6, 132) == K2_WIDE_V_BLOCK
    assert auto_v_block(32, 8, 132) == auto_v_block(8, 32, 132) == K2_DEFAULT_V_BLOCK
    assert {K2_DEFAULT_V_BLOCK, K2_WIDE_V_BLOCK} <= set(K2_V_BLOCKS)


def test_segmented_v_block_widens_only_past_one_wave():
    # 32 columns while 4·H·rows CTAs fit one wave of five per SM, then 64 (four warps per CTA).
    assert segmented_v_block(8, 14, 132) == 32  # H8 [8192] at s = 8: 448 CTAs
    assert segmented_v_block(8, 28, 132) == 64  # H8 [8192, 2048] at s = 8: 896 pre_scan CTAs
    assert segmented_v_block(4, 41, 132) == 32 and segmented_v_block(4, 42, 132) == 64  # 656 / 672


def test_merge_v_block_keeps_one_wave_and_both_are_built():
    from cula_aot.specs import MERGE_V_BLOCKS, MergeSpec, merge_v_block

    assert merge_v_block(4, 2, 132) == 8  # 16 · 4 · 2 = 128 one-CTA-per-SM blocks
    assert merge_v_block(8, 2, 132) == 16 and merge_v_block(1, 9, 132) == 16
    built = {s.v_block for s in default_specs() if isinstance(s, MergeSpec)}
    assert built == set(MERGE_V_BLOCKS)


def test_prescan_needs_segmented_and_stages_the_record_prefix():
    with pytest.raises(ValueError, match="segmented"):
        K2Spec(varlen=True, v_block=32, prescan=True)
    from cula_aot.layout import PRESCAN_RECORD_BYTES, PRESCAN_RECORD_PARTS, WORKSPACE_PART_OFFSETS, WORKSPACE_SLOT_BYTES

    # The pre_scan's bulk copy is the record's first PRESCAN_RECORD_BYTES: its parts must lead.
    assert set(PRESCAN_RECORD_PARTS) == {"kd", "kr", "inv", "gt", "b"}
    assert all(
        WORKSPACE_PART_OFFSETS[p] + WORKSPACE_SLOT_BYTES[p] <= PRESCAN_RECORD_BYTES for p in PRESCAN_RECORD_PARTS
    )
    assert all(WORKSPACE_PART_OFFSETS[p] >= PRESCAN_RECORD_BYTES for p in ("qd", "mqk"))


def test_k1_grid_covers_every_slot_in_k1_waves_waves():
    from cula_aot.specs import K1_CTAS_PER_SM, K1_MAX_TILES_PER_CTA, K1_WAVES, k1_grid

    waves = K1_CTAS_PER_SM * 132 * K1_WAVES
    for total_slots, heads in [(1, 1), (64, 4), (512, 4), (512, 64), (520, 96), (8192, 1), (7, 3)]:
        values = k1_grid(total_slots, heads, 132)
        t, ctas = values["tiles_per_cta"], values["k1_ctas"]
        assert 1 <= t <= K1_MAX_TILES_PER_CTA
        assert (ctas - 1) * t < total_slots <= ctas * t  # every slot once, no empty CTA
        # The fewest tiles per CTA whose grid fits K1_WAVES waves, unless that exceeds the cap.
        assert ctas * heads <= waves or t == K1_MAX_TILES_PER_CTA
        assert t == 1 or -(-total_slots // (t - 1)) * heads > waves
    assert k1_grid(512, 64, 132)["tiles_per_cta"] == K1_MAX_TILES_PER_CTA  # H64 1×8192
    assert k1_grid(512, 4, 132)["tiles_per_cta"] == 1  # H4 1×8192: 2048 CTAs are 4 waves already


def test_wgmma_k2_is_the_one_warpgroup_v_block_and_built_for_every_serial_k2():
    from cula_aot.specs import K2_WGMMA_V_BLOCK, k2_threads, serial_k2_spec

    assert k2_threads(K2_WGMMA_V_BLOCK) == 128  # one warpgroup: wgmma's M = 64 is its 4 warps × 16
    for vb in K2_V_BLOCKS:
        assert serial_k2_spec(False, vb).wgmma == (vb == K2_WGMMA_V_BLOCK)
        if vb != K2_WGMMA_V_BLOCK:
            with pytest.raises(ValueError, match="wgmma"):
                K2Spec(varlen=True, v_block=vb, wgmma=True)
    built = {(s.varlen, s.multicast) for s in default_specs() if isinstance(s, K2Spec) and s.wgmma}
    assert built == {(vl, m) for vl in (False, True) for m in (False, True)}


def test_auto_fused_takes_many_long_items_only():
    from cula_aot.specs import FusedSpec, auto_fused, fused_spec

    sms = 132
    assert auto_fused(64, 8, 8 * 1024, sms) and auto_fused(16, 8, 8 * 1024, sms)  # 0.97 and 3.9 waves, 64 tiles
    assert auto_fused(96, 6, 8192, sms)  # the CONTRACT §7 varlen row: 4.4 waves, 85 tiles on average
    assert not auto_fused(64, 1, 8192, sms)  # half a wave of items
    assert auto_fused(96, 1, 8192, sms)  # 0.73 waves of 512-tile items
    assert not auto_fused(96, 1, 4096, sms)  # 0.73 waves, 256 tiles
    assert not auto_fused(8, 8, 8 * 1024, sms)  # 64 items
    assert not auto_fused(32, 32, 32 * 256, sms)  # many 16-tile items, maybe ragged
    assert auto_fused(32, 32, 32 * 256, sms, uniform=True) and auto_fused(4, 32, 32 * 256, sms, uniform=True)
    assert not auto_fused(4, 32, 32 * 128, sms, uniform=True)  # 8 tiles
    assert not auto_fused(4, 8, 8 * 1024, sms, uniform=True)  # a quarter wave
    assert not auto_fused(16, 20, 4 * 2048 + 16 * 128, sms)  # 32 tiles on average
    spec = fused_spec()
    assert spec == FusedSpec() and spec.block == (128 * spec.producers + 256, 1, 1)
    assert (
        spec.grid == (1, "heads", "num_seqs")
        and spec.name == "fused_prefill_stages4_producers2_gatesafe_checkpointing0"
    )


def test_per_call_parameters_are_declared_as_the_launches_supply_them():
    """Every pointer and descriptor source is per call, and of the scalars exactly ``scale``,
    ``lower_bound``, the fused layer's ``norm_eps`` and decode's ``beta_offset`` / ``index_offset``
    (where β and the slot indices start past their 16-byte aligned base: the call's addresses); the i32 lengths, strides, slot
    counts and flags are fixed by a launch template's call signature.  The manifest records it
    per parameter."""
    from cula_aot.specs import abi_layout, default_specs

    for spec in default_specs():
        for param, record in zip(spec.params, abi_layout(spec.params)):
            expected = param.kind != "scalar" or param.name in (
                "scale",
                "lower_bound",
                "norm_eps",
                "beta_offset",
                "index_offset",
            )
            assert param.per_call is expected and record["per_call"] is expected, (spec.name, param.name)

import os
import shutil

import pytest

from cula_aot.compiler import sass


def _line(address, text):
    return f"        /*{address:04x}*/                   {text} ;                 /* 0x000000000000000000 */"


def _listing():
    # A spin wait (short backward branch), an outer loop around an inner MMA loop.
    code = [
        (0x0000, "MOV R1, c[0x0][0x28]"),
        (0x0010, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R9+URZ+0x20980], R7"),
        (0x0020, "@!P0 BRA 0x10"),
    ]
    code += [
        (0x0030 + 16 * i, "HMMA.16816.F32.BF16 R4, R8, R12, R4" if i % 4 == 0 else "IADD3 R2, R2, 0x1, RZ")
        for i in range(40)
    ]
    code += [(0x02B0, "STL [R1+0x4], R8"), (0x02C0, "@P1 BRA 0x30"), (0x02D0, "STG.E.128 desc[UR6][R4.64], R8")]
    code += [(0x02E0 + 16 * i, "MUFU.EX2 R7, R7") for i in range(4)]
    code += [(0x0320, "LDL R5, [R1+0x4]"), (0x0330, "@!P2 BRA `(.L_x_7) 0x30"), (0x0340, "EXIT")]
    return "\n".join(["Function : kernel", "\t.headerflags ..."] + [_line(a, t) for a, t in code])


def test_loops_skip_spin_waits_and_nest():
    found = sass.loops(_listing())
    assert [(loop.start, loop.end) for loop in found] == [(0x30, 0x2C0), (0x30, 0x330)]
    inner, outer = found
    assert len(inner.body) == 42 and inner.count("MMA") == 10 and inner.count("STL") == 1
    assert outer.count("MUFU") == 4 and outer.count("STG") == 1 and outer.count("LDL") == 1
    # Predicates are stripped, so a guarded branch counts as BRA.
    assert inner.opcodes()["BRA"] == 1 and "@P1" not in " ".join(inner.body)


def test_hot_loop_is_the_smallest_with_mmas_and_differences_name_opcodes():
    listing = _listing()
    hot = sass.hot_loop(listing)
    assert (hot.start, hot.end) == (0x30, 0x2C0)
    other = sass.Loop(hot.start, hot.end, hot.body + ("IADD3 R3, R3, 0x2, RZ", "LDL R6, [R1]"))
    assert sass.opcode_difference(hot, other) == {"IADD3": (30, 31), "LDL": (0, 1)}
    with pytest.raises(ValueError, match="no loop with MMAs"):
        sass.hot_loop("\n".join(_line(a, "NOP") for a in range(0, 0x400, 16)))


@pytest.mark.skipif(not (os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")), reason="no cuobjdump")
def test_a_built_k2_cubin_has_an_mma_tile_loop():
    from cula_aot.runtime.manifest import ArtifactError, Manifest

    try:
        m = Manifest.discover()
    except ArtifactError as exc:
        pytest.skip(f"no build here: {exc}")
    name = next(n for n in m.kernels if n.startswith("k2_recurrence") and n.endswith("checkpointing0"))
    hot = sass.hot_loop(sass.disassemble(str(m.root / m.kernels[name]["cubin"])))
    assert hot.count("MMA") > 0 and hot.count("STL") == 0

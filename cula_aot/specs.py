"""Kernel specializations and their declared parameter ABI (no cutlass, no GPU).

A specialization fixes every code-generation argument of one kernel; its ``name`` is derived
from all of them, so two different cubins can never share a name.  The parameter list is the
ABI the runtime packs: the build cross-checks it against the ``.entry`` of the PTX it produced
and writes it, with offsets, into ``manifest.json``.
"""

import dataclasses
from typing import ClassVar

DEFAULT_HEADS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128)
ARCH = "sm_90a"

# Parameter kinds: a global pointer (element dtype, address alignment the kernel assumes) or a
# scalar passed by value.  Sizes and alignments are those of the PTX ``.param`` space.
POINTER_ALIGN = 16
SCALAR_TYPES = {"i32": (4, ".u32"), "f32": (4, ".f32")}


@dataclasses.dataclass(frozen=True)
class Param:
    name: str
    kind: str  # "pointer" or "scalar"
    dtype: str  # element dtype of a pointer, value dtype of a scalar

    @property
    def size(self) -> int:
        return 8 if self.kind == "pointer" else SCALAR_TYPES[self.dtype][0]

    @property
    def align(self) -> int:
        return self.size


def pointer(name: str, dtype: str) -> Param:
    return Param(name, "pointer", dtype)


def scalar(name: str, dtype: str) -> Param:
    return Param(name, "scalar", dtype)


def abi_layout(params) -> list[dict]:
    """Ordered ABI records with offsets, as written to the manifest."""
    records, offset = [], 0
    for p in params:
        offset = -(-offset // p.align) * p.align
        record = {"name": p.name, "kind": p.kind, "dtype": p.dtype, "size": p.size, "align": p.align, "offset": offset}
        if p.kind == "pointer":
            record["address_align"] = POINTER_ALIGN
        records.append(record)
        offset += p.size
    return records


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """Base of all specializations: subclasses add their codegen fields."""

    kernel: ClassVar[str]
    params: ClassVar[tuple]
    block: ClassVar[tuple] = (128, 1, 1)
    cluster: ClassVar[tuple] = (1, 1, 1)
    # Grid dimensions: an int or the name of a scalar parameter / codegen argument.
    grid: ClassVar[tuple]

    @property
    def args(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @property
    def name(self) -> str:
        parts = [self.kernel]
        for key, value in self.args.items():
            parts.append(f"{key}{int(value) if isinstance(value, bool) else value}")
        return "_".join(parts)


K1_PARAMS = (
    pointer("q", "bf16"),
    pointer("k", "bf16"),
    pointer("g", "bf16"),
    pointer("beta", "bf16"),
    pointer("a_log", "f32"),
    pointer("dt_bias", "f32"),
    pointer("cu_seqlens", "i32"),
    pointer("ws_qd", "bf16"),
    pointer("ws_kd", "bf16"),
    pointer("ws_kr", "bf16"),
    pointer("ws_gt", "f32"),
    pointer("ws_inv", "bf16"),
    pointer("ws_mqk", "bf16"),
    pointer("ws_beta", "bf16"),
    scalar("seq_len", "i32"),
    scalar("num_seqs", "i32"),
    scalar("total_slots", "i32"),
    scalar("scale", "f32"),
    scalar("lower_bound", "f32"),
)


@dataclasses.dataclass(frozen=True)
class K1Spec(KernelSpec):
    """K1 prepare: one CTA per (tile slot, head)."""

    kernel: ClassVar[str] = "k1_prepare"
    params: ClassVar[tuple] = K1_PARAMS
    grid: ClassVar[tuple] = ("total_slots", "heads", 1)

    heads: int
    varlen: bool


def default_specs(heads=DEFAULT_HEADS) -> list[KernelSpec]:
    """Every specialization the build produces for the given head counts."""
    return [K1Spec(heads=h, varlen=v) for h in sorted(set(heads)) for v in (False, True)]

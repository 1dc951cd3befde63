"""Encode TMA descriptors (``CUtensorMap``) from a manifest recipe with ``cuTensorMapEncodeTiled``.

A recipe (see ``cula_aot.specs.token_tma``) lists dimensions innermost first; every entry is an
int or the name of a runtime value supplied by the caller.  The 128 encoded bytes are passed by
value in the kernel's parameter buffer, exactly where the manifest ABI places them.
"""

import ctypes

from cuda.bindings import driver as cu

from .driver import check

_DTYPES = {
    "bf16": cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
    "f32": cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
}
_INTERLEAVE = {"none": cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE}
_SWIZZLE = {"none": cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE}
_L2 = {
    "none": cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_NONE,
    "L2_256B": cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
}
# "zeros": out-of-bounds elements read as zero (the driver's FLOAT_OOB_FILL_NONE).
TMA_DESCRIPTOR_BYTES = 128
_OOB = {"zeros": cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE}


def _resolve(entry, values: dict) -> int:
    return entry if isinstance(entry, int) else int(values[entry])


class DescriptorCache:
    """Encoded descriptors of one recipe by (address, dims, strides): serving loops reuse input
    buffers, and an encode through cuda-python costs ~15 µs.  Bounded: cleared when full."""

    ENTRIES = 64

    def __init__(self, recipe: dict, what: str):
        self.recipe = recipe
        self.what = what
        self._encoded: dict[tuple, bytes] = {}

    def _shape(self, values: dict) -> tuple:
        """(dims, strides) of the recipe with its runtime names resolved from ``values``."""
        return (
            tuple(_resolve(d, values) for d in self.recipe["global_dims"]),
            tuple(_resolve(s, values) for s in self.recipe["global_strides_bytes"]),
        )

    def get(self, base_address: int, values: dict) -> bytes:
        return self._get(base_address, *self._shape(values))

    def resolved(self, values: dict):
        """``address -> descriptor`` for the shape that ``values`` fix (a launch template's)."""
        dims, strides = self._shape(values)
        last = [(None, None)]  # the previous call's (address, descriptor): serving loops repeat it

        def encoded(base_address: int) -> bytes:
            address, descriptor = last[0]  # one tuple: consistent under concurrent callers
            if address != base_address:
                descriptor = self._get(base_address, dims, strides)
                last[0] = (base_address, descriptor)
            return descriptor

        return encoded

    def _get(self, base_address: int, dims: tuple, strides: tuple) -> bytes:
        key = (base_address, dims, strides)
        encoded = self._encoded.get(key)
        if encoded is None:
            encoded = _encode(self.recipe, base_address, dims, strides, self.what)
            if len(self._encoded) >= self.ENTRIES:
                self._encoded.clear()
            self._encoded[key] = encoded
        return encoded


def _encode(recipe: dict, base_address: int, dims, strides, what: str) -> bytes:
    if base_address % 16:
        raise ValueError(f"{what}: TMA needs a 16-byte aligned tensor base, got {base_address:#x}")
    if min(dims) <= 0:
        raise ValueError(f"{what}: TMA dimensions must be positive, got {dims}")
    if any(s % 16 for s in strides):
        raise ValueError(f"{what}: TMA strides must be multiples of 16 bytes, got {strides}")
    tensor_map = check(
        cu.cuTensorMapEncodeTiled(
            _DTYPES[recipe["dtype"]],
            recipe["rank"],
            base_address,
            [cu.cuuint64_t(d) for d in dims],
            [cu.cuuint64_t(s) for s in strides],
            [cu.cuuint32_t(b) for b in recipe["box_dims"]],
            [cu.cuuint32_t(e) for e in recipe["element_strides"]],
            _INTERLEAVE[recipe["interleave"]],
            _SWIZZLE[recipe["swizzle"]],
            _L2[recipe["l2_promotion"]],
            _OOB[recipe["oob_fill"]],
        ),
        f"cuTensorMapEncodeTiled({what})",
    )
    return ctypes.string_at(tensor_map.getPtr(), TMA_DESCRIPTOR_BYTES)

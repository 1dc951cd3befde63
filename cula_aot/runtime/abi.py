"""Pack kernel parameters exactly as the manifest's ABI says (pure Python: no GPU needed).

The packed bytes are handed to ``cuLaunchKernel`` through ``CU_LAUNCH_PARAM_BUFFER_POINTER``,
so each value lands at the manifest's offset with its size: the same layout the compiler gave
the ``.entry`` parameters (the build checked that).
"""

import struct

_SCALAR_CODES = {"i32": "i", "f32": "f"}


class ParamPacker:
    """Packs a ``{name: value}`` mapping into the parameter buffer of one kernel."""

    def __init__(self, records: list[dict], kernel_name: str, param_bytes: int | None = None):
        self.kernel_name = kernel_name
        self.records = records
        fmt, cursor = "<", 0
        self.codes = []  # each parameter's struct format code
        for r in records:
            if r["offset"] < cursor:
                raise ValueError(f"{kernel_name}: parameter '{r['name']}' overlaps its predecessor")
            fmt += "x" * (r["offset"] - cursor)
            if r["kind"] == "tma_descriptor":
                code = f"{r['size']}s"
            else:
                code = "Q" if r["kind"] == "pointer" else _SCALAR_CODES[r["dtype"]]
            self.codes.append(code)
            fmt += code
            cursor = r["offset"] + r["size"]
        # Trailing bytes up to the cubin's parameter block size stay zero.
        fmt += "x" * max(0, (param_bytes or cursor) - cursor)
        self.struct = struct.Struct(fmt)
        self.size = self.struct.size
        self.names = [r["name"] for r in records]
        # Pointer name → the address alignment the kernel was compiled to assume.
        self.pointer_aligns = {r["name"]: r["address_align"] for r in records if r["kind"] == "pointer"}
        self._i32 = {r["name"] for r in records if r["kind"] == "scalar" and r["dtype"] == "i32"}
        self._descriptors = {r["name"]: r["size"] for r in records if r["kind"] == "tma_descriptor"}

    def pack(self, values: dict) -> bytes:
        missing = [n for n in self.names if n not in values]
        if missing:
            raise ValueError(f"{self.kernel_name}: no value for parameters {missing}")
        ordered = [values[n] for n in self.names]
        for name, value in zip(self.names, ordered):
            align = self.pointer_aligns.get(name)
            if align is not None and value % align:
                raise ValueError(
                    f"{self.kernel_name}: pointer '{name}' = {value:#x} is not {align}-byte aligned; "
                    "pass tensors whose storage starts on a 16-byte boundary (e.g. call .contiguous().clone())"
                )
            if name in self._descriptors and (not isinstance(value, bytes) or len(value) != self._descriptors[name]):
                raise ValueError(
                    f"{self.kernel_name}: descriptor '{name}' must be {self._descriptors[name]} encoded bytes"
                )
            if name in self._i32 and not -(2**31) <= value < 2**31:
                raise ValueError(f"{self.kernel_name}: '{name}' = {value} does not fit in int32")
        return self.struct.pack(*ordered)

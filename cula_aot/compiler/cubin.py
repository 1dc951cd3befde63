"""Read a kernel's parameter table out of a cubin (ELF ``.nv.info.<entry>`` attributes).

ptxas records, for every kernel parameter, its ordinal, byte offset and size
(``EIATTR_KPARAM_INFO``) and the parameter block's total size (``EIATTR_PARAM_CBANK``).  The
build checks the manifest ABI against these, i.e. against the exact binary the runtime loads.
"""

import struct

_EIATTR_PARAM_CBANK = 0x0A
_EIATTR_REQNTID = 0x10
_EIATTR_KPARAM_INFO = 0x17
# Record formats: no value, byte value, half-word value, sized blob.
_EIFMT_NVAL, _EIFMT_BVAL, _EIFMT_HVAL, _EIFMT_SVAL = 1, 2, 3, 4


class CubinFormatError(ValueError):
    pass


def _sections(elf: bytes) -> dict[str, bytes]:
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise CubinFormatError("not a 64-bit little-endian ELF cubin")
    shoff = struct.unpack_from("<Q", elf, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names_offset = headers[shstrndx][4]
    result = {}
    for name_off, _type, _flags, _addr, offset, size, *_ in headers:
        end = elf.index(b"\0", names_offset + name_off)
        result[elf[names_offset + name_off : end].decode()] = elf[offset : offset + size]
    return result


def kernel_params(cubin: bytes, entry: str) -> dict:
    """``{"params": [(ordinal, offset, size), ...] sorted by ordinal, "param_bytes", "reqntid"}``."""
    sections = _sections(cubin)
    info = sections.get(f".nv.info.{entry}")
    if info is None:
        raise CubinFormatError(f"cubin has no .nv.info section for entry {entry}")
    params, cbank_size, reqntid, pos = [], None, None, 0
    while pos + 4 <= len(info):
        fmt, attr = info[pos], info[pos + 1]
        if fmt == _EIFMT_SVAL:
            (size,) = struct.unpack_from("<H", info, pos + 2)
            data = info[pos + 4 : pos + 4 + size]
            pos += 4 + size
        elif fmt in (_EIFMT_NVAL, _EIFMT_BVAL, _EIFMT_HVAL):
            data = info[pos + 2 : pos + 4]
            pos += 4
        else:
            raise CubinFormatError(f"unknown .nv.info record format {fmt:#x} in {entry}")
        if attr == _EIATTR_KPARAM_INFO:
            _index, ordinal, offset, flags = struct.unpack_from("<IHHI", data)
            params.append((ordinal, offset, (flags >> 18) & 0x3FFF))
        elif attr == _EIATTR_PARAM_CBANK:
            _sym, _cb_offset, cbank_size = struct.unpack_from("<IHH", data)
        elif attr == _EIATTR_REQNTID:
            reqntid = struct.unpack_from("<III", data)
    return {"params": sorted(params), "param_bytes": cbank_size, "reqntid": reqntid}


def place_params(name: str, cubin: bytes, entry: str, abi: list[dict], block) -> tuple[list[dict], int]:
    """The manifest ABI with each parameter at the offset ptxas gave it, and the block size.

    ptxas places parameters in the constant bank, aligning each to its ``.align`` in absolute
    constant-bank addresses: a 64-byte aligned TMA descriptor first in the list lands at offset
    48, not 0.  The driver copies a ``CU_LAUNCH_PARAM_BUFFER_POINTER`` buffer with exactly these
    offsets, so they, not a naive running sum, are the ABI.  Raises ``AbiMismatch`` when count,
    order, sizes or block disagree.
    """
    from .ptx import AbiMismatch

    found = kernel_params(cubin, entry)
    if [(i, size) for i, _, size in found["params"]] != [(i, r["size"]) for i, r in enumerate(abi)]:
        raise AbiMismatch(f"{name}: cubin parameter table {found['params']} does not match the declared ABI")
    placed, end = [], 0
    for record, (_, offset, size) in zip(abi, found["params"]):
        if offset < end:
            raise AbiMismatch(f"{name}: cubin places '{record['name']}' at {offset}, overlapping the previous one")
        placed.append({**record, "offset": offset})
        end = offset + size
    if found["param_bytes"] is None or found["param_bytes"] < end:
        raise AbiMismatch(f"{name}: cubin parameter block ({found['param_bytes']} B) ends before the last parameter")
    if found["reqntid"] is not None and tuple(found["reqntid"]) != tuple(block):
        raise AbiMismatch(f"{name}: cubin requires block {found['reqntid']}, manifest says {tuple(block)}")
    return placed, found["param_bytes"]


def check_cubin_abi(name: str, cubin: bytes, entry: str, abi: list[dict], param_bytes: int, block) -> None:
    """Raise ``AbiMismatch`` unless a manifest ABI equals the cubin's parameter table exactly."""
    from .ptx import AbiMismatch

    placed, total = place_params(name, cubin, entry, abi, block)
    if placed != abi or total != param_bytes:
        raise AbiMismatch(f"{name}: manifest parameter offsets/size differ from the cubin's")

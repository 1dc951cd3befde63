"""Read the facts the runtime depends on out of generated PTX, and check them against a spec.

The build refuses to write a manifest whose declared ABI disagrees with what the compiler
actually emitted: parameter count, order, PTX type, size and alignment, block and cluster shape
(a kernel with cluster instructions must declare a cluster, which the runtime sets at launch
when the PTX does not fix it), and whether the kernel waits for its predecessor's grid
(``griddepcontrol.wait``, required of a kernel the runtime launches as a programmatic dependent).
"""

import re

from ..specs import SCALAR_TYPES, KernelSpec, abi_layout

_ENTRY = re.compile(r"\.visible\s+\.entry\s+(\w+)\s*\(([^)]*)\)", re.S)
_PARAM = re.compile(r"\.param\s+(?P<body>[^,]*?)\s+(?P<name>\w+)(?:\[(?P<bytes>\d+)\])?\s*$")
_REQNTID = re.compile(r"\.reqntid\s+(\d+)\s*,\s*(\d+)\s*,\s*(\d+)")
_CLUSTER = re.compile(r"\.(?:reqnctapercluster|explicitcluster)\s*([\d\s,]*)")
# Instructions that need the CTA to run in a cluster of more than one CTA.
_CLUSTER_OPS = re.compile(r"multicast::cluster|barrier\.cluster\.")
_PTX_SIZES = {".u64": 8, ".b64": 8, ".s64": 8, ".u32": 4, ".b32": 4, ".s32": 4, ".f32": 4}


class AbiMismatch(RuntimeError):
    """The declared ABI of a specialization disagrees with the compiled PTX."""


def parse_entry(ptx: str) -> dict:
    """The single kernel entry of ``ptx``: symbol, params (type, size, align), block, cluster."""
    entries = _ENTRY.findall(ptx)
    if len(entries) != 1:
        raise AbiMismatch(f"expected exactly one .entry in the PTX, found {len(entries)}")
    symbol, body = entries[0]
    params = []
    for line in body.split(","):
        m = _PARAM.search(line.strip())
        if m is None:
            raise AbiMismatch(f"unparsed .param declaration {line.strip()!r} in {symbol}")
        words = m.group("body").split()
        ptx_type = next(w for w in words if w in _PTX_SIZES or w == ".b8")
        align = int(words[words.index(".align") + 1]) if ".align" in words and ".ptr" not in words else None
        size = int(m.group("bytes")) if m.group("bytes") else _PTX_SIZES[ptx_type]
        params.append({"ptx_type": ptx_type, "size": size, "align": align or size, "is_pointer": ".ptr" in words})
    tail = ptx[ptx.index(symbol) :]
    header = tail[: tail.index("{")]
    block = _REQNTID.search(header)
    cluster = _CLUSTER.search(header)
    return {
        "symbol": symbol,
        "tma_ranks": re.findall(r"cp\.async\.bulk\.tensor\.(\d)d", ptx),
        "grid_wait": "griddepcontrol.wait" in ptx,
        "params": params,
        "block": tuple(int(x) for x in block.groups()) if block else None,
        "cluster": tuple(int(x) for x in re.findall(r"\d+", cluster.group(1))) if cluster else None,
        "cluster_ops": bool(_CLUSTER_OPS.search(ptx)),
    }


def check_abi(spec: KernelSpec, entry: dict) -> list[dict]:
    """Cross-check ``spec``'s declared ABI against a parsed entry; return the manifest records."""
    declared = abi_layout(spec.params)
    emitted = entry["params"]
    where = f"{spec.name} ({entry['symbol']})"
    if len(declared) != len(emitted):
        raise AbiMismatch(f"{where}: declares {len(declared)} parameters, PTX has {len(emitted)}")
    for index, (want, got) in enumerate(zip(declared, emitted)):
        label = f"{where}: parameter {index} '{want['name']}'"
        if want["kind"] == "pointer":
            if not got["is_pointer"] or got["size"] != 8:
                raise AbiMismatch(f"{label} is declared a pointer, PTX has {got}")
        elif want["kind"] == "tma_descriptor":
            if got["ptx_type"] != ".b8" or got["is_pointer"]:
                raise AbiMismatch(f"{label} is declared a TMA descriptor, PTX has {got}")
        else:
            ptx_type = SCALAR_TYPES[want["dtype"]][1]
            if got["is_pointer"] or got["ptx_type"] != ptx_type:
                raise AbiMismatch(f"{label} is declared {want['dtype']} ({ptx_type}), PTX has {got['ptx_type']}")
        if (got["size"], got["align"]) != (want["size"], want["align"]):
            raise AbiMismatch(
                f"{label}: declared size/align {want['size']}/{want['align']}, PTX {got['size']}/{got['align']}"
            )
    ranks = sorted({r["recipe"]["rank"] for r in declared if r["kind"] == "tma_descriptor"})
    used = sorted({int(n) for n in entry["tma_ranks"]})
    if used != ranks:
        raise AbiMismatch(f"{where}: descriptors declare TMA ranks {ranks}, PTX issues {used}-d tensor copies")
    if entry["block"] != tuple(spec.block):
        raise AbiMismatch(f"{where}: declared block {spec.block}, PTX .reqntid {entry['block']}")
    if entry["cluster"] not in (None, tuple(spec.cluster)):
        raise AbiMismatch(f"{where}: declared cluster {spec.cluster}, PTX {entry['cluster']}")
    if entry["cluster_ops"] != (tuple(spec.cluster) != (1, 1, 1)):
        raise AbiMismatch(
            f"{where}: declared cluster {spec.cluster}, but the PTX "
            f"{'has' if entry['cluster_ops'] else 'has no'} cluster instructions"
        )
    if entry["grid_wait"] != spec.dependent_launch:
        # A dependent launch of a kernel that never waits would race its predecessor's writes.
        raise AbiMismatch(
            f"{where}: declared dependent_launch={spec.dependent_launch}, but the PTX "
            f"{'has' if entry['grid_wait'] else 'has no'} griddepcontrol.wait"
        )
    return declared


def ptx_toolchain(ptx: str) -> dict:
    """PTX ISA version and the NVVM build that wrote it, from the PTX header."""
    isa = re.search(r"^\.version\s+([\d.]+)", ptx, re.M)
    tools = re.search(r"Cuda compilation tools, release [\d.]+, V([\d.]+)", ptx)
    return {"ptx_isa": isa.group(1) if isa else None, "nvvm": tools.group(1) if tools else None}

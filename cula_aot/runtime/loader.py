"""Load verified cubins with the CUDA driver and launch them on torch's current stream.

No JIT and no cutlass: cubins come from the manifest (sha256-checked before loading), are
loaded once per device into its primary context (the one torch uses), and their functions are
cached.  Launches go to the stream the caller passes (``ops`` read ``torch.cuda.current_stream``
once per call).
"""

import ctypes
import operator
import struct
import threading

import torch
from cuda.bindings import driver as cu

from .abi import ParamPacker
from .driver import CudaError, check
from .manifest import ArtifactError, Manifest
from .tma import DescriptorCache

_SMEM_DEFAULT_LIMIT = 48 * 1024
_CONFIG_LIMIT = 64  # cached dependent-launch configs per kernel and thread (one per grid, stream)
_ARCH_BY_CAPABILITY = {(9, 0): "sm_90a"}


def device_arch(device: torch.device) -> str:
    capability = torch.cuda.get_device_capability(device)
    return _ARCH_BY_CAPABILITY.get(capability, f"sm_{capability[0]}{capability[1]}")


def raw_stream(device: torch.device) -> int:
    """The current stream of ``device`` as a raw ``cudaStream_t`` (without building a Stream)."""
    return _current_raw_stream(device.index)


_current_raw_stream = getattr(
    torch._C, "_cuda_getCurrentRawStream", lambda index: torch.cuda.current_stream(index).cuda_stream
)


class LoadedKernel:
    """One specialization loaded on one device: function handle, launch facts, param packer."""

    def __init__(self, name: str, record: dict, function):
        self.name = name
        self.record = record
        self.function = function
        self.block = tuple(record["block"])
        self.smem = record["dynamic_smem_bytes"]
        self.grid_rule = record["grid"]
        self.packer = ParamPacker(record["params"], name, record["param_bytes"])
        self.descriptors = [
            (p["name"], p["recipe"]["source"], DescriptorCache(p["recipe"], f"{name}.{p['name']}"))
            for p in record["params"]
            if p["kind"] == "tma_descriptor"
        ]
        # What a call supplies, in ABI order: the parameters the spec declares ``per_call``
        # (``specs.abi.Param``), a descriptor by the tensor it is encoded from; the others are
        # fixed by a launch template's call signature.
        self.per_call = tuple(
            p["recipe"]["source"] if p["kind"] == "tma_descriptor" else p["name"]
            for p in record["params"]
            if p["per_call"]
        )
        self.dependent_launch = record.get("dependent_launch", False)
        # Cluster shape set at launch (the PTX of a CuTeDSL kernel does not fix it).
        self.cluster = tuple(record.get("cluster", (1, 1, 1)))
        self._thread = threading.local()  # per-thread launch buffers
        self.what = f"cuLaunchKernel({name})"

    def grid(self, values: dict) -> tuple:
        """Evaluate the manifest's grid rule: each dimension an int or a named value."""
        return tuple(d if isinstance(d, int) else int(values[d]) for d in self.grid_rule)

    def launch(self, values: dict, stream: int, smem_bytes: int | None = None, dependent: bool = False) -> None:
        """Pack ``values`` per the ABI and launch on ``stream`` (a raw ``cudaStream_t``).
        ``smem_bytes``: the dynamic shared memory of this launch, for kernels whose use depends
        on a runtime value (at most the built ``dynamic_smem_bytes``, the default).
        ``dependent``: launch as a programmatic dependent of the previous kernel on the stream
        (see ``launch_packed``)."""
        grid = self.grid(values)
        if min(grid) <= 0:
            return  # nothing to do; an empty grid is an error for the driver
        for name, source, cache in self.descriptors:
            values[name] = cache.get(values[source], values)
        self.launch_packed(self.packer.pack(values), grid, stream, smem_bytes, dependent)

    def launch_packed(
        self, packed: bytes, grid: tuple, stream: int, smem_bytes: int | None = None, dependent: bool = False
    ) -> None:
        """Launch with an already packed parameter buffer (``CU_LAUNCH_PARAM_BUFFER_POINTER``).
        The driver copies the parameters during the call (also under graph capture), so each
        thread reuses one buffer.

        ``dependent``: programmatic dependent launch (PDL, ``cuLaunchKernelEx`` with programmatic
        stream serialization): this grid's CTAs may start once every CTA of the previous kernel
        has run ``griddepcontrol.launch_dependents`` or exited (none of ours triggers early), and
        wait in ``griddepcontrol.wait`` for its end.  Only for kernels the manifest records as waiting (``dependent_launch``); under
        stream capture it becomes a programmatic graph edge."""
        if smem_bytes is None:
            smem_bytes = self.smem
        elif not 0 <= smem_bytes <= self.smem:
            raise ValueError(
                f"{self.name}: a launch asked for {smem_bytes} B of dynamic shared memory; "
                f"the kernel was built for at most {self.smem} B"
            )
        if dependent:
            self.check_dependent()
        buffers = getattr(self._thread, "buffers", None)
        if buffers is None:
            # A bytearray under a ctypes view: a slice assignment fills it in place (a third of
            # ctypes.memmove's cost), and the view's address stays the driver's parameter buffer.
            buffer = bytearray(self.packer.size)
            view = (ctypes.c_char * self.packer.size).from_buffer(buffer)
            size = ctypes.c_size_t(self.packer.size)
            extra = (ctypes.c_void_p * 5)(
                cu.CU_LAUNCH_PARAM_BUFFER_POINTER,
                ctypes.addressof(view),
                cu.CU_LAUNCH_PARAM_BUFFER_SIZE,
                ctypes.addressof(size),
                cu.CU_LAUNCH_PARAM_END,
            )
            buffers = self._thread.buffers = (buffer, (view, size, extra), ctypes.addressof(extra))
        buffers[0][:] = packed
        # The result's first entry is the CUresult, 0 on success: ``check`` only for an error.
        if dependent or self.cluster != (1, 1, 1):
            config = self._ex_config(grid, smem_bytes, stream, dependent)
            result = cu.cuLaunchKernelEx(config, self.function, 0, buffers[2])
        else:
            result = cu.cuLaunchKernel(self.function, *grid, *self.block, smem_bytes, stream, 0, buffers[2])
        if result[0]:
            check(result, self.what)

    def check_dependent(self) -> None:
        """Refuse a programmatic dependent launch of a kernel that does not wait for its predecessor."""
        if not self.dependent_launch:
            raise ValueError(
                f"{self.name} does not wait for its predecessor (griddepcontrol.wait): it cannot be "
                "launched as a programmatic dependent"
            )

    def _ex_config(self, grid: tuple, smem_bytes: int, stream: int, dependent: bool):
        """This thread's ``CUlaunchConfig`` for a launch of this shape on ``stream``: a
        programmatic dependent one, and/or in clusters of ``self.cluster`` CTAs (built once per
        shape: filling one costs microseconds of host time)."""
        configs = getattr(self._thread, "configs", None)
        if configs is None:
            configs = self._thread.configs = {}
        key = (grid, smem_bytes, stream, dependent)
        config = configs.get(key)
        if config is None:
            if any(g % c for g, c in zip(grid, self.cluster)):
                raise ValueError(f"{self.name}: grid {grid} is not a whole number of {self.cluster} clusters")
            if len(configs) >= _CONFIG_LIMIT:
                configs.clear()
            attributes = []
            if dependent:
                attribute = cu.CUlaunchAttribute()
                attribute.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
                attribute.value.programmaticStreamSerializationAllowed = 1
                attributes.append(attribute)
            if self.cluster != (1, 1, 1):
                attribute = cu.CUlaunchAttribute()
                attribute.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
                attribute.value.clusterDim.x, attribute.value.clusterDim.y, attribute.value.clusterDim.z = self.cluster
                attributes.append(attribute)
            config = configs[key] = cu.CUlaunchConfig()
            config.gridDimX, config.gridDimY, config.gridDimZ = grid
            config.blockDimX, config.blockDimY, config.blockDimZ = self.block
            config.sharedMemBytes = smem_bytes
            config.hStream = cu.CUstream(stream)
            config.attrs = attributes
            config.numAttrs = len(attributes)
        return config

    def template(self, static: dict, dependent: bool = False, smem_bytes: int | None = None) -> "LaunchTemplate":
        return LaunchTemplate(self, static, dependent, smem_bytes)


class LaunchTemplate:
    """A launch of one kernel whose parameters are fixed except its ``per_call`` ones (those the
    manifest records as per call: ``launch`` takes them by name from a call's values): the
    grid, the packing order, the static values (checked once) and the TMA descriptor shapes are
    worked out at construction, so a call only packs its per-call values and launches (the
    serving fast path).  ``smem_bytes``: this launch's dynamic shared memory where it depends
    on a static value (``LoadedKernel.launch``; None: the built size)."""

    def __init__(self, kernel: LoadedKernel, static: dict, dependent: bool = False, smem_bytes: int | None = None):
        if dependent:
            kernel.check_dependent()
        self.kernel = kernel
        self.dependent = dependent
        self.smem_bytes = smem_bytes
        self.grid = kernel.grid(static)
        self._empty = min(self.grid) <= 0
        packer = kernel.packer
        self.per_call = kernel.per_call
        # Static values as given, per-call ones as zeros of their kind (a descriptor: zero
        # bytes): packing once checks every static value, and leaves the per-call bytes zero.
        values = {}
        dynamic_format, cursor, at = "<", 0, 0
        self._descriptors = []  # (index in ``per_call``, encoder of the descriptor from its base address)
        self._pointers = []  # (index in ``per_call``, name, alignment)
        pointer_bits = 0
        for r, code in zip(packer.records, packer.codes):
            name, kind, size = r["name"], r["kind"], r["size"]
            dynamic_format += "x" * (r["offset"] - cursor)
            cursor = r["offset"] + size
            if not r["per_call"]:
                if name in static:  # a missing one: ``pack`` names it
                    values[name] = static[name]
                dynamic_format += f"{size}x"
                continue
            dynamic_format += code
            values[name] = bytes(size) if kind == "tma_descriptor" else 0
            if kind == "tma_descriptor":
                cache = next(c for n, _source, c in kernel.descriptors if n == name)
                self._descriptors.append((at, cache.resolved(static)))
            elif kind == "pointer":
                self._pointers.append((at, name, r["address_align"]))
                pointer_bits |= (r["address_align"] - 1) << (8 * r["offset"])
            at += 1
        dynamic_format += "x" * (packer.size - cursor)
        # The buffer is the static bytes OR the per-call ones (each zero where the other is set):
        # one struct.pack of the per-call values a call, and their pointers' alignment in one test.
        self._static_bits = int.from_bytes(packer.pack(values), "little")
        self._dynamic = struct.Struct(dynamic_format)
        self._pointer_bits = pointer_bits
        self._size = packer.size
        # A call's per-call values in ``per_call`` order, in one C call (a tuple even for one name).
        take = operator.itemgetter(*self.per_call)
        self._take = take if len(self.per_call) > 1 else (lambda call: (take(call),))

    def launch(self, call: dict, stream: int) -> None:
        """Launch with the per-call values taken by name from ``call`` (it may hold more)."""
        self.launch_values(self._take(call), stream)

    def launch_values(self, dynamic, stream: int) -> None:
        """Launch with the per-call values in ``per_call`` order (a descriptor's by its base address)."""
        packed = self.pack(dynamic)
        if not self._empty:  # as ``launch_buffer``, a call frame less on decode's path
            self.kernel.launch_packed(packed, self.grid, stream, self.smem_bytes, self.dependent)

    def pack(self, dynamic) -> bytes:
        """The parameter buffer of the per-call values in ``per_call`` order (a descriptor's by its
        base address) over the static ones: a caller whose values repeat keeps it for
        ``launch_buffer``."""
        descriptors = self._descriptors
        if descriptors:
            dynamic = list(dynamic)
            for at, encode in descriptors:
                dynamic[at] = encode(dynamic[at])
        bits = int.from_bytes(self._dynamic.pack(*dynamic), "little")
        if bits & self._pointer_bits:
            for at, name, align in self._pointers:
                if dynamic[at] % align:
                    raise ValueError(
                        f"{self.kernel.name}: pointer '{name}' is not {align}-byte aligned; "
                        "pass tensors whose storage starts on a 16-byte boundary"
                    )
        return (bits | self._static_bits).to_bytes(self._size, "little")

    def launch_buffer(self, packed: bytes, stream: int) -> None:
        """Launch with a buffer ``pack`` made."""
        if not self._empty:
            self.kernel.launch_packed(packed, self.grid, stream, self.smem_bytes, self.dependent)


class KernelLoader:
    """Loads manifest kernels lazily (or eagerly via ``preload``), once per device."""

    def __init__(self, manifest: Manifest):
        self.manifest = manifest
        self._lock = threading.Lock()
        self._kernels: dict[tuple[int, str], LoadedKernel] = {}
        self._by_spec: dict[tuple, LoadedKernel] = {}
        self._modules = []  # keep modules alive for the process lifetime

    def _bind_primary_context(self, index: int) -> None:
        # torch runs every device on its primary context; make it current on this thread so the
        # module lands where torch's tensors and streams live.
        torch.cuda.init()
        device = check(cu.cuDeviceGet(index), "cuDeviceGet")
        primary = check(cu.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
        current = check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if int(current) != int(primary):
            check(cu.cuCtxSetCurrent(primary), "cuCtxSetCurrent")

    def get(self, device: torch.device, spec) -> LoadedKernel:
        """The loaded kernel of specialization ``spec`` (``cula_aot.specs``) on ``device``."""
        loaded = self._by_spec.get((device.index, spec))  # the per-call fast path: one lookup
        if loaded is None:
            name, record = self.manifest.record(spec)
            loaded = self._by_spec[(device.index, spec)] = self._get(device, name, record)
        return loaded

    def _get(self, device: torch.device, name: str, record: dict) -> LoadedKernel:
        key = (device.index, name)
        loaded = self._kernels.get(key)
        if loaded is None:
            with self._lock:
                loaded = self._kernels.get(key) or self._load(device, name, record)
                self._kernels[key] = loaded
        return loaded

    def _load(self, device: torch.device, name: str, record: dict) -> LoadedKernel:
        self.manifest.check_arch(device_arch(device))
        image = self.manifest.read_cubin(record)  # sha256-verified before the driver sees it
        self._bind_primary_context(device.index)
        module = check(cu.cuModuleLoadData(image), f"cuModuleLoadData({record['cubin']})")
        self._modules.append(module)
        function = check(cu.cuModuleGetFunction(module, record["entry"].encode()), f"cuModuleGetFunction({name})")
        if record["dynamic_smem_bytes"] > _SMEM_DEFAULT_LIMIT:
            check(
                cu.cuFuncSetAttribute(
                    function,
                    cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    record["dynamic_smem_bytes"],
                ),
                f"cuFuncSetAttribute({name}, max dynamic smem)",
            )
            # All of the unified L1/shared storage as shared memory: these kernels stage through
            # smem, and K1's occupancy target (several CTAs per SM) needs it.
            check(
                cu.cuFuncSetAttribute(
                    function, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100
                ),
                f"cuFuncSetAttribute({name}, shared memory carveout)",
            )
        return LoadedKernel(name, record, function)

    def preload(self, device: torch.device) -> int:
        """Load every kernel of the manifest on ``device``; returns how many."""
        for name, record in self.manifest.kernels.items():
            self._get(device, name, record)
        return len(self.manifest.kernels)


_DEFAULT: KernelLoader | None = None
_DEFAULT_LOCK = threading.Lock()


def default_loader() -> KernelLoader:
    """The process-wide loader over the discovered manifest (see ``manifest.find_manifest``)."""
    global _DEFAULT
    if _DEFAULT is None:
        with _DEFAULT_LOCK:
            if _DEFAULT is None:
                _DEFAULT = KernelLoader(Manifest.discover())
    return _DEFAULT


__all__ = [
    "ArtifactError",
    "CudaError",
    "KernelLoader",
    "LaunchTemplate",
    "LoadedKernel",
    "check",
    "default_loader",
    "device_arch",
    "raw_stream",
]

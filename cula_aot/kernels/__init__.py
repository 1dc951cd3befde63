"""CuTeDSL kernels. Imported only by the build (``cula_aot.compiler``): never by the runtime."""

import glob
import inspect
import os

from ..specs import KernelSpec, Param
from ..specs.decode_layer import layer_smem_bytes
from . import cp_merge, decode, decode_chunk, decode_layer, fused_prefill, k1_prepare, k2_recurrence, tile_bound

# kernel name → (kernel class, device kernel, dynamic shared memory bytes of a spec).  A kernel class
# (docs/DESIGN.md, Kernels as classes) takes the codegen arguments in ``__init__`` and launches in
# ``__call__``; its ``kernel`` is the device method.
_KERNELS = {
    "k1_prepare": (k1_prepare.K1Prepare, k1_prepare.K1Prepare.kernel, lambda spec: k1_prepare.SMEM_BYTES),
    "k2_recurrence": (
        k2_recurrence.K2Recurrence,
        k2_recurrence.K2Recurrence.kernel,
        lambda spec: k2_recurrence.smem_bytes(spec.v_block, spec.stages, spec.prescan),
    ),
    "fused_prefill": (
        fused_prefill.FusedPrefill,
        fused_prefill.FusedPrefill.kernel,
        lambda spec: fused_prefill.smem_bytes(spec.stages, spec.producers),
    ),
    "fused_pieces": (
        fused_prefill.FusedPieces,
        fused_prefill.FusedPieces.kernel,
        lambda spec: fused_prefill.pieces_smem_bytes(spec.stages, spec.producers),
    ),
    "cp_merge": (cp_merge.CpMerge, cp_merge.CpMerge.kernel, lambda spec: cp_merge.smem_bytes(spec.v_block)),
    "tile_bound": (tile_bound.TileBound, tile_bound.TileBound.kernel, lambda spec: tile_bound.SMEM_BYTES),
    "kda_decode": (
        decode.KdaDecode,
        decode.KdaDecode.kernel,
        lambda spec: decode.smem_bytes(spec.v_block, spec.items, spec.bf16_state),
    ),
    "kda_decode_chunk": (
        decode_chunk.KdaDecodeChunk,
        decode_chunk.KdaDecodeChunk.kernel,
        lambda spec: decode_chunk.smem_bytes(spec.warps, spec.items),
    ),
    "kda_decode_layer": (
        decode_layer.KdaDecodeLayer,
        decode_layer.KdaDecodeLayer.kernel,
        lambda spec: layer_smem_bytes(spec.v_block, spec.items, spec.bf16_state, drafts=True),
    ),
}


def dynamic_smem_bytes(spec: KernelSpec) -> int:
    return _KERNELS[spec.kernel][2](spec)


def _fake_argument(param: Param):
    """A placeholder argument that traces to exactly the declared parameter type."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    dtypes = {"bf16": cutlass.BFloat16, "f32": cutlass.Float32, "i32": cutlass.Int32, "u8": cutlass.Uint8}
    if param.kind in ("pointer", "tma_descriptor"):  # the launcher builds descriptors from pointers
        return make_ptr(
            dtypes[param.dtype], param.address_align, cute.AddressSpace.gmem, assumed_align=param.address_align
        )
    return dtypes[param.dtype](1)


def declared_names_match(spec: KernelSpec) -> None:
    """The spec's parameter list is the one the kernel module writes out: the device kernel's
    runtime parameters in order (the list is written there, once); the class takes the codegen
    arguments in ``__init__``; its ``__call__`` takes the tensors its descriptors are built from,
    then every other parameter as ``*params``, then the stream by keyword, and passes the kernel
    the descriptors, ``*params``, the static arguments and the codegen arguments the device
    method takes, in the kernel's order."""
    launch, kernel, _ = _KERNELS[spec.kernel]
    kernel_params = _flat_parameter_names(kernel)[1:]  # less self
    init = list(inspect.signature(launch.__init__).parameters)[1:]
    if init != list(spec.args):
        raise ValueError(
            f"{spec.name}: {launch.__name__}.__init__ takes {init}, the spec's codegen arguments are {list(spec.args)}"
        )
    runtime = [n for n in kernel_params if n not in spec.args and n not in spec.static_args]
    declared = [p.name for p in spec.params]
    if runtime != declared:
        raise ValueError(f"{spec.name}: kernel parameters {runtime} != declared ABI {declared}")
    descriptors = [p for p in spec.params if p.kind == "tma_descriptor"]
    if spec.params[: len(descriptors)] != tuple(descriptors):
        raise ValueError(f"{spec.name}: the TMA descriptors must lead the parameter list")
    sources = [dict(p.recipe)["source"] for p in descriptors]
    host = inspect.unwrap(launch.__call__)
    shape = [(p.name, p.kind) for p in inspect.signature(host).parameters.values()]
    expected = (
        [("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        + [(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in sources]
        + [("params", inspect.Parameter.VAR_POSITIONAL)]
        + [("stream", inspect.Parameter.KEYWORD_ONLY)]
    )
    if shape != expected:
        raise ValueError(f"{spec.name}: launch parameters {shape} != {expected}")
    passed = _kernel_call_arguments(host)
    codegen = [name for name in spec.args if name in kernel_params]
    wanted = [p.name for p in descriptors] + ["*params"] + list(spec.static_args) + codegen
    if passed != wanted:
        raise ValueError(f"{spec.name}: the launch passes {passed} to its kernel, expected {wanted}")


def _flat_parameter_names(kernel) -> list:
    """The kernel's parameter names with each parameter group (``kernels.params``) replaced by
    the names its ``specs`` declaration gives its fields, checked against the field count."""
    from .params import is_group, leaf_count

    names = []
    for parameter in inspect.signature(inspect.unwrap(kernel)).parameters.values():
        group = parameter.annotation
        if not is_group(group):
            names.append(parameter.name)
            continue
        declared = [p.name for p in group.abi(parameter.name)]
        if len(declared) != leaf_count(group):
            raise ValueError(
                f"{kernel.__name__}: {parameter.name}: {group.__name__} has {leaf_count(group)} fields, "
                f"its declaration {declared}"
            )
        names += declared
    return names


def _kernel_call_arguments(launch) -> list:
    """The names a kernel class's ``__call__`` passes, positionally, to its kernel (from its
    source); a starred name as ``*name``, an attribute ``self.name`` (the class's configuration)
    as ``name``, and ``*grouped(kernel, a, *params)`` (``kernels.params``) as the arguments it
    groups."""
    import ast
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(launch)))
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and ast.unparse(node.func) == "self.kernel"
        and isinstance(node.func, (ast.Name, ast.Attribute))
    ]
    if len(calls) != 1 or calls[0].keywords:
        raise ValueError(f"{launch.__name__}: expected one call self.kernel(name, *params, name, ...)")
    names = []
    args = list(calls[0].args)
    while args:
        arg = args.pop(0)
        if (
            isinstance(arg, ast.Starred)
            and isinstance(arg.value, ast.Call)
            and ast.unparse(arg.value.func) == "grouped"
            and arg.value.args
            and ast.unparse(arg.value.args[0]) == "self.kernel"
            and not arg.value.keywords
        ):
            args[:0] = arg.value.args[1:]
        elif isinstance(arg, ast.Starred) and isinstance(arg.value, ast.Name):
            names.append("*" + arg.value.id)
        elif isinstance(arg, ast.Name):
            names.append(arg.id)
        elif isinstance(arg, ast.Attribute) and ast.unparse(arg.value) == "self":
            names.append(arg.attr)
        else:
            raise ValueError(f"{launch.__name__}: the kernel call passes {ast.dump(arg)}, not a name")
    return names


def compile_spec(spec: KernelSpec, arch: str, dump_dir: str) -> tuple[str, str]:
    """Compile ``spec`` for ``arch`` without a GPU; returns the (ptx, cubin) paths in ``dump_dir``."""
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute

    declared_names_match(spec)
    launch, _, _ = _KERNELS[spec.kernel]
    args = [_fake_argument(p) for p in spec.params]
    cute.compile(
        launch(**spec.args),
        *args,
        stream=cuda.CUstream(0),
        options=f"--gpu-arch {arch} --keep-cubin --keep-ptx --dump-dir {dump_dir}",
    )
    ptx = glob.glob(os.path.join(dump_dir, "*.ptx"))
    cubin = glob.glob(os.path.join(dump_dir, "*.cubin"))
    if len(ptx) != 1 or len(cubin) != 1:
        raise RuntimeError(f"{spec.name}: expected one PTX and one cubin in {dump_dir}, found {ptx + cubin}")
    return ptx[0], cubin[0]

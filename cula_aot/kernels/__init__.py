"""CuTeDSL kernels. Imported only by the build (``cula_aot.compiler``): never by the runtime."""

import glob
import inspect
import os

from ..specs import KernelSpec, Param
from ..specs.decode_layer import layer_smem_bytes
from . import cp_merge, decode, decode_chunk, decode_layer, fused_prefill, k1_prepare, k2_recurrence

# kernel name → (host launch function or kernel class, device kernel, dynamic shared memory bytes of a
# spec).  A kernel class (docs/DESIGN.md, Kernels as classes) takes the codegen arguments in
# ``__init__`` and launches in ``__call__``; its ``kernel`` is the device method.
_KERNELS = {
    "k1_prepare": (k1_prepare.k1_prepare_launch, k1_prepare.k1_prepare_kernel, lambda spec: k1_prepare.SMEM_BYTES),
    "k2_recurrence": (
        k2_recurrence.K2Recurrence,
        k2_recurrence.K2Recurrence.kernel,
        lambda spec: k2_recurrence.smem_bytes(spec.v_block, spec.stages, spec.prescan),
    ),
    "fused_prefill": (
        fused_prefill.fused_prefill_launch,
        fused_prefill.fused_prefill_kernel,
        lambda spec: fused_prefill.smem_bytes(spec.stages, spec.producers),
    ),
    "cp_merge": (cp_merge.CpMerge, cp_merge.CpMerge.kernel, lambda spec: cp_merge.smem_bytes(spec.v_block)),
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
        lambda spec: layer_smem_bytes(spec.v_block, spec.items, spec.bf16_state),
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
    runtime parameters in order (the list is written there, once); the launch function takes
    the tensors its descriptors are built from, then every other parameter as ``*params``, then
    the stream and the codegen arguments by keyword; and it passes the kernel the descriptors,
    ``*params``, the static arguments and the codegen arguments, in the kernel's order."""
    launch, kernel, _ = _KERNELS[spec.kernel]
    as_class = inspect.isclass(launch)
    kernel_params = _flat_parameter_names(kernel)
    if as_class:
        kernel_params = kernel_params[1:]  # self
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
    host = inspect.unwrap(launch.__call__ if as_class else launch)
    shape = [(p.name, p.kind) for p in inspect.signature(host).parameters.values()]
    expected = (
        [("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)] * as_class
        + [(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in sources]
        + [("params", inspect.Parameter.VAR_POSITIONAL)]
        + [(name, inspect.Parameter.KEYWORD_ONLY) for name in ("stream", *([] if as_class else spec.args))]
    )
    if shape != expected:
        raise ValueError(f"{spec.name}: launch parameters {shape} != {expected}")
    passed = _kernel_call_arguments(host, "self.kernel" if as_class else kernel.__name__)
    # A kernel class passes the codegen arguments its device method takes (a function: all of them).
    codegen = [name for name in spec.args if name in kernel_params] if as_class else list(spec.args)
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


def _kernel_call_arguments(launch, kernel_name: str) -> list:
    """The names the launch function passes, positionally, to its kernel (from its source);
    a starred name as ``*name``, an attribute ``self.name`` (a kernel class's configuration) as
    ``name``, and ``*grouped(kernel, a, *params)`` (``kernels.params``) as the arguments it groups.
    ``kernel_name``: a function's name, or ``self.kernel`` for a kernel class."""
    import ast
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(launch)))
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and ast.unparse(node.func) == kernel_name
        and isinstance(node.func, (ast.Name, ast.Attribute))
    ]
    if len(calls) != 1 or calls[0].keywords:
        raise ValueError(f"{launch.__name__}: expected one call {kernel_name}(name, *params, name, ...)")
    names = []
    args = list(calls[0].args)
    while args:
        arg = args.pop(0)
        if (
            isinstance(arg, ast.Starred)
            and isinstance(arg.value, ast.Call)
            and ast.unparse(arg.value.func) == "grouped"
            and arg.value.args
            and ast.unparse(arg.value.args[0]) == kernel_name
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
    codegen = spec.args
    if inspect.isclass(launch):  # a kernel class: configured by the codegen arguments
        launch, codegen = launch(**spec.args), {}
    cute.compile(
        launch,
        *args,
        stream=cuda.CUstream(0),
        **codegen,
        options=f"--gpu-arch {arch} --keep-cubin --keep-ptx --dump-dir {dump_dir}",
    )
    ptx = glob.glob(os.path.join(dump_dir, "*.ptx"))
    cubin = glob.glob(os.path.join(dump_dir, "*.cubin"))
    if len(ptx) != 1 or len(cubin) != 1:
        raise RuntimeError(f"{spec.name}: expected one PTX and one cubin in {dump_dir}, found {ptx + cubin}")
    return ptx[0], cubin[0]

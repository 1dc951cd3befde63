"""Each kernel's parameter list is declared once, in its spec (``cula_aot/specs/``), and written
out once in its kernel module, as the device kernel's signature; the kernel class's ``__call__``
forwards it as ``*params`` (after the tensors its TMA descriptors are built from).
``kernels.declared_names_match`` checks the kernel signature against the spec by name and order,
and the launch function's shape and its call of the kernel (the build runs it before every
compile; CPU only).  The runtime takes each launch's per-call values by name from the
manifest's parameters (``runtime.loader.LoadedKernel.per_call``)."""

import inspect

import pytest

pytest.importorskip("cutlass")

from cula_aot.kernels import declared_names_match  # noqa: E402
from cula_aot.specs import K1Spec, MergeSpec, default_specs  # noqa: E402


@pytest.mark.parametrize("spec", default_specs(), ids=lambda spec: spec.name)
def test_every_kernel_module_writes_its_spec_parameter_list(spec):
    declared_names_match(spec)


def test_a_reordered_kernel_call_is_caught(monkeypatch):
    from cula_aot.kernels import _kernel_call_arguments, k1_prepare

    passed = _kernel_call_arguments(k1_prepare.K1Prepare.__call__)
    assert passed == ["tma_q", "tma_k", "tma_g", "*params", "token_coords"]
    swapped = [passed[1], passed[0], *passed[2:]]
    monkeypatch.setattr("cula_aot.kernels._kernel_call_arguments", lambda launch: swapped)
    with pytest.raises(ValueError, match="the launch passes"):
        declared_names_match(K1Spec(varlen=True))


def test_a_kernel_signature_off_the_spec_is_caught(monkeypatch):
    from cula_aot.kernels import cp_merge

    kernel = inspect.unwrap(cp_merge.CpMerge.kernel)
    names = list(inspect.signature(kernel).parameters.values())
    i = [p.name for p in names].index("num_seqs")
    names[i], names[i + 1] = names[i + 1], names[i]
    monkeypatch.setattr(kernel, "__signature__", inspect.Signature(names), raising=False)
    with pytest.raises(ValueError, match="kernel parameters"):
        declared_names_match(MergeSpec(v_block=8))

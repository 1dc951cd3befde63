"""Each kernel's parameter list is declared once, in its spec (``cula_aot/specs/``); the kernel
module writes it out three times (the device kernel's signature, the launch function's
signature, the launch's call of the kernel), and ``kernels.declared_names_match`` checks all
three against the spec, by name and order (the build runs it before every compile; CPU only).
The runtime's per-call value tuples are checked against the manifest's parameters when a
launch template is made (``runtime.loader.LaunchTemplate``)."""

import pytest

pytest.importorskip("cutlass")

from cula_aot.kernels import declared_names_match  # noqa: E402
from cula_aot.specs import MergeSpec, default_specs  # noqa: E402


@pytest.mark.parametrize("spec", default_specs(), ids=lambda spec: spec.name)
def test_every_kernel_module_writes_its_spec_parameter_list(spec):
    declared_names_match(spec)


def test_a_reordered_kernel_call_is_caught(monkeypatch):
    from cula_aot.kernels import _kernel_call_arguments, cp_merge

    passed = _kernel_call_arguments(cp_merge.cp_merge_launch, "cp_merge_kernel")
    swapped = passed[:]
    i = swapped.index("num_seqs")
    swapped[i], swapped[i + 1] = swapped[i + 1], swapped[i]
    monkeypatch.setattr("cula_aot.kernels._kernel_call_arguments", lambda launch, name: swapped)
    with pytest.raises(ValueError, match="the launch passes"):
        declared_names_match(MergeSpec(v_block=8))

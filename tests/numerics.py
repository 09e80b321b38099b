"""The one assertion of SPEC 4 (the rule itself lives in fusedattn.validate)."""

from __future__ import annotations

import torch

from fusedattn.validate import compare_to_reference


def assert_close_to_reference(name: str, ours: torch.Tensor, lowp: torch.Tensor, ref64: torch.Tensor) -> None:
    result = compare_to_reference(ours, lowp, ref64)
    assert not result.problem, f"{name}: {result.problem}"
    assert result.ok, (f"{name}: max error {result.error:.3e} > bound {result.bound:.3e} "
                       f"(2 x eager {ours.dtype} error + 1e-5)")

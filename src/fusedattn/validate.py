"""The correctness rule (docs/SEMANTICS.md, "Correctness rule"), shared by the test-suite and ``python -m fusedattn``:

    max|ours - ref64| <= 2 * max|eager_lowp - ref64| + 1e-5

where ref64 is the reference in float64 and eager_lowp the same math by plain PyTorch in
the input dtype. Non-finite reference entries (lse = -inf of a row with no key) must be
matched exactly, and NaN never passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ABS_SLACK = 1e-5


@dataclass(frozen=True)
class Comparison:
    error: float
    bound: float
    problem: str = ""  # non-empty: a structural failure (NaN, mismatched infinities, shape)

    @property
    def ok(self) -> bool:
        return not self.problem and self.error <= self.bound


def compare_to_reference(ours: torch.Tensor, lowp: torch.Tensor, ref64: torch.Tensor) -> Comparison:
    if ours.shape != ref64.shape:
        return Comparison(float("inf"), 0.0, f"shape {tuple(ours.shape)} != reference {tuple(ref64.shape)}")
    ours64, lowp64 = ours.detach().double(), lowp.detach().double()
    ref64 = ref64.detach().double()
    if torch.isnan(ours64).any():
        return Comparison(float("nan"), 0.0, "NaN in the result")
    finite = torch.isfinite(ref64)
    if not torch.equal(ours64[~finite], ref64[~finite]) or not torch.isfinite(ours64[finite]).all():
        return Comparison(float("inf"), 0.0, "non-finite entries differ from the reference")
    if not finite.any():
        return Comparison(0.0, ABS_SLACK)
    if not torch.isfinite(lowp64[finite]).all():
        return Comparison(float("inf"), 0.0, "the eager low-precision baseline overflowed")
    error = (ours64 - ref64)[finite].abs().max().item()
    bound = 2 * (lowp64 - ref64)[finite].abs().max().item() + ABS_SLACK
    return Comparison(error, bound)

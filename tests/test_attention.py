"""Output, lse and every gradient against the float64 reference (SPEC 4), on both backends.

Without a GPU the Triton kernels run under the interpreter on the QUICK grid (fp16/fp32;
the interpreter's bf16 dot is unusable); on a GPU they run the FULL grid in bf16/fp16/fp32.
The PyTorch path always runs on CPU tensors, bf16 included.
"""

from dataclasses import replace

import pytest
import torch

from attention_runner import check_case
from cases import FULL, QUICK

ON_GPU = torch.cuda.is_available()
TRITON_DEVICE = "cuda" if ON_GPU else "cpu"
TRITON_CASES = FULL if ON_GPU else QUICK
TORCH_CASES = QUICK + [replace(c, dtype=torch.bfloat16) for c in QUICK[::4]]


@pytest.mark.parametrize("case", TRITON_CASES, ids=lambda c: c.id)
def test_triton_kernels_match_reference(case):
    check_case(case, "triton", TRITON_DEVICE)


@pytest.mark.parametrize("case", TORCH_CASES, ids=lambda c: c.id)
def test_torch_path_matches_reference(case):
    check_case(case, "torch", "cpu")

"""Test setup: without a GPU the Triton kernels run under Triton's interpreter.

TRITON_INTERPRET must be set before fusedattn (and its @triton.jit kernels) is imported.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

"""fusedattn: exact fused softmax attention, forward and backward, in Triton."""

from .interface import attention, use_backend

__version__ = "0.1.0"
__all__ = ["attention", "use_backend", "__version__"]

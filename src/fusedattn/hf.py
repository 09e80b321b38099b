"""``import fusedattn.hf`` registers ``attn_implementation="fusedattn"`` with Hugging Face
transformers (``fusedattn.integrations.transformers.register``)."""

from .integrations.transformers import NAME, register

register()

__all__ = ["NAME", "register"]

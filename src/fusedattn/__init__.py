"""fusedattn: exact fused softmax attention, forward and backward, in Triton."""

from .block_mask import BlockMask
from .dynamic_mask import topk_block_mask, topk_mask
from .interface import attention, explain, use_backend
from .kvcache import kvcache_attention
from .merge import merge_attention
from .torch_sdpa import routed_sdpa, sdpa
from .varlen import varlen_attention

from . import dropout, flash_attn
from ._version import __version__

__all__ = ["attention", "varlen_attention", "kvcache_attention", "merge_attention", "BlockMask", "topk_mask", "topk_block_mask",
           "use_backend", "explain", "flash_attn", "dropout", "sdpa", "routed_sdpa",
           "__version__"]

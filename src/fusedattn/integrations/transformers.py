"""Hugging Face transformers on fusedattn: ``attn_implementation="fusedattn"``.

    import fusedattn.hf                      # or: fusedattn.integrations.transformers.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="fusedattn")

``register()`` adds an attention function and its mask function to transformers' two registries
(``AttentionInterface`` and ``AttentionMaskInterface``; a name missing from the mask registry
makes transformers drop padding masks without a word, so both are always registered together).

What each call of a model's attention becomes:

- no padding: ``fusedattn.attention`` on the (B, S, H, D) views transformers' projections
  already have, causal aligned bottom-right (the queries are a sequence's last tokens, as when
  decoding over a cache);
- a 2-D padding mask: the padded tokens are dropped and the sequences packed for
  ``fusedattn.varlen_attention``; the output has zeros at padded query positions (as
  FlashAttention's integration gives; eager attention gives values there that no token reads);
- padding-free packed batches: ``position_ids`` of one row that restart per document (as
  ``DataCollatorWithFlattening`` makes them), or ``cu_seq_lens_q/k`` with ``max_length_q/k``
  given directly: ``varlen_attention`` over the documents;
- a 4-D mask (one the caller built, or the one this mask function builds when a model overlays
  its own mask rule, e.g. bidirectional image tokens): the mask itself, bool as ``mask`` and float
  as ``bias``, in place of causal and the window, as eager attention uses it;
- ``sliding_window=W`` (Mistral, Gemma 2/3, gpt-oss): a window of W keys including the query's
  own, ``window=(W - 1, 0)`` (``(W - 1, W - 1)`` when not causal); ``softcap`` (Gemma 2);
  ``s_aux`` (gpt-oss's sinks, with their gradient); ``scaling``; grouped-query heads as they are.

- Llama 4's chunked layers (``config.layer_types[i] == "chunked_attention"``, chunks of
  ``config.attention_chunk_size``): ``chunk=C`` with causal, in each of the paths above (per
  sequence, or per document of a row packed by ``cu_seq_lens_q/k``: each document's chunks start at
  its first token, as when it runs alone). A row packed by ``position_ids`` alone gets transformers'
  own 4-D mask, followed exactly (Llama 4's layers do not pass position_ids on, and its eager mask
  counts chunks from the row's start). Bottom-right alignment puts a query at its absolute position (less the left
  padding, as transformers' ``chunked_overlay`` counts) wherever the keys start at the sequence's
  first token; where a cache layer has dropped its oldest tokens (Llama 4's chunked layers keep the
  last C - 1 in a ``DynamicSlidingWindowLayer``), the mask function gives the exact 4-D mask
  instead (a decoding step: a few rows of at most C + S keys).

Attention dropout: transformers passes ``dropout`` (the config's ``attention_dropout`` in training, 0
in eval mode) and it becomes ``dropout_p`` on every path above (docs/SEMANTICS.md 3.11: fusedattn's
own mask, p rounded to a multiple of 1/256).
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from ..interface import attention
from ..varlen import varlen_attention

NAME = "fusedattn"

__all__ = ["NAME", "register", "attention_forward", "attention_mask"]


def register(name: str = NAME) -> str:
    """Registers fusedattn with transformers as ``attn_implementation=name`` (idempotent).
    Returns the name."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as error:  # transformers is an optional extra
        raise ImportError("fusedattn.integrations.transformers needs transformers: "
                          "pip install 'fusedattn[hf]'") from error
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, attention_mask)
    return name


# ---------------------------------------------------------------------------------------------
# The mask function: what transformers hands the attention function as `attention_mask`.


def attention_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0, mask_function=None,
                   attention_mask: Optional[torch.Tensor] = None, **kwargs):
    """None where the model's own rule is causal (or bidirectional) plus a window the attention
    function applies itself; the 2-D padding mask, cut to the last ``kv_length`` keys, where a
    token is padding; and a full 4-D bool mask where the model overlays a rule of its own (the
    fused kernels take it as a mask, exactly).

    A chunked mask (``create_chunked_causal_mask``: ``local_size`` = the config's
    ``attention_chunk_size``) is the padding mask, as for the others -- the attention function
    applies ``chunk=`` on the layers the config names chunked -- while the keys start at position 0
    (``kv_offset == 0``); over a cache layer that dropped its first ``kv_offset`` tokens the chunk
    boundaries no longer fall where bottom-right alignment puts them, and the exact 4-D mask is made."""
    config = kwargs.get("config")
    overlaid = attention_mask is None and kwargs.get("allow_is_causal_skip", True) is False \
        and not (_known(q_length) and q_length == 1)
    if getattr(config, "attention_chunk_size", None) is not None and overlaid:
        # Llama 4's layers do not hand position_ids to the attention function: a packed row found
        # from them is seen here alone (transformers overlays its packing rule), so its own mask is
        # made and followed, with eager's meaning (chunks counted from the row's start), whatever
        # else (cu_seq_lens_q/k) the attention function is told.
        return _materialised(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                             kwargs.get("use_vmap", False), kwargs.get("device", "cpu"))
    if _may_be_chunked_mask(config, kwargs.get("local_size")) and not (_known(kv_offset) and kv_offset == 0):
        return _materialised(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                             kwargs.get("use_vmap", False), kwargs.get("device", "cpu"))
    if kwargs.get("use_vmap", False):
        # the model combined its mask rule with another (or_mask_function / and_mask_function):
        # only the materialised mask says what it is.
        return _materialised(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                             True, kwargs.get("device", "cpu"))
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:]
    # a mask shorter than the keys (a static cache's unwritten rows) must stay, to cut the keys
    if attention_mask.shape[1] == kv_length and not torch.compiler.is_compiling() and bool(attention_mask.all()):
        return None
    return attention_mask


def _known(value) -> bool:
    return isinstance(value, int)


def _materialised(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, use_vmap,
                  device) -> torch.Tensor:
    """The model's mask rule as a (B, 1, Sq, Sk) bool tensor (True = attend), exactly as transformers makes it."""
    from transformers.masking_utils import sdpa_mask
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                     allow_is_causal_skip=False, allow_is_bidirectional_skip=False, use_vmap=use_vmap, device=device)


def _may_be_chunked_mask(config, local_size) -> bool:
    """Whether the mask asked for may be ``create_chunked_causal_mask``'s: it passes the config's
    ``attention_chunk_size`` as ``local_size``. A sliding-window mask of the same length cannot be
    told apart; both are then materialised where keys were dropped, which is exact for either."""
    chunk = getattr(config, "attention_chunk_size", None) if config is not None else None
    return chunk is not None and local_size == chunk


def _layer_chunk(module: torch.nn.Module) -> Optional[int]:
    """The chunk length of ``module``'s layer where it is a chunked one, else None: the config's
    ``layer_types`` entry for the module's ``layer_idx`` (Llama 4: ``"chunked_attention"``), or, without
    ``layer_types``, every layer of a config with ``attention_chunk_size`` (as transformers' caches read it)."""
    config = getattr(module, "config", None)
    chunk = getattr(config, "attention_chunk_size", None) if config is not None else None
    if chunk is None:
        return None
    layer_types, layer = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    if layer_types is None:
        return int(chunk)
    if layer is None:
        raise NotImplementedError("fusedattn: chunked attention on a module without `layer_idx`: which layers are "
                                  "chunked cannot be told; use attn_implementation='sdpa' for this model")
    return int(chunk) if layer_types[layer] == "chunked_attention" else None


# ---------------------------------------------------------------------------------------------
# The attention function.


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                      sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                      is_causal: Optional[bool] = None, s_aux: Optional[torch.Tensor] = None, **kwargs):
    """transformers' attention-function contract: query (B, Hq, Sq, D), key / value (B, Hkv, Sk, D)
    in, (out (B, Sq, Hq, Dv), None) out -- fusedattn does not form the attention weights."""
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    options = dict(scale=scaling, softcap=softcap or None, sinks=s_aux, dropout_p=float(dropout or 0.0))
    # (B, S, H, D) views: transformers' projections are laid out this way before their transpose
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)

    if attention_mask is not None and attention_mask.dim() == 4:
        rule = dict(mask=attention_mask) if attention_mask.dtype == torch.bool else dict(bias=attention_mask)
        return attention(q, k, v, **rule, **options), None

    window = None
    if sliding_window:
        window = (sliding_window - 1, 0 if causal else sliding_window - 1)
    options.update(causal=causal, window=window, chunk=_layer_chunk(module))

    if attention_mask is not None:
        return _padded(q, k, v, attention_mask.bool(), options), None
    packing = _packing(kwargs, q, k)
    if packing is not None:
        cu_q, cu_k, max_q, max_k = packing
        batch, seqlen_q = q.shape[:2]
        out = varlen_attention(_tokens(q), _tokens(k), _tokens(v), cu_q, cu_k, max_q, max_k, **options)
        return out.view(batch, seqlen_q, *out.shape[1:]), None
    return attention(q, k, v, **options), None


def _tokens(x: torch.Tensor) -> torch.Tensor:
    """(B, S, H, D) -> (B * S, H, D), a view where the layout allows."""
    return x.reshape(-1, *x.shape[2:])


def _padded(q, k, v, mask: torch.Tensor, options: dict) -> torch.Tensor:
    """Attention of the real tokens of a padded batch, packed for the varlen kernels. ``mask`` is
    (B, mask length): True for a real token, over the keys' last positions (left padding assumed
    for the queries, as in generation; where queries and keys are the same tokens, any padding)."""
    batch, seqlen_q, heads_q = q.shape[:3]
    if k.shape[1] > mask.shape[1]:  # a static cache: rows past the mask are not written yet
        k, v = k[:, :mask.shape[1]], v[:, :mask.shape[1]]
    seqlen_k = k.shape[1]
    mask = mask[:, -seqlen_k:]
    keys = mask.reshape(-1).nonzero().squeeze(1)
    lengths_k = mask.sum(1, dtype=torch.int32)
    if seqlen_q == seqlen_k:
        queries, lengths_q = keys, lengths_k
    else:
        mask_q = mask[:, -seqlen_q:]
        queries = mask_q.reshape(-1).nonzero().squeeze(1)
        lengths_q = mask_q.sum(1, dtype=torch.int32)
    cu_q, cu_k = _offsets(lengths_q), _offsets(lengths_k)
    max_q, max_k = torch.stack((lengths_q.max(), lengths_k.max())).tolist()  # one read of the device
    packed = varlen_attention(_tokens(q)[queries], _tokens(k)[keys], _tokens(v)[keys], cu_q, cu_k, max_q, max_k,
                              **options)
    out = packed.new_zeros(batch * seqlen_q, heads_q, packed.shape[-1])
    out = out.index_copy(0, queries, packed)  # out of place: the gradient flows back to `packed`
    return out.view(batch, seqlen_q, heads_q, -1)


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))


# One forward pass hands every layer the same position_ids: the documents are found once.
_last_packing: list = [None, -1, None]  # [weakref to position_ids, its version counter, its packing]


def _packing(kwargs: dict, q: torch.Tensor, k: torch.Tensor):
    """(cu_q, cu_k, max_q, max_k) for a padding-free packed batch, else None: from
    ``cu_seq_lens_q/k`` and ``max_length_q/k`` when the caller gives them, else from
    ``position_ids`` of a single row that restart (a document starts wherever a position does not
    follow the one before, the rule transformers' own masks use)."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None:
        max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
        cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
        if max_q is None or max_k is None:  # one read of the device for both
            max_q, max_k = torch.stack(((cu_q[1:] - cu_q[:-1]).max(), (cu_k[1:] - cu_k[:-1]).max())).tolist()
        return cu_q, cu_k, int(max_q), int(max_k)
    position_ids = kwargs.get("position_ids")
    if position_ids is None or q.shape[0] != 1 or q.shape[1] < 2 or position_ids.shape[-1] != q.shape[1] \
            or k.shape[1] != q.shape[1]:  # keys beyond the queries (a cache) are not a packed batch
        return None
    compiling = torch.compiler.is_compiling()
    cached_ref, cached_version, cached = _last_packing
    if not compiling and cached_ref is not None and cached_ref() is position_ids \
            and cached_version == position_ids._version:
        return cached
    positions = position_ids.reshape(-1)
    starts = torch.nonzero(positions[1:] != positions[:-1] + 1).squeeze(1) + 1
    if starts.numel() == 0:
        packing = None
    else:
        bounds = torch.cat((starts.new_zeros(1), starts, starts.new_full((1,), positions.numel())))
        cu = bounds.to(device=q.device, dtype=torch.int32)
        longest = int((bounds[1:] - bounds[:-1]).max())
        packing = (cu, cu, longest, longest)
    if not compiling:
        _last_packing[:] = [weakref.ref(position_ids), position_ids._version, packing]
    return packing

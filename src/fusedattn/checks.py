"""Input validation (docs/SEMANTICS.md, "Errors"): every bad input becomes a ValueError or TypeError that
names the argument, what was given and what was expected -- never a Triton compile
error, an illegal memory access or a silently wrong result."""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch

from .block_mask import BlockMask
from .spec import LAYOUTS, is_integer

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_DIM, MAX_HEAD_DIM = 8, 256


class Shapes(NamedTuple):  # a tuple: made on every call (a frozen dataclass measured slower)
    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    head_dim_v: int


def _layout_names(layout: str) -> str:
    return "(B, S, H, D)" if layout == "bshd" else "(B, H, S, D)"


def is_real(value) -> bool:
    """A Python or NumPy real number (``np.float32`` included), not a bool."""
    return type(value) is float or type(value) is int or (isinstance(value, numbers.Real)
                                                          and not isinstance(value, bool))


def check_bool(name: str, value, caller: str = "fusedattn.attention") -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{caller}: `{name}` must be a bool, got {type(value).__name__} {value!r}")


def check_window(window, caller: str = "fusedattn.attention") -> None:
    """None, or a (left, right) pair of ints, each >= 0 or -1 for unbounded on that side."""
    if window is None:
        return
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(f"{caller}: `window` must be a (left, right) pair or None, got {window!r}")
    for side, w in zip(("left", "right"), window):
        if not is_integer(w):
            raise TypeError(f"{caller}: `window` {side} must be an int, got {type(w).__name__} {w!r}")
        if w < -1:
            raise ValueError(f"{caller}: `window` {side} must be >= 0, or -1 for unbounded, got {w}")


def check_options(*, layout, causal, window, scale, softcap, deterministic, return_lse,
                  caller: str = "fusedattn.attention") -> None:
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"{caller}: `layout` must be one of {LAYOUTS}, got {layout!r}")
    for name, value in (("causal", causal), ("deterministic", deterministic), ("return_lse", return_lse)):
        check_bool(name, value, caller)
    check_window(window, caller)
    if scale is not None:
        if not is_real(scale):
            raise TypeError(f"{caller}: `scale` must be a float or None, got {type(scale).__name__}")
        if not math.isfinite(scale):
            raise ValueError(f"{caller}: `scale` must be finite, got {scale}")
    if softcap is not None:
        if not is_real(softcap):
            raise TypeError(f"{caller}: `softcap` must be a float > 0 or None, got {type(softcap).__name__}")
        if not (math.isfinite(softcap) and softcap > 0):
            raise ValueError(f"{caller}: `softcap` must be a finite float > 0 (None = off), got {softcap}")


def check_qkv(q, k, v, layout: str, caller: str = "fusedattn.attention", packed: bool = False) -> Shapes:
    """The shapes of q, k, v checked; ``packed``: the (total tokens, heads, head dim)
    tensors of ``varlen_attention``, checked as one batch. The messages are made only on failure:
    every call runs these checks (they count in a short step's host time)."""
    rank = 3 if packed else 4

    def dims() -> str:
        return "(total tokens, heads, head dim)" if packed else _layout_names(layout)

    check_tensors(caller, (("q", q), ("k", k), ("v", v)), rank,
                  lambda: dims() + ("" if packed else f" for layout={layout!r}"))

    def bhsd(t):
        b, x1, x2, d = t.shape if not packed else (1, *t.shape)
        return (b, x2, x1, d) if layout == "bshd" else (b, x1, x2, d)

    (bq, hq, sq, d), (bk, hk, sk, dk), (bv, hv, sv, dv) = bhsd(q), bhsd(k), bhsd(v)

    def where() -> str:
        return f"(dims {dims()})" if packed else f"(layout={layout!r}, dims {dims()})"

    if not (bq == bk == bv):
        raise ValueError(f"{caller}: batch sizes differ: q {bq}, k {bk}, v {bv} {where()}")
    if sk != sv:
        raise ValueError(f"{caller}: `k` has {sk} keys but `v` has {sv} {where()}")
    if hk != hv:
        raise ValueError(f"{caller}: `k` has {hk} heads but `v` has {hv} {where()}")
    if dk != d:
        raise ValueError(f"{caller}: `k` head dim {dk} must equal `q` head dim {d} {where()}")
    check_heads_and_dims(caller, hq, hk, d, dv, where)
    return Shapes(bq, hq, hk, sq, sk, d, dv)


def check_tensors(caller: str, named: tuple, rank: int, dims) -> None:
    """Each (name, tensor) a ``rank``-D tensor (shaped ``dims``: a string, or a function that makes
    it) of a supported dtype on a CUDA or CPU device, all of one dtype and device."""
    first = named[0][1]
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{caller}: `{name}` must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{caller}: `{name}` has dtype {t.dtype}; expected one of float16, bfloat16, float32"
            )
        if t.dim() != rank:
            raise ValueError(f"{caller}: `{name}` must be {rank}-D {dims if isinstance(dims, str) else dims()}, "
                             f"got shape {tuple(t.shape)}")
        if not (t.is_cuda or t.is_cpu):
            raise ValueError(f"{caller}: `{name}` is on {t.device}; expected a CUDA or CPU tensor")
        if t.dtype != first.dtype:
            raise TypeError(f"{caller}: {', '.join(n for n, _ in named)} must share a dtype, "
                            f"got {', '.join(str(x.dtype) for _, x in named)}")
    if len(named) > 1 and any(t.device != first.device for _, t in named[1:]):
        raise ValueError(f"{caller}: {', '.join(n for n, _ in named)} must be on one device, "
                         f"got {', '.join(str(t.device) for _, t in named)}")


def check_heads_and_dims(caller: str, heads_q: int, heads_kv: int, head_dim: int, head_dim_v: int, where) -> None:
    """Query heads a multiple of the key/value heads (GQA) and head dims in the supported range.
    ``where()``: the message's context, made on failure only (the checks run on every call)."""
    if heads_kv == 0 or heads_q % heads_kv != 0:
        raise ValueError(f"{caller}: q heads ({heads_q}) must be a multiple of k/v heads ({heads_kv}) {where()}")
    for name, dim in (("q/k", head_dim), ("v", head_dim_v)):
        if not MIN_HEAD_DIM <= dim <= MAX_HEAD_DIM:
            raise ValueError(
                f"{caller}: {name} head dim {dim} is not supported: expected "
                f"{MIN_HEAD_DIM} <= head dim <= {MAX_HEAD_DIM}"
            )


def check_sinks(sinks, q: torch.Tensor, heads_q: int) -> None:
    """sinks: None or a floating (Hq,) tensor on q's device."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"fusedattn.attention: `sinks` must be a torch.Tensor of shape ({heads_q},), "
                        f"got {type(sinks).__name__}")
    if sinks.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"fusedattn.attention: `sinks` must be float16, bfloat16 or float32, got {sinks.dtype}")
    if tuple(sinks.shape) != (heads_q,):
        raise ValueError(f"fusedattn.attention: `sinks` must have shape ({heads_q},) (one logit per query head), "
                         f"got {tuple(sinks.shape)}")
    if sinks.device != q.device:
        raise ValueError(f"fusedattn.attention: `sinks` is on {sinks.device} but q is on {q.device}")


def check_broadcast_4d(name: str, t, shapes: Shapes, q: torch.Tensor) -> torch.Tensor:
    """A mask or bias broadcastable to (B, Hq, Sq, Sk), returned as a 4-D view: fewer
    dims are leading 1s (as torch broadcasting); B, Sq, Sk each 1 or full, H one of 1, Hkv, Hq."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"fusedattn.attention: `{name}` must be a torch.Tensor, got {type(t).__name__}")
    if t.device != q.device:
        raise ValueError(f"fusedattn.attention: `{name}` is on {t.device} but q is on {q.device}")
    if t.dim() > 4:
        raise ValueError(f"fusedattn.attention: `{name}` must have at most 4 dims (B, H, Sq, Sk), "
                         f"got shape {tuple(t.shape)}")
    t4 = t.reshape((1,) * (4 - t.dim()) + tuple(t.shape)) if t.dim() < 4 else t
    _check_broadcast_shape(name, tuple(t.shape), tuple(t4.shape), shapes)
    return t4


def _check_broadcast_shape(name: str, given: tuple, shape4: tuple, shapes: Shapes) -> None:
    full = (shapes.batch, shapes.heads_q, shapes.seqlen_q, shapes.seqlen_k)
    allowed = [(1, shapes.batch), (1, shapes.heads_kv, shapes.heads_q), (1, shapes.seqlen_q), (1, shapes.seqlen_k)]
    for axis, (size, ok) in enumerate(zip(shape4, allowed)):
        if size not in ok:
            raise ValueError(
                f"fusedattn.attention: `{name}` of shape {given} does not broadcast to (B, Hq, Sq, Sk) = "
                f"{full}: dim {'BHQK'[axis]} is {size}, expected one of {sorted(set(ok))} (H may also be Hkv)")


def check_mask(mask, shapes: Shapes, q: torch.Tensor) -> BlockMask | None:
    """None, or the mask with its tile states: a bool tensor (True = attend) is classified here,
    once per call; a ``BlockMask`` built beforehand is checked against the problem."""
    if mask is None:
        return None
    if isinstance(mask, BlockMask):
        mask.check_current()
        if mask.device != q.device:
            raise ValueError(f"fusedattn.attention: `mask` (a BlockMask) is on {mask.device} but q is on {q.device}")
        _check_broadcast_shape("mask", mask.shape, mask.shape, shapes)
        return mask
    if isinstance(mask, torch.Tensor) and mask.dtype != torch.bool:
        raise TypeError(f"fusedattn.attention: `mask` must be a bool tensor (True = attend) or a "
                        f"fusedattn.BlockMask, got {mask.dtype}; an additive float mask is `bias`")
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"fusedattn.attention: `mask` must be a bool torch.Tensor or a fusedattn.BlockMask, "
                        f"got {type(mask).__name__}")
    return BlockMask.from_mask(check_broadcast_4d("mask", mask, shapes, q))


def check_bias(bias, shapes: Shapes, q: torch.Tensor) -> torch.Tensor | None:
    """None, or the bias as a 4-D view (a view keeps autograd's gradient in the bias's own shape)."""
    if bias is None:
        return None
    if isinstance(bias, torch.Tensor) and bias.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"fusedattn.attention: `bias` must be float16, bfloat16 or float32, got {bias.dtype}"
                        + ("; a boolean mask is `mask`" if bias.dtype == torch.bool else ""))
    return check_broadcast_4d("bias", bias, shapes, q)


def check_alibi(alibi_slopes, q: torch.Tensor, shapes: Shapes,
                caller: str = "fusedattn.attention", batch_name: str = "B") -> torch.Tensor | None:
    """None, or the ALiBi slopes -- a float32 (Hq,) or (B, Hq) tensor on q's device -- as the
    contiguous float32 (B, Hq) tensor every backend reads (one slope per batch and query head),
    detached: the slopes are constants and get no gradient. ``batch_name``: what B is called in the
    messages (packed sequences: ``shapes.batch`` is the number of sequences)."""
    if alibi_slopes is None:
        return None
    heads_q, batch = shapes.heads_q, shapes.batch
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"{caller}: `alibi_slopes` must be a torch.Tensor of shape ({heads_q},) or "
                        f"({batch}, {heads_q}), got {type(alibi_slopes).__name__}")
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"{caller}: `alibi_slopes` must be float32 (as FlashAttention's), got {alibi_slopes.dtype}")
    if tuple(alibi_slopes.shape) not in ((heads_q,), (batch, heads_q)):
        raise ValueError(f"{caller}: `alibi_slopes` must have shape (Hq,) = ({heads_q},) or ({batch_name}, Hq) = "
                         f"({batch}, {heads_q}), got {tuple(alibi_slopes.shape)}")
    if alibi_slopes.device != q.device:
        raise ValueError(f"{caller}: `alibi_slopes` is on {alibi_slopes.device} but q is on {q.device}")
    return alibi_slopes.detach().expand(batch, heads_q).contiguous()


def check_chunk(chunk, caller: str = "fusedattn.attention") -> None:
    """None, or the chunk length of chunked local attention: an int >= 1."""
    if chunk is None:
        return
    if not is_integer(chunk):
        raise TypeError(f"{caller}: `chunk` must be an int >= 1 or None, got {type(chunk).__name__} {chunk!r}")
    if chunk < 1:
        raise ValueError(f"{caller}: `chunk` must be >= 1 (None = off), got {chunk}")

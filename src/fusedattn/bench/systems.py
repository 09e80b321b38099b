"""The systems the benchmark compares, each as ``make(shape) -> fn(q, k, v) -> out``.

Inputs are (B, H, S, D) tensors (SDPA's layout). Every peer runs in its best
configuration for the shape (FlexAttention with a block mask, SDPA with is_causal,
never a dense float mask); a peer that is not installed, or fails on a shape, is
reported with a note instead of a time.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

import fusedattn


@dataclass(frozen=True)
class Shape:
    batch: int
    heads: int
    seqlen: int
    head_dim: int
    causal: bool
    dtype: torch.dtype = torch.bfloat16
    heads_kv: int | None = None  # grouped-query attention: fewer key/value heads than query heads
    window: int | None = None  # a causal sliding window: the keys each query sees, itself included

    @property
    def kv_heads(self) -> int:
        return self.heads if self.heads_kv is None else self.heads_kv

    @property
    def grouped(self) -> bool:
        return self.kv_heads != self.heads

    @property
    def name(self) -> str:
        group = f"-gqa{self.heads}/{self.kv_heads}" if self.grouped else ""
        window = f"-window{self.window}" if self.window else ""
        dtype = "" if self.dtype == torch.bfloat16 else f"-{str(self.dtype).replace('torch.', '')}"
        return f"D{self.head_dim}-S{self.seqlen}{group}{window}-{'causal' if self.causal else 'full'}{dtype}"

    def flops(self, mode: str) -> float:
        """FLOPs: forward 4*B*H*S*S*D (H: query heads), halved for causal (with a window: 4*B*H*D per
        kept pair); backward 2.5x forward."""
        pairs = self.seqlen * self.seqlen
        if self.window:
            pairs = sum(min(i + 1, self.window) for i in range(self.seqlen))
        fwd = 4 * self.batch * self.heads * pairs * self.head_dim
        fwd = fwd / 2 if self.causal and not self.window else fwd
        return {"fwd": fwd, "bwd": 2.5 * fwd, "fwdbwd": 3.5 * fwd}[mode]


class Unavailable(Exception):
    """The system is not installed or does not support the shape."""


def agreement(out: torch.Tensor, baseline_out: torch.Tensor) -> dict:
    """A peer's output against fusedattn's on the same inputs: the max |diff| and whether it is
    within rounding (0.05 in 16-bit, 1e-3 in float32); a row never reports a time for a wrong
    answer without saying so (``disagreement``)."""
    diff = (out.float() - baseline_out.float()).abs().max().item()
    return dict(max_diff_vs_fusedattn=diff, output_agrees=diff <= (1e-3 if out.dtype == torch.float32 else 0.05))


def disagreement(row: dict) -> str:
    """What a table line adds for a peer whose output did not agree with fusedattn's (``output_agrees``)."""
    if row.get("output_agrees", True):
        return ""
    return f"  OUTPUT DIFFERS from fusedattn's (max |diff| {row['max_diff_vs_fusedattn']:.3g})"


def failure_note(e: Exception) -> str:
    """A row's note for a system that raised: a peer failing on a shape is a result, not a crash."""
    first_line = str(e).splitlines()[0][:160] if str(e) else ""
    return f"fails: {type(e).__name__}: {first_line}"


@dataclass(frozen=True)
class System:
    name: str
    make: Callable[[Shape], Callable]
    detail: str
    # How q, k, v and dout are stored: "bhsd", or "bshd" for a peer whose kernels take (B, S, H, D)
    # (it gets (B, H, S, D) views of such tensors: no copy of its inputs in its timed step).
    layout: str = "bhsd"
    # For a peer whose own dispatcher picks a kernel: the one it picks for a shape (recorded in its rows).
    backend: Callable[[Shape], str] | None = None


def stored_as(t: torch.Tensor, layout: str) -> torch.Tensor:
    """``t`` (B, H, S, D), or with ``layout`` "bshd" a (B, H, S, D) view of a (B, S, H, D) copy."""
    return t if layout == "bhsd" else t.transpose(1, 2).contiguous().transpose(1, 2)


def _fusedattn(deterministic: bool):
    def make(shape: Shape):
        window = (shape.window - 1, 0) if shape.window else None
        return lambda q, k, v: fusedattn.attention(q, k, v, layout="bhsd", causal=shape.causal, window=window,
                                                   deterministic=deterministic)

    return make


def _sdpa(backend_name: str):
    def make(shape: Shape):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if backend_name != "MATH" and not torch.cuda.is_available():
            raise Unavailable("needs CUDA")
        backend = getattr(SDPBackend, backend_name)

        def fn(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal, enable_gqa=shape.grouped)

        return fn

    return make


def sdpa_cpu_backend(shape: Shape) -> str:
    """The backend SDPA's dispatcher picks for this shape's CPU call (its default, no context manager)."""
    from torch.nn.attention import SDPBackend

    q = torch.zeros(1, shape.heads, 8, shape.head_dim, dtype=shape.dtype)
    k = torch.zeros(1, shape.kv_heads, 8, shape.head_dim, dtype=shape.dtype)
    mask = torch.ones(8, 8, dtype=torch.bool) if shape.window else None
    choice = torch._fused_sdp_choice(q, k, k, mask, 0.0, shape.causal and not shape.window, enable_gqa=shape.grouped)
    return SDPBackend(choice).name


def _sdpa_cpu(shape: Shape):
    """SDPA as a CPU caller gets it: its default backend (``sdpa_cpu_backend``), ``is_causal``,
    ``enable_gqa``; a window only as a dense boolean (S, S) mask (SDPA has no window), built once."""
    mask = None
    if shape.window:
        from fusedattn.spec import keep_mask

        mask = keep_mask(shape.seqlen, shape.seqlen, shape.window - 1, 0)
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                          is_causal=shape.causal and mask is None,
                                                          enable_gqa=shape.grouped)


def _flex(shape: Shape):
    if not torch.cuda.is_available():
        raise Unavailable("needs CUDA (torch.compile)")
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # One compile per shape: keep dynamo from giving up and falling back to the unfused path.
    for knob in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 4096)
    compiled = torch.compile(flex_attention, dynamic=False)
    block_mask = None
    if shape.causal:
        block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None,
                                       shape.seqlen, shape.seqlen, device="cuda")
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask, enable_gqa=shape.grouped)


# Shapes on which a peer's own kernel crashed the CUDA context (illegal memory access; the
# process cannot measure anything after that), reproduced with the peer alone in a fresh process
# (H200, flag_gems 5.0.2, 2026-11-21: fwd+bwd, B=1 H=16 S=16384 D=128, not causal; an earlier run
# of the same shape passed, so it is intermittent). The row says so instead of a time.
FLAGGEMS_CRASHES = {"D128-S16384-full"}


def flaggems_attention():
    """FlagGems' SDPA (``flag_gems.ops.attention.scaled_dot_product_attention``), or Unavailable."""
    if importlib.util.find_spec("flag_gems") is None:
        raise Unavailable("flag_gems not installed")
    if not torch.cuda.is_available():
        raise Unavailable("needs CUDA")
    from flag_gems.ops.attention import scaled_dot_product_attention

    return scaled_dot_product_attention


def _flaggems(shape: Shape):
    fn = flaggems_attention()
    if shape.name in FLAGGEMS_CRASHES:
        raise Unavailable("flag_gems makes an illegal memory access on this shape's forward+backward (crashes the process)")
    return lambda q, k, v: fn(q, k, v, is_causal=shape.causal, enable_gqa=shape.grouped)


# flash-sparse-attn 2.0.6 imports its fused-projection ops at package import, and those import
# ``triton_kernels.matmul_ogs`` / ``triton_kernels.numerics``, which no published triton-kernels
# provides (0.1.0 lacks them). The bench never calls those ops: where the import fails for that
# reason alone, placeholders stand in for the two modules (any use of them raises) so that the
# package's attention kernels -- Triton, no projection involved -- can be timed.
_TRITON_KERNELS_NAMES = {"triton_kernels.matmul_ogs": ("matmul_ogs", "PrecisionConfig", "FlexCtx"),
                         "triton_kernels.numerics": ("InFlexData", "OutFlexData")}


# flash-sparse-attn autotunes each kernel per problem on its first call and keeps the winner in a
# launch-config folder of its own (one JSON per GPU name), which it reads before autotuning again.
# Its autotune took minutes a kernel, even with its configurations compiled
# beforehand: longer than a bench run can give every row. So the bench points it at
# winners kept with the results (it autotunes, and adds to the folder, any problem not in there
# yet); FLASH_SPARSE_ATTENTION_LAUNCH_CONFIG_DIR set by the caller wins.
FSA_LAUNCH_CONFIGS = Path("benchmarks/fsa_launch_config")


def flash_dense_attn_func():
    """flash-sparse-attn's dense attention (``flash_dense_attn_func``: (B, S, H, D) tensors, fewer
    key/value heads taken as they are, ``window_sizes`` for a local band), or Unavailable."""
    return _flash_sparse_attn("flash_sparse_attn", "flash_dense_attn_func")


def flash_sparse_bias_attn_func():
    """flash-sparse-attn's Triton kernel with a trainable bias, or Unavailable:
    ``triton_sparse_attn_func(q, k, v, attn_bias, is_causal)``, (B, S, H, D) tensors, a (B, H, Sq|1,
    Sk) bias in their dtype, its gradient returned. 2.0.6 keeps it under ``deprecated`` (the
    flash-dmattn kernel); its dense kernels take no bias."""
    return _flash_sparse_attn("flash_sparse_attn.deprecated.flash_sparse_attn_triton", "triton_sparse_attn_func")


def _flash_sparse_attn(module_name: str, attr: str):
    """``attr`` of a flash-sparse-attn module, the package imported past its missing projection
    dependency (``_stand_in_triton_kernels``), or Unavailable."""
    if importlib.util.find_spec("flash_sparse_attn") is None:
        raise Unavailable("flash_sparse_attn not installed")
    if not torch.cuda.is_available():
        raise Unavailable("needs CUDA")
    if FSA_LAUNCH_CONFIGS.is_dir():  # read when its launch-config module is imported: set before the import
        os.environ.setdefault("FLASH_SPARSE_ATTENTION_LAUNCH_CONFIG_DIR", str(FSA_LAUNCH_CONFIGS.resolve()))
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if not (e.name or "").startswith("triton_kernels"):
            raise Unavailable(f"flash_sparse_attn does not import: {e}") from e
        _stand_in_triton_kernels()
        module = importlib.import_module(module_name)
    return getattr(module, attr)


def _stand_in_triton_kernels() -> None:
    import sys
    import types

    def unusable(*args, **kwargs):
        raise RuntimeError("fusedattn.bench: a placeholder for triton_kernels (flash-sparse-attn's projection ops)")

    if importlib.util.find_spec("triton_kernels") is None:
        sys.modules["triton_kernels"] = types.ModuleType("triton_kernels")
    for name, attrs in _TRITON_KERNELS_NAMES.items():
        module = types.ModuleType(name)
        for attr in attrs:
            setattr(module, attr, unusable)
        sys.modules[name] = module
    for key in [k for k in sys.modules if k.startswith("flash_sparse_attn")]:  # the failed import's half-made modules
        del sys.modules[key]


def fa4_attn_func():
    """FlashAttention-4's ``flash_attn_func`` (``flash_attn.cute``: the CuTe DSL kernels; (B, S, H,
    D) tensors, fewer key/value heads taken as they are; it returns (out, lse)), or Unavailable.
    Where a machine reaches no package index its wheels travel with the checkout: benchmarks/NOTES.md
    v62-v63 says how (and in which order they install)."""
    if importlib.util.find_spec("flash_attn") is None:
        raise Unavailable("flash-attn-4 not installed")
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as e:  # FlashAttention 2's package has no cute module; a broken install is a result
        raise Unavailable(f"flash_attn.cute does not import: {type(e).__name__}: {str(e)[:120]}") from e
    return flash_attn_func


def fa4_call(fn, q, k, v, **options):
    """FA4 on (B, H, S, D) views of (B, S, H, D) tensors (``System.layout`` "bshd": no copy); its
    output as a (B, H, S, D) view."""
    out = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **options)
    return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)


def _fa4(deterministic: bool):
    def make(shape: Shape):
        fn = fa4_attn_func()
        window = (shape.window - 1, 0) if shape.window else (None, None)
        return lambda q, k, v: fa4_call(fn, q, k, v, causal=shape.causal, window_size=window,
                                        deterministic=deterministic)

    return make


def _flash_sparse_dense(shape: Shape):
    fn = flash_dense_attn_func()
    # Its layout is (B, S, H, D): the bench hands it q, k, v (and dout) stored that way
    # (``System.layout``), as (B, H, S, D) views, so these transposes copy nothing.
    return lambda q, k, v: fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                              is_causal=shape.causal).transpose(1, 2)


SYSTEMS = [
    System("fusedattn", _fusedattn(False), "fusedattn.attention, layout='bhsd'"),
    System("fusedattn-deterministic", _fusedattn(True), "fusedattn.attention, deterministic=True"),
    System("sdpa-cudnn", _sdpa("CUDNN_ATTENTION"), "torch SDPA, cuDNN backend, is_causal"),
    System("sdpa-flash", _sdpa("FLASH_ATTENTION"), "torch SDPA, FlashAttention-2 backend, is_causal"),
    System("sdpa-efficient", _sdpa("EFFICIENT_ATTENTION"), "torch SDPA, memory-efficient backend, is_causal"),
    System("flex", _flex, "FlexAttention under torch.compile, causal block mask"),
    System("flaggems", _flaggems, "flag_gems.ops.attention.scaled_dot_product_attention"),
    System("flash-sparse-attn", _flash_sparse_dense, "flash_sparse_attn.flash_dense_attn_func (Triton)", "bshd"),
    System("fa4", _fa4(False), "FlashAttention-4, flash_attn.cute.flash_attn_func (CuTe DSL)", "bshd"),
    System("fa4-deterministic", _fa4(True), "FlashAttention-4, deterministic=True", "bshd"),
]
CPU_SYSTEMS = [
    System("fusedattn", _fusedattn(False), "fusedattn.attention on CPU tensors (the PyTorch path, fusedattn/cpu.py)"),
    System("sdpa", _sdpa_cpu, "torch SDPA, its default CPU backend (its rows' `backend`: FLASH_ATTENTION is torch's "
                              "fused CPU kernel), is_causal, enable_gqa; the window row as a dense bool mask",
           backend=sdpa_cpu_backend),
]

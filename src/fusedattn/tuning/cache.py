"""On-disk cache of tuned launch configs: written by an opt-in tuning run, read by
``configs.select_configs`` before it falls back to the heuristic.

An entry is used only when everything that changes the compiled kernels or their best tiling
matches its key: the package version, a hash of the kernel sources, the GPU's name and compute
capability, the Triton version, dtype, both head dims, the feature flags (window sides,
softcap), and the one length property the launch configs depend on (keys <= 2048).
Lengths themselves are runtime arguments of the kernels (never specialised), so they are not
part of the key. A stale entry (any field differs) is simply never matched.

The file is ``$FUSEDATTN_TUNING_CACHE`` or ``~/.cache/fusedattn/tuning.json``; without it,
every launch uses the heuristic.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path

import torch
import triton

from ..kernels.shared.config import SHORT_KEYS, AttentionConfigs, KernelConfig

KERNEL_DIR = Path(__file__).resolve().parents[1] / "kernels"


def cache_path() -> Path:
    return Path(os.environ.get("FUSEDATTN_TUNING_CACHE", Path.home() / ".cache" / "fusedattn" / "tuning.json"))


@functools.lru_cache(maxsize=1)
def kernel_source_hash() -> str:
    digest = hashlib.sha256()
    for path in sorted(KERNEL_DIR.rglob("*.py")):
        digest.update(path.relative_to(KERNEL_DIR).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def config_key(gpu_name: str, capability: tuple[int, int], dtype: torch.dtype, head_dim: int, head_dim_v: int,
               seqlen_k: int, has_left: bool, has_right: bool, has_softcap: bool) -> str:
    from .._version import __version__

    fields = dict(
        fusedattn=__version__, kernels=kernel_source_hash(), gpu=gpu_name, capability=list(capability),
        triton=triton.__version__, dtype=str(dtype).replace("torch.", ""), head_dim=head_dim,
        head_dim_v=head_dim_v, short_keys=seqlen_k <= SHORT_KEYS, window_left=has_left,
        window_right=has_right, softcap=has_softcap,
    )
    return json.dumps(fields, sort_keys=True)


def configs_to_dict(configs: AttentionConfigs) -> dict:
    return asdict(configs)


def configs_from_dict(data: dict) -> AttentionConfigs:
    kernels = {name: KernelConfig(**data[name]) for name in ("forward", "dkdv", "dq")}
    if data.get("gluon_dq") is not None:
        kernels["gluon_dq"] = KernelConfig(**data["gluon_dq"])
    return AttentionConfigs(**{**data, **kernels})


class TuningCache:
    """A JSON file mapping config keys to tuned ``AttentionConfigs``."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self._entries: dict[str, dict] | None = None

    def _load(self) -> dict[str, dict]:
        if self._entries is None:
            try:
                self._entries = json.loads(self.path.read_text())
            except FileNotFoundError:
                self._entries = {}
        return self._entries

    def get(self, key: str) -> AttentionConfigs | None:
        entry = self._load().get(key)
        return None if entry is None else configs_from_dict(entry)

    def put(self, key: str, configs: AttentionConfigs) -> None:
        entries = dict(self._load())
        entries[key] = configs_to_dict(configs)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        staging = self.path.with_suffix(".tmp")
        staging.write_text(json.dumps(entries, indent=1, sort_keys=True))
        staging.replace(self.path)  # atomic: a reader never sees half a file
        self._entries = entries

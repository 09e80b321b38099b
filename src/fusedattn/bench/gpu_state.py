"""The GPU's clock and power state, read with ``nvidia-smi`` next to the bench's timings.

Why: under a sustained load an H100 runs at its board power limit (700 W), and its SM clock then
falls from its 1980 MHz boost clock, the further the more power the running kernels draw.
Two kernels with the same SM cycles can then take different times, and
a ratio measured in a short burst (boost clock) differs from one measured at the cap by a few %.
Each bench row records the state right after its fwd+bwd timing, so a reader sees which regime a
ratio was measured in. Nothing here changes a clock or a limit.
"""

from __future__ import annotations

import shutil
import subprocess

# nvidia-smi's "clocks_event_reasons.active" bits (earlier drivers: clocks_throttle_reasons)
REASONS = {0x1: "idle", 0x2: "app-clocks", 0x4: "power-cap", 0x8: "hw-slowdown", 0x20: "sw-thermal",
           0x40: "hw-thermal", 0x80: "hw-power-brake", 0x100: "display-clocks"}

FIELDS = ("clocks.sm", "clocks.max.sm", "power.draw", "power.limit", "temperature.gpu",
          "clocks_throttle_reasons.active")


def parse(line: str) -> dict:
    """One ``nvidia-smi --query-gpu=FIELDS --format=csv,noheader,nounits`` line as numbers and the
    names of the active clock-limiting reasons; fields it cannot read are left out."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != len(FIELDS):
        return {}
    state = {}
    for key, text in zip(("sm_clock_mhz", "max_sm_clock_mhz", "power_w", "power_limit_w", "temperature_c"), parts):
        try:
            state[key] = float(text)
        except ValueError:
            pass
    try:
        bits = int(parts[-1], 16)
    except ValueError:
        return state
    state["clock_limited_by"] = [name for bit, name in REASONS.items() if bits & bit]
    return state


def _smi_ids(device_index: int) -> list[str]:
    """How nvidia-smi names torch's device ``device_index``: by its UUID first (nvidia-smi's own
    indices ignore CUDA_VISIBLE_DEVICES), then by the index."""
    ids = []
    try:
        import torch

        uuid = getattr(torch.cuda.get_device_properties(device_index), "uuid", None)
        if uuid:
            ids.append(f"GPU-{uuid}")
    except Exception:  # noqa: BLE001  no CUDA, or properties without a UUID: the index alone
        pass
    return ids + [str(device_index)]


def query(device_index: int | None = None) -> dict:
    """The state of torch's GPU ``device_index`` (default: the current one) now, or {} where
    nvidia-smi is missing or fails."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {}
    if device_index is None:
        import torch

        device_index = torch.cuda.current_device()
    for smi_id in _smi_ids(device_index):
        try:
            done = subprocess.run([smi, f"--id={smi_id}", f"--query-gpu={','.join(FIELDS)}",
                                   "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return {}
        lines = done.stdout.strip().splitlines()
        if done.returncode == 0 and lines:
            return parse(lines[0])
    return {}


def summary(states: list[dict]) -> str:
    """A table cell: the middle SM clock of ``states`` (MHz), '*' when the power cap limited any of
    them; empty without a reading (a CPU run)."""
    clocks = sorted(s["sm_clock_mhz"] for s in states if "sm_clock_mhz" in s)
    if not clocks:
        return ""
    capped = any("power-cap" in s.get("clock_limited_by", ()) for s in states)
    return f"{clocks[len(clocks) // 2]:.0f}{'*' if capped else ''}"


def cell(row: dict) -> str:
    """``summary`` of a bench row's states: each round's (``gpu_state_rounds``) or its one."""
    return summary(row.get("gpu_state_rounds") or [row.get("gpu_state", {})])

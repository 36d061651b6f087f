"""Where profiles are cached, and the device names that key them.

The cache directory is ``$AUTOPAR_CACHE_DIR`` when set, else ``~/.cache/autopar``. Files are JSON,
named by what they measured and on which device and torch version, so a profile taken on another
machine or torch is never read back by mistake.
"""
from __future__ import annotations

import json
import os
import platform
import re
import tempfile
from pathlib import Path

import torch

CACHE_ENV = "AUTOPAR_CACHE_DIR"


def cache_dir(override: str | os.PathLike | None = None) -> Path:
    """``override``, else ``$AUTOPAR_CACHE_DIR``, else ``~/.cache/autopar`` (not created here)."""
    if override is not None:
        return Path(override)
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "autopar"


def device_name(device: str | torch.device = "cpu") -> str:
    """A name for the hardware that timings depend on. CUDA: the GPU's marketing name. CPU: the
    processor (or machine architecture), the core count and torch's intra-op thread count (a rank
    spawned with one thread runs ops slower than a process using every core)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    proc = platform.processor() or platform.machine() or "cpu"
    return f"{proc}-{os.cpu_count()}cores-{torch.get_num_threads()}threads"


def synchronizer(device):
    """A function that waits for ``device``'s queued work (CUDA runs kernels asynchronously); a
    no-op on CPU. Timers call it before reading the clock."""
    device = torch.device(device)
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def slug(text: str) -> str:
    """A file-name-safe form of ``text``."""
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", text).strip("_")


def write_json(path: Path, data: dict) -> None:
    """Write atomically (a temp file renamed over the target), so readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_json(path: Path) -> dict | None:
    """The file's JSON object, or None when it is missing or unreadable (a stale cache is ignored)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None

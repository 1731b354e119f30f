"""Ray, an optional extra: importing it with a clear message, starting it once, and cutting work into shards.

Used by the Ray rollout engine and the Ray reward scorer; ``pip install "tether[ray]"``.
"""

from __future__ import annotations

from typing import Any


def import_ray() -> Any:
    try:
        import ray
    except ImportError as err:
        raise ImportError("Ray workers need the optional extra: pip install 'tether[ray]'") from err
    return ray


def ensure_ray(address: str | None = None, num_cpus: int | None = None) -> Any:
    """``ray`` itself, initialised once (a local instance, or the cluster at ``address``)."""
    ray = import_ray()
    if not ray.is_initialized():
        ray.init(address=address, num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                 ignore_reinit_error=True)
    return ray


def shards(n: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` ranges cutting ``n`` items into at most ``parts`` near-equal pieces."""
    parts = max(1, min(parts, n))
    size, extra = divmod(n, parts)
    out, start = [], 0
    for k in range(parts):
        end = start + size + (k < extra)
        out.append((start, end))
        start = end
    return out

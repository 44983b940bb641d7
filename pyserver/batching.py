"""The C++ batching core, re-exported with a config helper in seconds."""

from __future__ import annotations

from collections.abc import Sequence

from pyserver._core import (
    MAX_LIFO_BACKLOG_NS,
    BatchQueue,
    Clock,
    ManualClock,
    PopResult,
    PushStatus,
    QueueConfig,
    QueueStats,
    ReleaseReason,
    SteadyClock,
)

__all__ = [
    "MAX_LIFO_BACKLOG_S",
    "BatchQueue",
    "Clock",
    "ManualClock",
    "PopResult",
    "PushStatus",
    "QueueConfig",
    "QueueStats",
    "ReleaseReason",
    "SteadyClock",
    "make_config",
]

_NS = 1_000_000_000
MAX_LIFO_BACKLOG_S = MAX_LIFO_BACKLOG_NS / _NS  # the longest lifo_backlog_s BatchQueue takes


def make_config(
    *,
    priority_levels: int = 2,
    capacity: int = 4096,
    level_capacity: Sequence[int] = (),
    bucket_bounds: Sequence[int] = (),
    max_batch_requests: int = 64,
    max_batch_tokens: int = 1 << 20,
    batch_window_s: float = 0.0,
    max_wait_s: float = 0.05,
    aging_interval_s: float = 0.0,
    lifo_after_s: float = 0.0,
    affinity_max_overtakes: int = 0,
    oldest_first_after_s: float = 0.0,
    oldest_first_turns: float = 0.0,
    lifo_backlog_s: float = 0.0,
    release_on_urgent: bool = True,
) -> QueueConfig:
    """A QueueConfig with durations in seconds; the constructor of BatchQueue validates it."""
    config = QueueConfig()
    config.priority_levels = priority_levels
    config.capacity = capacity
    config.level_capacity = list(level_capacity)
    config.bucket_bounds = list(bucket_bounds)
    config.max_batch_requests = max_batch_requests
    config.max_batch_tokens = max_batch_tokens
    config.batch_window_ns = round(batch_window_s * _NS)
    config.max_wait_ns = round(max_wait_s * _NS)
    config.aging_interval_ns = round(aging_interval_s * _NS)
    config.lifo_after_ns = round(lifo_after_s * _NS)
    config.affinity_max_overtakes = affinity_max_overtakes
    config.oldest_first_after_ns = round(oldest_first_after_s * _NS)
    config.oldest_first_turns = oldest_first_turns
    config.lifo_backlog_ns = round(lifo_backlog_s * _NS)
    config.release_on_urgent = release_on_urgent
    return config

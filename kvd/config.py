"""The daemon's settings: one frozen, validated object the CLI builds."""

from __future__ import annotations

from dataclasses import dataclass

from kvd.common.layout import CacheLayout


@dataclass(frozen=True)
class DaemonConfig:
    """Settings of one daemon; the CLI builds it from flags and environment.

    Attributes:
        block_size: tokens per block.
        num_blocks: blocks in the cache; when 0, as many as
            ``memory_budget_bytes`` holds.
        memory_budget_bytes: the cache's size when ``num_blocks`` is 0.
        device: ``cpu`` (shared-memory file) or ``cuda[:N]`` (CUDA IPC).
        shm_dir: where the shared-memory file lives.
        max_pinned_fraction: the share of blocks pins may hold.
        lease_s: a session not heard from for this long is released.
        enable_caching: index committed blocks (off: every lookup misses).
        model_layout: create the cache at start with this layout (its
            ``block_size`` is ignored); otherwise at the first attach.
        host_num_blocks: blocks of the host-memory tier; when 0, as many as
            ``host_memory_budget_bytes`` holds (0: no host tier).
        quarantine_s: how long a lapsed session's blocks stay out of reuse
            when its engine's process cannot be seen (kvd.quarantine).
        disk_path: the disk tier's folder ("": no disk tier); needs the host tier.
        disk_budget_bytes: what the disk tier's files may take together.
        disk_remove_others: delete other fingerprints' blocks at start
            (otherwise they are evicted first as room is needed).
    """

    block_size: int = 16
    num_blocks: int = 0
    memory_budget_bytes: int = 1 << 30
    device: str = "cpu"
    shm_dir: str = "/dev/shm"
    max_pinned_fraction: float = 0.5
    lease_s: float = 5.0
    enable_caching: bool = True
    model_layout: CacheLayout | None = None
    host_num_blocks: int = 0
    host_memory_budget_bytes: int = 0
    quarantine_s: float = 30.0
    disk_path: str = ""
    disk_budget_bytes: int = 0
    disk_remove_others: bool = False

    def __post_init__(self) -> None:
        if self.host_num_blocks < 0 or self.host_memory_budget_bytes < 0:
            raise ValueError("the host tier's size must be >= 0")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {self.num_blocks}")
        if self.num_blocks == 0 and self.memory_budget_bytes < 1:
            raise ValueError(f"memory budget must be > 0, got {self.memory_budget_bytes}")
        if not 0.0 <= self.max_pinned_fraction <= 1.0:
            raise ValueError(f"max_pinned_fraction must be in [0, 1], got {self.max_pinned_fraction}")
        if self.lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {self.lease_s}")
        if self.disk_path and not (self.host_num_blocks or self.host_memory_budget_bytes):
            raise ValueError("the disk tier (--disk-path) reads into and writes from the host tier: give it one")
        if self.disk_path and self.disk_budget_bytes < 1:
            raise ValueError(f"the disk tier's budget must be > 0, got {self.disk_budget_bytes}")
        if self.quarantine_s < 0:
            raise ValueError(f"quarantine_s must be >= 0, got {self.quarantine_s}")

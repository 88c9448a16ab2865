"""The daemon's settings: one frozen, validated object, each field declaring its setting.

``kvd`` (``kvd/cli.py``) lists these settings in its command and builds the
object from the flags and ``KVD_*`` variables; a config built in code (tests,
benchmarks) takes the same defaults (see ``kvd.common.config_fields``).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING

import click

from kvd.common.config_fields import from_settings, setting
from kvd.common.settings import SIZE, Setting

if TYPE_CHECKING:
    from kvd.common.layout import CacheLayout

_CACHE = "cache"
_HOST_TIER = "host tier (offload to host memory; off by default)"
_DISK_TIER = "disk tier (blocks kept on disk across restarts; off by default, needs the host tier)"
_LAYOUT = "layout (optional: otherwise the first engine's model decides)"


def resolve_device(device: str) -> str:
    """``auto``: cuda if present, else cpu; any other device as given."""
    if device != "auto":
        return device
    import torch  # NOTE: here, not at the top: `kvd --help` needs no torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def layout_from(values: SimpleNamespace) -> CacheLayout | None:
    """The cache's layout when the layout settings give one (None: the first engine's model decides)."""
    if not (values.num_layers or values.num_kv_heads or values.head_dim):
        return None
    from kvd.common.layout import CacheLayout  # NOTE: loads torch, which `kvd --help` needs not

    return CacheLayout(values.num_layers, values.num_kv_heads, values.head_dim, values.block_size, values.cache_dtype)


@dataclass(frozen=True)
class DaemonConfig:
    """Settings of one daemon.

    Attributes:
        block_size: tokens per block.
        num_blocks: blocks in the cache; when 0, as many as
            ``memory_budget_bytes`` holds.
        memory_budget_bytes: the cache's size when ``num_blocks`` is 0.
        device: ``cpu`` (shared-memory file) or ``cuda[:N]`` (CUDA IPC).
        shm_dir: where the shared-memory file lives.
        max_pinned_fraction: the share of blocks pins may hold.
        lease_s: a session not heard from for this long is released.
        quarantine_s: how long a lapsed session's blocks stay out of reuse
            when its engine's process cannot be seen (kvd.quarantine).
        enable_caching: index committed blocks (off: every lookup misses).
        host_num_blocks: blocks of the host-memory tier; when 0, as many as
            ``host_memory_budget_bytes`` holds (0: no host tier).
        disk_path: the disk tier's folder ("": no disk tier); needs the host tier.
        disk_budget_bytes: what the disk tier's files may take together.
        disk_remove_others: delete other fingerprints' blocks at start
            (otherwise they are evicted first as room is needed).
        model_layout: create the cache at start with this layout (its
            ``block_size`` is ignored); otherwise at the first attach.
    """

    block_size: int = setting(
        "--block-size", env="KVD_BLOCK_SIZE", type=click.INT, default=16, section=_CACHE, help="tokens per block"
    )
    num_blocks: int = setting(
        "--num-blocks",
        env="KVD_NUM_BLOCKS",
        type=click.INT,
        default=0,
        section=_CACHE,
        help="blocks in the cache; 0: fill the memory budget",
    )
    memory_budget_bytes: int = setting(
        "--memory-budget",
        env="KVD_MEMORY_BUDGET",
        type=SIZE,
        default="1GiB",
        section=_CACHE,
        help="cache size when --num-blocks is 0 (on CPU a file in --shm-dir, which must have room for it)",
    )
    device: str = setting(
        "--device",
        env="KVD_DEVICE",
        default="auto",
        convert=resolve_device,
        field_default="cpu",
        section=_CACHE,
        help="auto, cpu (a shared-memory file) or cuda[:N] (one allocation exported by CUDA IPC handle); "
        "auto picks cuda if present",
    )
    shm_dir: str = setting(
        "--shm-dir", env="KVD_SHM_DIR", default="/dev/shm", section=_CACHE, help="shared-memory folder"
    )
    max_pinned_fraction: float = setting(
        "--max-pinned-fraction",
        env="KVD_MAX_PINNED_FRACTION",
        type=click.FLOAT,
        default=0.5,
        section=_CACHE,
        help="share of blocks pins may hold (past it, RESOURCE_EXHAUSTED)",
    )
    lease_s: float = setting(
        "--lease-s",
        env="KVD_LEASE_S",
        type=click.FLOAT,
        default=5.0,
        section=_CACHE,
        help="release a session not heard from for this long",
    )
    quarantine_s: float = setting(
        "--quarantine-s",
        env="KVD_QUARANTINE_S",
        type=click.FLOAT,
        default=30.0,
        section=_CACHE,
        help="keep a lapsed session's blocks out of reuse this long when its engine's process "
        "cannot be seen from here (another container or host)",
    )
    enable_caching: bool = setting(
        "--no-prefix-caching",
        env="KVD_NO_PREFIX_CACHING",
        is_flag=True,
        default=False,
        convert=operator.not_,
        section=_CACHE,
        help="never serve cache hits",
    )
    host_num_blocks: int = setting(
        "--host-num-blocks",
        env="KVD_HOST_NUM_BLOCKS",
        type=click.INT,
        default=0,
        section=_HOST_TIER,
        help="blocks in the host tier; 0: as many as --host-memory-budget holds",
    )
    host_memory_budget_bytes: int = setting(
        "--host-memory-budget",
        env="KVD_HOST_MEMORY_BUDGET",
        type=SIZE,
        default="0",
        section=_HOST_TIER,
        help="host tier size when --host-num-blocks is 0, e.g. 8GiB; 0: no host tier",
    )
    disk_path: str = setting(
        "--disk-path",
        env="KVD_DISK_PATH",
        section=_DISK_TIER,
        help="the disk tier's folder: blocks entering the host tier are written here and served again after "
        "a restart, under a folder per model and layout; empty: no disk tier",
    )
    disk_budget_bytes: int = setting(
        "--disk-budget",
        env="KVD_DISK_BUDGET",
        type=SIZE,
        default="8GiB",
        section=_DISK_TIER,
        help="what the disk tier's files may take together (least recently used evicted first, other "
        "models' and layouts' before any)",
    )
    disk_remove_others: bool = setting(
        "--disk-remove-others",
        env="KVD_DISK_REMOVE_OTHERS",
        is_flag=True,
        default=False,
        section=_DISK_TIER,
        help="at start, delete the blocks of other models, layouts and formats under --disk-path",
    )
    model_layout: CacheLayout | None = from_settings(
        layout_from,
        Setting(
            "--num-layers",
            env="KVD_NUM_LAYERS",
            type=click.INT,
            default=0,
            section=_LAYOUT,
            help="create the cache at start with this many layers (and the three below); 0: at the first attach",
        ),
        Setting("--num-kv-heads", env="KVD_NUM_KV_HEADS", type=click.INT, default=0, section=_LAYOUT, help="KV heads"),
        Setting("--head-dim", env="KVD_HEAD_DIM", type=click.INT, default=0, section=_LAYOUT, help="head dimension"),
        Setting(
            "--cache-dtype",
            env="KVD_CACHE_DTYPE",
            default="float32",
            section=_LAYOUT,
            help="the cache's dtype with --num-layers; otherwise the first engine's model dtype",
        ),
    )

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

"""The KV-cache memory: allocated by the daemon, mapped by engines.

Without a GPU the cache is a file in ``/dev/shm`` that both processes map
(``torch.from_file(..., shared=True)``). On CUDA it is one device tensor,
exported through torch's CUDA IPC fields and mapped by the GPU's UUID. Either
way both sides see the same bytes; no KV data crosses gRPC.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from dataclasses import dataclass

import torch

from kvd.common.layout import CacheLayout


@dataclass(frozen=True, slots=True)
class SharedMemoryExport:
    path: str
    size_bytes: int


@dataclass(frozen=True, slots=True)
class CudaIpcExport:
    device_uuid: str
    storage_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


Export = SharedMemoryExport | CudaIpcExport


class KVMemory:
    """The cache tensor the daemon owns, and how others can map it."""

    def __init__(self, layout: CacheLayout, num_blocks: int, device: str, shm_dir: str = "/dev/shm") -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.shape = layout.tensor_shape(num_blocks)
        self._path: str | None = None
        if device.startswith("cuda"):
            self.tensor = torch.zeros(self.shape, dtype=layout.torch_dtype, device=device)
            self.export: Export = _export_cuda(self.tensor)
        elif device == "cpu":
            self.tensor, self._path = _allocate_shared(layout, num_blocks, shm_dir)
            self.export = SharedMemoryExport(self._path, num_blocks * layout.block_bytes)
        else:
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
        self.stride = tuple(self.tensor.stride())

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.layout.block_bytes

    def close(self) -> None:
        """Drops the daemon's mapping and removes the shared file."""
        self.tensor = torch.empty(0)
        if self._path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path)
            self._path = None


def _allocate_shared(layout: CacheLayout, num_blocks: int, shm_dir: str) -> tuple[torch.Tensor, str]:
    nbytes = num_blocks * layout.block_bytes
    stat = os.statvfs(shm_dir)
    available = stat.f_bavail * stat.f_frsize
    if nbytes > available:
        raise ValueError(f"the KV cache needs {nbytes} bytes but {shm_dir} has only {available} bytes free")
    path = os.path.join(shm_dir, f"kvd-{os.getpid()}-{secrets.token_hex(4)}.kv")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)
    numel = nbytes // layout.torch_dtype.itemsize
    tensor = torch.from_file(path, shared=True, size=numel, dtype=layout.torch_dtype)
    # NOTE: writing every page once now allocates the tmpfs pages at start, so
    # a cache that does not fit fails here rather than with SIGBUS mid-request.
    tensor.zero_()
    return tensor.view(layout.tensor_shape(num_blocks)), path


def _export_cuda(tensor: torch.Tensor) -> CudaIpcExport:
    storage = tensor.untyped_storage()
    (device, handle, size_bytes, offset_bytes, ref_handle, ref_offset, event_handle, event_sync) = (
        storage._share_cuda_()
    )
    return CudaIpcExport(
        device_uuid=str(torch.cuda.get_device_properties(device).uuid),
        storage_handle=handle,
        storage_size_bytes=size_bytes,
        storage_offset_bytes=offset_bytes,
        ref_counter_handle=ref_handle,
        ref_counter_offset=ref_offset,
        event_handle=event_handle or b"",
        event_sync_required=event_sync,
    )


def map_kv_cache(export: Export, layout: CacheLayout, shape: tuple[int, ...], stride: tuple[int, ...]) -> torch.Tensor:
    """Maps the daemon's cache in this process (an engine, a test, a tool).

    Raises:
        ValueError: the export does not match the layout, or names a GPU or
            file this process cannot see.
    """
    if tuple(shape[1:]) != layout.block_shape:
        raise ValueError(f"cache shape {tuple(shape)} does not match layout {layout.describe()}")
    if isinstance(export, SharedMemoryExport):
        return _map_shared(export, layout, shape, stride)
    return _map_cuda(export, layout, shape, stride)


def _map_shared(export: SharedMemoryExport, layout: CacheLayout, shape, stride) -> torch.Tensor:
    try:
        actual = os.stat(export.path).st_size
    except FileNotFoundError:
        raise ValueError(f"shared KV file {export.path} does not exist (is /dev/shm shared?)") from None
    if actual != export.size_bytes:
        raise ValueError(f"shared KV file {export.path} has {actual} bytes, expected {export.size_bytes}")
    numel = export.size_bytes // layout.torch_dtype.itemsize
    flat = torch.from_file(export.path, shared=True, size=numel, dtype=layout.torch_dtype)
    _prefault(flat)
    return flat.as_strided(shape, stride)


def _prefault(flat: torch.Tensor) -> None:
    """Maps every page of the shared cache into this process now.

    NOTE: reading one byte per page costs a minor fault per page (the daemon
    allocated them all), ~0.13 s per GiB; left lazy, the mapper's RSS would
    climb for the first minutes of serving as requests reach blocks they had
    not used, which reads as a leak in every memory graph.
    """
    page = os.sysconf("SC_PAGE_SIZE")
    flat.view(torch.uint8)[::page].sum()


def cuda_device_index(device_uuid: str) -> int:
    """The local index of the GPU with this UUID (indices differ per process)."""
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == device_uuid:
            return index
    raise ValueError(f"no visible GPU has UUID {device_uuid} (check CUDA_VISIBLE_DEVICES)")


def _map_cuda(export: CudaIpcExport, layout: CacheLayout, shape, stride) -> torch.Tensor:
    index = cuda_device_index(export.device_uuid)
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        index,
        export.storage_handle,
        export.storage_size_bytes,
        export.storage_offset_bytes,
        export.ref_counter_handle,
        export.ref_counter_offset,
        export.event_handle or None,
        export.event_sync_required,
    )
    typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=layout.torch_dtype, _internal=True)
    return torch._utils._rebuild_tensor(typed, 0, tuple(shape), tuple(stride))

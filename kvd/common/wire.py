"""Conversions between the daemon's Python types and its protobuf messages.

Used on both sides of the wire: the daemon's service and its clients. The
Step itself has no Python mirror: both sides use its protobuf messages.
"""

from __future__ import annotations

from kvd.common import dtypes
from kvd.common.identity import ModelIdentity
from kvd.common.layout import CacheLayout
from kvd.common.memory import CudaIpcExport, Export, KVMemory, SharedMemoryExport
from kvd.common.process_identity import ProcessIdentity
from kvd_api.daemon.v1 import daemon_pb2 as pb

#: The Step contract both sides speak (daemon.proto, "step"). An engine and a
#: daemon of different versions refuse each other at Attach.
PROTOCOL_VERSION = 2


def layout_to_pb(layout: CacheLayout, num_blocks: int = 0) -> pb.CacheLayout:
    return pb.CacheLayout(
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        block_size=layout.block_size,
        dtype=dtypes.by_name(layout.dtype).wire,
        num_blocks=num_blocks,
    )


def layout_from_pb(msg: pb.CacheLayout, default_block_size: int) -> CacheLayout:
    """Raises ``ValueError`` on a missing dtype or a non-positive size."""
    dtype = dtypes.by_wire(msg.dtype, "layout.dtype").name
    return CacheLayout(
        num_layers=msg.num_layers,
        num_kv_heads=msg.num_kv_heads,
        head_dim=msg.head_dim,
        block_size=msg.block_size or default_block_size,
        dtype=dtype,
    )


def memory_to_pb(memory: KVMemory) -> pb.MemoryHandle:
    handle = pb.MemoryHandle(shape=list(memory.shape), stride=list(memory.stride))
    export = memory.export
    if isinstance(export, SharedMemoryExport):
        handle.shared_memory.path = export.path
        handle.shared_memory.size_bytes = export.size_bytes
    else:
        handle.cuda_ipc.CopyFrom(
            pb.CudaIpcHandle(
                device_uuid=export.device_uuid,
                storage_handle=export.storage_handle,
                storage_size_bytes=export.storage_size_bytes,
                storage_offset_bytes=export.storage_offset_bytes,
                ref_counter_handle=export.ref_counter_handle,
                ref_counter_offset=export.ref_counter_offset,
                event_handle=export.event_handle,
                event_sync_required=export.event_sync_required,
            )
        )
    return handle


def export_from_pb(handle: pb.MemoryHandle) -> Export:
    kind = handle.WhichOneof("kind")
    if kind == "shared_memory":
        return SharedMemoryExport(handle.shared_memory.path, handle.shared_memory.size_bytes)
    if kind == "cuda_ipc":
        c = handle.cuda_ipc
        return CudaIpcExport(
            c.device_uuid,
            c.storage_handle,
            c.storage_size_bytes,
            c.storage_offset_bytes,
            c.ref_counter_handle,
            c.ref_counter_offset,
            c.event_handle,
            c.event_sync_required,
        )
    raise ValueError("memory handle has no kind")


def process_to_pb(process: ProcessIdentity) -> pb.ProcessIdentity:
    return pb.ProcessIdentity(
        boot_id=process.boot_id, pid_namespace=process.pid_namespace, pid=process.pid, start_ticks=process.start_ticks
    )


def process_from_pb(msg: pb.ProcessIdentity) -> ProcessIdentity:
    return ProcessIdentity(msg.boot_id, msg.pid_namespace, msg.pid, msg.start_ticks)


def model_to_pb(model: ModelIdentity) -> pb.ModelIdentity:
    return pb.ModelIdentity(
        name=model.name,
        model_type=model.model_type,
        config_digest=model.config_digest,
        weights_digest=model.weights_digest,
        tokenizer_digest=model.tokenizer_digest,
    )


def model_from_pb(msg: pb.ModelIdentity) -> ModelIdentity:
    """Raises ValueError when a digest is missing (a model is named by all three)."""
    for name in ("config_digest", "weights_digest", "tokenizer_digest"):
        if not getattr(msg, name):
            raise ValueError(f"model.{name} is empty")
    return ModelIdentity(msg.name, msg.model_type, msg.config_digest, msg.weights_digest, msg.tokenizer_digest)

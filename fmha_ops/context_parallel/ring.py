"""The ring: each rank sends a byte buffer to the next rank and receives the previous rank's, with
``torch.distributed`` point-to-point ops (``batch_isend_irecv``), started before and finished after the
attention of the buffer in hand.

On CUDA the transfer is issued on a side stream that waits for the buffer to be ready; finishing makes
the compute stream wait for it (``Work.wait`` on NCCL is a stream dependency, not a host wait). On the
CPU (gloo) the ops are plain asynchronous sends and receives, and finishing waits for them.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist

_ALIGN = 128  # byte offset of every tensor in a packet (TMA and vector loads need 16)


def resolve_group(group, mesh_dim: int | str | None = None) -> dist.ProcessGroup:
    """The process group of ``group``: a ``ProcessGroup``, a ``DeviceMesh`` (its dim ``mesh_dim``; a 1-D mesh
    needs none) or None (the default group)."""
    from torch.distributed.device_mesh import DeviceMesh

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("context-parallel attention needs torch.distributed initialized "
                         "(torch.distributed.init_process_group)")
    if isinstance(group, DeviceMesh):
        if mesh_dim is None and group.ndim != 1:
            raise ValueError(f"group is a {group.ndim}-D DeviceMesh {group.mesh_dim_names or ''}; pass mesh_dim= "
                             f"to name the context-parallel dim")
        return group.get_group(0 if mesh_dim is None else mesh_dim)
    if mesh_dim is not None:
        raise ValueError(f"mesh_dim={mesh_dim!r} given but group is not a DeviceMesh")
    if group is None:
        return dist.group.WORLD
    if isinstance(group, dist.ProcessGroup):
        return group
    raise TypeError(f"group must be a torch.distributed ProcessGroup, a DeviceMesh or None, got {type(group).__name__}")


class Packet:
    """A fixed list of (shape, dtype) laid end to end in one uint8 buffer, each at a 128-byte offset, so one
    message carries them all and the receiver reads them as views."""

    def __init__(self, like: Sequence[torch.Tensor | None], dtype: torch.dtype | None = None) -> None:
        """``like``: tensors (None entries stay None) whose shapes and dtypes (or ``dtype``) the packet holds."""
        self.specs, self.offsets, end = [], [], 0
        for t in like:
            spec = None if t is None else (tuple(t.shape), dtype or t.dtype)
            self.specs.append(spec)
            self.offsets.append(end)
            if spec is not None:
                end += -(-math.prod(spec[0]) * spec[1].itemsize // _ALIGN) * _ALIGN
        self.nbytes = end

    def empty(self, device: torch.device) -> torch.Tensor:
        return torch.empty(self.nbytes, dtype=torch.uint8, device=device)

    def zeros(self, device: torch.device) -> torch.Tensor:
        return torch.zeros(self.nbytes, dtype=torch.uint8, device=device)

    def pack(self, tensors: Sequence[torch.Tensor | None], device: torch.device) -> torch.Tensor:
        buf = self.empty(device)
        for view, t in zip(self.unpack(buf), tensors):
            if view is not None:
                view.copy_(t)
        return buf

    def unpack(self, buf: torch.Tensor) -> list[torch.Tensor | None]:
        """Views of ``buf`` with the packet's shapes and dtypes."""
        out = []
        for spec, off in zip(self.specs, self.offsets):
            if spec is None:
                out.append(None)
                continue
            shape, dt = spec
            out.append(buf[off:off + math.prod(shape) * dt.itemsize].view(dt).view(shape))
        return out


class Transfer:
    """A send to the next rank and a receive from the previous one, in flight."""

    def __init__(self, ring: "Ring", works: list, received: torch.Tensor, sent: torch.Tensor) -> None:
        self._ring, self._works, self._received, self._sent = ring, works, received, sent

    def finish(self) -> torch.Tensor:
        """The received buffer, ready for the compute stream."""
        for w in self._works:
            w.wait()
        if self._ring.stream is not None:
            torch.cuda.current_stream().wait_stream(self._ring.stream)
        self._sent = None
        return self._received


class Ring:
    """Rank order of ``group`` as a ring: send to rank + 1, receive from rank - 1 (group ranks)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        if self.rank < 0:
            raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of the group passed as group=")
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world)
        self.stream = _side_stream(device) if device.type == "cuda" else None

    def start(self, buf: torch.Tensor, tag: int = 0) -> Transfer:
        """Send ``buf`` (uint8, 1-D) to the next rank and receive a buffer like it from the previous one.
        Transfers in flight together (the backward's K/V and dK/dV) are started in the same order on every
        rank and carry distinct ``tag``s."""
        received = torch.empty_like(buf)
        ops = [dist.P2POp(dist.isend, buf, self.next, self.group, tag),
               dist.P2POp(dist.irecv, received, self.prev, self.group, tag)]
        if self.stream is None:
            return Transfer(self, dist.batch_isend_irecv(ops), received, buf)
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            works = dist.batch_isend_irecv(ops)
        return Transfer(self, works, received, buf)


_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    key = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(device=key)
    return _STREAMS[key]

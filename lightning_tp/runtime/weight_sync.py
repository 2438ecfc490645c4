"""Weights handed to an inference engine in another process (another environment: vLLM pins its own torch and
Transformers), over a process group of their own: the trainer's sending ranks and the engine's ranks, joined by an
address, outside the training job's groups (as TRL and verl sync vLLM).

The trainer side: ``WeightSender`` takes :func:`lightning_tp.stream_weights` and sends it tensor by tensor, packed
into buckets of at most ``buffer_bytes`` (a larger tensor goes alone, without a copy), each preceded by a header of
names, dtypes and shapes in JSON (never pickle: the engine reads it as untrusted input). The engine side:
``WeightReceiver`` receives one update at a time and hands each bucket's tensors to a ``load_weights`` callable
(vLLM's ``model.load_weights(weights)`` takes the same iterable of ``(name, tensor)``); the docs show the vLLM side.

Every rank of the trainer calls ``send`` (the stream's gathers are collectives); only the sending ranks talk to the
engine. A rank of either side that dies ends the other's wait with an error after ``timeout`` (gloo) or at once
(the connection closes), never a hang of the training job's own groups.
"""

from __future__ import annotations

import json
import math
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_tp.compat import standalone_process_group

#: The dtypes a header may name: anything else is refused (the header is untrusted input).
DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
}
#: A bucket's default size: large enough that the per-message cost vanishes, small beside a GPU's memory.
BUFFER_BYTES = 256 * 2**20
#: Each tensor of a bucket starts at a multiple of this many bytes (so that a view of the bytes as its dtype is
#: aligned).
ALIGN = 16
#: The largest header accepted (a bucket's names, dtypes and shapes: a few hundred bytes a tensor).
MAX_HEADER_BYTES = 16 * 2**20
#: The header length that ends an update, and the one that ends the hand-off.
_END_OF_UPDATE, _CLOSED = 0, -1


def _group(address: str, *, rank: int, size: int, host: bool, backend: str, timeout: timedelta) -> dist.ProcessGroup:
    """A process group of ``size`` ranks of its own, joined through a TCP store at ``address`` (``host:port``)
    that the ``host`` rank serves.

    Raises:
        ValueError: ``address`` is not ``host:port``, or ``backend`` is neither ``"gloo"`` nor ``"nccl"``.
    """
    hostname, _, port = address.rpartition(":")
    if not hostname or not port.isdigit():
        raise ValueError(f"The weight hand-off's address must be 'host:port', got {address!r}.")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"The weight hand-off's backend must be 'gloo' or 'nccl', got {backend!r}.")
    store = dist.TCPStore(hostname, int(port), size, is_master=host, timeout=timeout)
    store = dist.PrefixStore("lightning_tp/weight_sync", store)
    return standalone_process_group(store, rank=rank, size=size, backend=backend, timeout=timeout)


class WeightSender:
    """The trainer's side of the hand-off: every rank of the job makes one (``sender=True`` on the ranks that send,
    one per pipeline stage: those :func:`lightning_tp.stream_weights` yields on with ``targets="first"``).

    Args:
        address: ``host:port`` the engine's first rank serves.
        sender: whether this rank sends (the others only take part in the stream's gathers).
        sender_rank: this sender's number among the ``senders`` (its pipeline stage).
        senders: how many ranks send (pipeline stages).
        engines: how many ranks the engine has; each receives every tensor whole.
        buffer_bytes: a bucket's size.
        backend: ``"gloo"`` (CPU tensors) or ``"nccl"`` (GPU tensors, the engine's GPUs).
        timeout: how long a send may wait for the engine.
        device: where buckets are packed (``"cpu"`` for gloo; the GPU for NCCL).

    Raises:
        ValueError: a bad address or backend, ``sender_rank`` not below ``senders``, or a count or size below 1.
    """

    def __init__(
        self,
        address: str,
        *,
        sender: bool,
        sender_rank: int = 0,
        senders: int = 1,
        engines: int = 1,
        buffer_bytes: int = BUFFER_BYTES,
        backend: str = "gloo",
        timeout: timedelta = timedelta(minutes=10),
        device: torch.device | str = "cpu",
    ):
        if min(senders, engines, buffer_bytes) < 1 or not 0 <= sender_rank < senders:
            raise ValueError(
                f"WeightSender needs senders, engines and buffer_bytes of at least 1 and 0 <= sender_rank < senders; "
                f"got senders={senders}, engines={engines}, buffer_bytes={buffer_bytes}, sender_rank={sender_rank}."
            )
        self.engines, self.buffer_bytes = engines, buffer_bytes
        self.device = torch.device(device)
        self.group = None
        if sender:
            # Ranks: the engine's first (it serves the store), then its others, then the senders.
            self.group = _group(
                address,
                rank=engines + sender_rank,
                size=engines + senders,
                host=False,
                backend=backend,
                timeout=timeout,
            )

    def send(self, stream: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Send one update: every ``(name, tensor)`` of ``stream``, then its end. Every rank of the job calls it
        with its stream (the non-sending ranks' stream yields nothing, but gathers). A failure here (the engine gone)
        closes the stream first, which tells the job's other ranks (see :func:`lightning_tp.stream_weights`).

        Args:
            stream: ``(name, tensor)`` pairs, :func:`lightning_tp.stream_weights`'s.

        Returns:
            what this rank sent: ``tensors``, ``bytes``, ``seconds``.

        Raises:
            RuntimeError: the engine did not receive within ``timeout``, or its connection closed.
        """
        start, count, total = time.perf_counter(), 0, 0
        bucket: list[tuple[str, torch.Tensor]] = []
        filled = 0
        try:
            for name, tensor in stream:
                if self.group is None:
                    continue
                size = tensor.numel() * tensor.element_size()
                if bucket and filled + size > self.buffer_bytes:
                    self._send_bucket(bucket)
                    bucket, filled = [], 0
                bucket.append((name, tensor))
                filled += size
                count, total = count + 1, total + size
                if filled >= self.buffer_bytes:  # a tensor as large as a bucket: sent alone, as it is
                    self._send_bucket(bucket)
                    bucket, filled = [], 0
            if self.group is not None:
                if bucket:
                    self._send_bucket(bucket)
                self._send_header(_END_OF_UPDATE)
        finally:
            close = getattr(stream, "close", None)
            if close is not None:  # a stream stopped early tells the other ranks now, not at garbage collection
                close()
        return {"tensors": count, "bytes": total, "seconds": time.perf_counter() - start}

    def close(self) -> None:
        """Tell the engine that no update follows."""
        if self.group is not None:
            self._send_header(_CLOSED)
            self.group = None

    def _p2p(self, tensor: torch.Tensor) -> None:
        assert self.group is not None
        for engine in range(self.engines):
            self.group.send([tensor], engine, 0).wait()

    def _send_header(self, length: int, header: bytes = b"") -> None:
        self._p2p(torch.tensor([length], dtype=torch.int64, device=self.device))
        if header:
            self._p2p(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(self.device))

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        entries, offset, end = [], 0, 0
        for name, tensor in bucket:
            offset = _aligned(end)
            dtype = str(tensor.dtype).removeprefix("torch.")
            entries.append({"name": name, "dtype": dtype, "shape": list(tensor.shape), "offset": offset})
            end = offset + tensor.numel() * tensor.element_size()
        header = json.dumps(entries).encode()
        self._send_header(len(header), header)
        if len(bucket) == 1:  # a tensor alone: sent as it is, no copy
            payload = _as_bytes(bucket[0][1].to(self.device))
        else:
            payload = torch.empty(end, dtype=torch.uint8, device=self.device)
            for entry, (_, tensor) in zip(entries, bucket, strict=True):
                flat = _as_bytes(tensor.to(self.device))
                payload[entry["offset"] : entry["offset"] + flat.numel()].copy_(flat)
        self._p2p(payload)


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


class WeightReceiver:
    """The engine's side of the hand-off: each rank of the engine makes one; rank 0 serves the address. The address
    is not authenticated: serve it on a network only the trainer reaches.

    Args:
        address: ``host:port`` to serve (rank 0) or join.
        rank: this engine rank's number.
        engines: how many ranks the engine has.
        senders: how many trainer ranks send (pipeline stages): each is received on a thread of its own, so that
            every stage streams at once (a stage waiting for another would stall the trainer's collectives).
        backend: as the sender's.
        timeout: how long to wait for the trainer (between updates too).
        device: where tensors are received.
        max_bucket_bytes: the largest bucket accepted (a header asking for more is refused before anything is
            allocated).

    Raises:
        ValueError: a bad address or backend, or a count below 1.
    """

    def __init__(
        self,
        address: str,
        *,
        rank: int = 0,
        engines: int = 1,
        senders: int = 1,
        backend: str = "gloo",
        timeout: timedelta = timedelta(minutes=10),
        device: torch.device | str = "cpu",
        max_bucket_bytes: int = 64 * 2**30,
    ):
        if min(engines, senders) < 1 or not 0 <= rank < engines:
            raise ValueError(
                f"WeightReceiver needs 0 <= rank < engines and senders >= 1, got {rank}, {engines}, {senders}."
            )
        self.engines, self.senders, self.device = engines, senders, torch.device(device)
        self.max_bucket_bytes = max_bucket_bytes
        self.group = _group(
            address, rank=rank, size=engines + senders, host=rank == 0, backend=backend, timeout=timeout
        )

    def receive(self, load_weights: Callable[[Iterator[tuple[str, torch.Tensor]]], Any]) -> int | None:
        """Receive one update from every sender, handing each bucket's tensors to ``load_weights`` on this thread
        (views into the received buffer: copy what is kept). Returns how many tensors came, or ``None`` once the
        trainer closed.

        Args:
            load_weights: takes an iterator of ``(name, tensor)``, as vLLM's ``model.load_weights``.

        Raises:
            ValueError: a header that is not what a sender writes (malformed, an unknown dtype, a bucket above
                ``max_bucket_bytes``).
            RuntimeError: the trainer did not send within ``timeout``, or its connection closed.
        """
        buckets: queue.Queue[Any] = queue.Queue(maxsize=2 * self.senders)  # bounded: a sender waits for the loads
        threads = [
            threading.Thread(target=self._receive_from, args=(self.engines + sender, buckets), daemon=True)
            for sender in range(self.senders)
        ]
        for thread in threads:
            thread.start()
        count, closed, ended, error = 0, 0, 0, None
        while ended < self.senders:
            item = buckets.get()
            if isinstance(item, BaseException):
                error, ended = error or item, ended + 1
            elif item in (_END_OF_UPDATE, _CLOSED):
                closed, ended = closed + (item == _CLOSED), ended + 1
            elif error is None:
                load_weights(iter(item))
                count += len(item)
        for thread in threads:
            thread.join()
        if error is not None:
            raise error
        return None if closed == self.senders else count

    def _receive_from(self, src: int, buckets: queue.Queue) -> None:
        """One sender's update, bucket by bucket, into ``buckets``; then its end marker (or the error)."""
        try:
            while True:
                length = int(self._recv(torch.empty(1, dtype=torch.int64), src).item())
                if length in (_END_OF_UPDATE, _CLOSED):
                    buckets.put(length)
                    return
                if not 0 < length <= MAX_HEADER_BYTES:
                    raise ValueError(f"A weight header of {length} bytes: not from a WeightSender.")
                header = self._recv(torch.empty(length, dtype=torch.uint8), src).cpu().numpy().tobytes()
                buckets.put(self._unpack(_parse_header(header), src))
        except BaseException as error:  # noqa: BLE001 (raised on the receiving thread by receive)
            buckets.put(error)

    def _recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        tensor = tensor.to(self.device)
        self.group.recv([tensor], src, 0).wait()
        return tensor

    def _unpack(self, entries: list[dict[str, Any]], src: int) -> list[tuple[str, torch.Tensor]]:
        shapes, end = [], 0
        for entry in entries:
            dtype, shape = DTYPES.get(entry.get("dtype")), entry.get("shape")
            if dtype is None or not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
                raise ValueError(f"A weight header entry that is not from a WeightSender: {str(entry)[:200]}")
            offset = _aligned(end)
            if entry.get("offset") != offset or not isinstance(entry.get("name"), str):
                raise ValueError(f"A weight header entry out of place: {str(entry)[:200]}")
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            shapes.append((entry["name"], dtype, shape, offset, nbytes))
            end = offset + nbytes
            if end > self.max_bucket_bytes:
                raise ValueError(f"A weight bucket of more than {self.max_bucket_bytes} bytes (max_bucket_bytes).")
        payload = self._recv(torch.empty(end, dtype=torch.uint8), src)
        return [
            (name, payload[offset : offset + nbytes].view(dtype).reshape(shape))
            for name, dtype, shape, offset, nbytes in shapes
        ]


def _parse_header(header: bytes) -> list[dict[str, Any]]:
    """A bucket's header: a JSON list of objects (name, dtype, shape, offset), nothing else.

    Raises:
        ValueError: anything else.
    """
    try:
        entries = json.loads(header.decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise ValueError(f"A weight header that is not JSON: {error}") from None
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise ValueError("A weight header that is not a list of entries: not from a WeightSender.")
    return entries

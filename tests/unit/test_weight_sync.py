"""The weight hand-off's protocol (lightning_tp/runtime/weight_sync.py): two senders (two pipeline stages) that wait
for each other between buckets, as a job's collectives make them, against one receiver; what it refuses to read."""

from __future__ import annotations

import multiprocessing
import socket
from datetime import timedelta

import pytest
import torch

from lightning_tp.runtime.weight_sync import WeightReceiver, WeightSender, _parse_header


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tensors(stage: int) -> list[tuple[str, torch.Tensor]]:
    """Mixed dtypes and sizes: each bucket's offsets aligned, a tensor larger than the buffer sent alone."""
    generator = torch.Generator().manual_seed(stage)
    return [
        (f"stage{stage}.a", torch.randn(3, 5, generator=generator)),
        (f"stage{stage}.b", torch.randn(7, generator=generator).to(torch.bfloat16)),
        (f"stage{stage}.big", torch.randn(64, 64, generator=generator)),
        (f"stage{stage}.ids", torch.arange(5)),
    ]


def _send(address: str, stage: int, barrier) -> None:
    sender = WeightSender(
        address, sender=True, sender_rank=stage, senders=2, timeout=timedelta(seconds=30), buffer_bytes=256
    )

    def stream():
        for index, item in enumerate(_tensors(stage)):
            if index == 2:
                barrier.wait(timeout=30)  # both stages mid-update at once: a receiver that served one first would hang
            yield item

    for _ in range(2):  # two updates, then the end
        sender.send(stream())
    sender.close()


def test_two_senders_waiting_for_each_other_and_one_receiver() -> None:
    """Both stages' tensors arrive, equal, in each of two updates, then the hand-off ends; the stages wait for each
    other mid-update (a receiver serving one sender after the other would leave them both waiting)."""
    address = f"127.0.0.1:{_free_port()}"
    context = multiprocessing.get_context("fork")  # the imports made once, as tests/helpers/forkrun.py
    barrier = context.Barrier(2)
    senders = [context.Process(target=_send, args=(address, stage, barrier)) for stage in range(2)]
    for process in senders:
        process.start()
    try:
        receiver = WeightReceiver(address, senders=2, timeout=timedelta(seconds=30))
        updates = []
        while True:
            received: dict[str, torch.Tensor] = {}
            count = receiver.receive(lambda weights, into=received: into.update((k, v.clone()) for k, v in weights))
            if count is None:
                break
            assert count == len(received) == 8
            updates.append(received)
    finally:
        for process in senders:
            process.join(timeout=30)
            process.kill()
    assert len(updates) == 2
    expected = dict(_tensors(0) + _tensors(1))
    for received in updates:
        assert received.keys() == expected.keys()
        for name, tensor in expected.items():
            assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name
    assert all(process.exitcode == 0 for process in senders)


@pytest.mark.parametrize(
    "header", [b"{", b"[]", b"[1]", b'{"name": "x"}', b"\xff\xfe", b"[" * 100_000 + b"]" * 100_000]
)
def test_a_header_not_from_a_sender_is_refused(header: bytes) -> None:
    with pytest.raises(ValueError, match="weight header"):
        _parse_header(header)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"name": "w", "dtype": "object", "shape": [2], "offset": 0}, "not from a WeightSender"),
        ({"name": "w", "dtype": "float32", "shape": [-1], "offset": 0}, "not from a WeightSender"),
        ({"name": "w", "dtype": "float32", "shape": [2], "offset": 8}, "out of place"),
        ({"name": 3, "dtype": "float32", "shape": [2], "offset": 0}, "out of place"),
        ({"name": "w", "dtype": "float32", "shape": [2**40], "offset": 0}, "max_bucket_bytes"),
    ],
)
def test_a_bucket_not_from_a_sender_is_refused_before_anything_is_allocated(entry: dict, message: str) -> None:
    receiver = object.__new__(WeightReceiver)  # no process group: the entries are refused before any receive
    receiver.max_bucket_bytes = 2**30
    with pytest.raises(ValueError, match=message):
        receiver._unpack([entry], src=1)


def test_sender_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="sender_rank"):
        WeightSender("127.0.0.1:1", sender=True, sender_rank=2, senders=2)
    with pytest.raises(ValueError, match="host:port"):
        WeightReceiver("nowhere", timeout=timedelta(seconds=1))

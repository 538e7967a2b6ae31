"""Flower's Grid as the round loop's grid (``gep_fed.federation.rounds.RoundGrid``).

A request's records become a train (a round) or query (a score) ``Message``'s ``RecordDict``
(arrays as ``Array``, in the same order), and a reply ``Message`` becomes a ``Reply`` (its
records as they came, or its error code). The payload bytes both ways are counted (``MeteredGrid``).
"""

from __future__ import annotations

from collections.abc import Sequence

from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid

from gep_fed.federation.rounds import Arrays, Config, Envelope, Metrics, Reply, Request


def content_bytes(message: Message) -> int:
    """The payload bytes of a message: its arrays and the byte strings of its configs."""
    if not message.has_content():
        return 0
    content = message.content
    total = sum(len(a.data) for r in content.array_records.values() for a in r.values())
    for record in content.config_records.values():
        for value in record.values():
            for item in value if isinstance(value, list) else [value]:
                total += len(item) if isinstance(item, bytes | str) else 0
    return total


class MeteredGrid:
    """A Grid that counts the payload bytes it sends and receives (the cost of a mode)."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid
        self.sent = self.received = 0

    def get_node_ids(self):
        return self.grid.get_node_ids()

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        self.sent += sum(content_bytes(m) for m in messages)
        replies = list(self.grid.send_and_receive(messages=messages, timeout=timeout))
        self.received += sum(content_bytes(m) for m in replies)
        return replies


def record_dict(content: Envelope) -> RecordDict:
    """An envelope's records as Flower's."""
    records = {}
    for name, record in content.records.items():
        if isinstance(record, Arrays):
            records[name] = ArrayRecord({k: Array(v) for k, v in record.items()})
        elif isinstance(record, Metrics):
            records[name] = MetricRecord(dict(record))
        else:
            records[name] = ConfigRecord(dict(record))
    return RecordDict(records)


def message(request: Request, group_id: str | None = None) -> Message:
    """A request as a train (a round) or query (a score) message to its node."""
    return Message(
        content=record_dict(request.content),
        message_type=MessageType.QUERY if request.kind == "query" else MessageType.TRAIN,
        dst_node_id=request.node,
        group_id=group_id,
    )


def reply(msg: Message) -> Reply:
    """A reply message as the round loop reads it."""
    node, run_id = msg.metadata.src_node_id, msg.metadata.run_id
    if msg.has_error():
        return Reply(node, error=msg.error.code, run_id=run_id)
    content = msg.content
    records = {}
    for name, record in content.items():
        if isinstance(record, ArrayRecord):
            records[name] = Arrays(record)
        elif isinstance(record, MetricRecord):
            records[name] = Metrics(record)
        else:
            records[name] = Config(record)
    return Reply(node, Envelope(records), run_id=run_id)


class FlowerGrid:
    """Flower's Grid, metered, for ``gep_fed.federation.rounds.RoundLoop``."""

    def __init__(self, grid: Grid) -> None:
        self.grid = MeteredGrid(grid)

    @property
    def sent(self) -> int:
        return self.grid.sent

    @property
    def received(self) -> int:
        return self.grid.received

    def node_ids(self) -> list[int]:
        return list(self.grid.get_node_ids())

    def exchange(
        self, requests: Sequence[Request], *, group_id: str | None, timeout: float | None
    ) -> list[Reply]:
        messages = [message(r, group_id) for r in requests]
        return [reply(m) for m in self.grid.send_and_receive(messages, timeout=timeout)]

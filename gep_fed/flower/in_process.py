"""An in-process engine: the real ServerApp and the real ClientApp of every simulated site,
exchanging Flower messages in this process, without Ray or a SuperLink.

It serves tests, tuning and quick experiments that exercise federated behaviour (policies,
ledgers, modes, the secure sum, resumption) rather than Flower's transport. Each message is
copied on the way to a site and on the way back, as serialisation would, so no object is
shared between the server and a site; a site's exception becomes an error reply, as Flower's
simulation makes it. The sites answer one after another.
"""

from __future__ import annotations

import copy
import itertools
import logging
import secrets
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from uuid import uuid4

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid, ServerApp
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

log = logging.getLogger("gep_fed.server")

# Node ids of the in-process sites (Flower's simulation draws random ones).
FIRST_NODE_ID = 100
# Run ids of this process's in-process runs: each run is new to the sites.
_RUN_IDS = itertools.count(1 + secrets.randbelow(2**31))


class InProcessGrid(Grid):
    """Flower's ``Grid`` over the ClientApp of each site, called in this process.

    Args:
        client_app: the sites' ClientApp.
        contexts: each site's Context (its node id, node config and state), by node id.
        run: the run the messages belong to.
    """

    def __init__(self, client_app: ClientApp, contexts: dict[int, Context], run: Run) -> None:
        self.client_app = client_app
        self.contexts = contexts
        self._run = run
        self._replies: dict[str, Message] = {}

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return Message(
            content=content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id
        )

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            message_id = str(uuid4())
            msg.metadata.__dict__["_message_id"] = message_id  # as Flower's grids assign it
            node = msg.metadata.dst_node_id
            reply = self._answer(copy.deepcopy(msg), node) if node in self.contexts else None
            if reply is not None:  # None: the site never answers
                self._replies[message_id] = reply
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(i) for i in list(message_ids) if i in self._replies]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages))

    def _answer(self, msg: Message, node: int) -> Message | None:
        """The site's reply to its own copy of ``msg`` (a copy again)."""
        try:
            reply = self.client_app(msg, self.contexts[node])
        except Exception as err:  # as Flower's simulation: an error reply, not a crash
            log.warning("the ClientApp of node %d raised %s: %s", node, type(err).__name__, err)
            # the reply carries the fixed code only: an exception's text may hold site data
            reply = Message(
                error=Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, "ClientApp raised an exception"),
                reply_to=msg,
            )
        return copy.deepcopy(reply)


def site_contexts(
    num_sites: int, run_id: int, run_config: Mapping | None = None
) -> dict[int, Context]:
    """Each simulated site's Context, with the node config Flower's simulation gives it
    (``partition-id``, ``num-partitions``) and the run's ``run_config`` (None: empty)."""
    return {
        FIRST_NODE_ID + i: Context(
            run_id,
            FIRST_NODE_ID + i,
            {"partition-id": i, "num-partitions": num_sites},
            RecordDict(),
            dict(run_config or {}),
        )
        for i in range(num_sites)
    }


@contextmanager
def in_process_grid(
    client_app: ClientApp,
    num_sites: int,
    run_id: int | None = None,
    run_config: Mapping | None = None,
) -> Iterator[InProcessGrid]:
    """A grid over ``num_sites`` simulated sites of ``client_app``, each with the node config
    Flower's simulation gives it (``partition-id``, ``num-partitions``), for the time of the
    ``with`` block. ``run_id``: a new one by default (a site keeps its state per run, as
    under Flower); ``run_config``: the run's, as every site's Context holds it."""
    run_id = run_id if run_id is not None else next(_RUN_IDS)
    contexts = site_contexts(num_sites, run_id, run_config)
    grid = InProcessGrid(client_app, contexts, Run.create_empty(run_id))
    saved = TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run_id, 0, 0
    try:
        yield grid
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


def run_in_process(
    server_app: ServerApp,
    client_app: ClientApp,
    num_sites: int,
    run_id: int | None = None,
    run_config: Mapping | None = None,
) -> None:
    """Run ``server_app`` against ``num_sites`` simulated sites of ``client_app``
    (``in_process_grid``), every Context with ``run_config`` (as ``flwr run`` gives it)."""
    with in_process_grid(client_app, num_sites, run_id, run_config) as grid:
        context = Context(grid.run.run_id, 0, {}, RecordDict(), dict(run_config or {}))
        server_app(grid, context)

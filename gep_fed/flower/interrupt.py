"""Stopping a run between rounds: what the first Ctrl-C does.

A stop request (``StopRequest.request``: the first SIGINT of ``gep-fed simulate``, or Flower's
exit handlers under ``flwr run``) lets the round in progress finish if its replies arrive
within ``grace`` seconds, else abandons it (nothing of it is applied or accounted by the
server; a site that already answered has recorded its steps in its own ledger, so its spending
is over-counted, never under-counted). The run then stops before its next round: its metrics,
ledger and checkpoint hold every completed round, and running it again with the same settings
and run name resumes after the last one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flwr.app import Message

# Seconds a stop request waits for the replies of the round in progress before abandoning it.
INTERRUPT_GRACE_S = 10.0


class RunInterrupted(Exception):
    """The run was asked to stop; ``completed_round`` is the last round it committed."""

    def __init__(self, completed_round: int = 0, resume: str = "rerun the same command") -> None:
        self.completed_round = completed_round
        self.resume = resume
        super().__init__(self.line())

    def line(self) -> str:
        """The one line a user sees: where the run stopped and how to go on."""
        if self.completed_round == 0:
            return f"interrupted before round 1: nothing was trained; {self.resume} to start it"
        return f"interrupted after round {self.completed_round}: {self.resume} to resume"


class StopRequest:
    """A thread-safe flag the ServerApp checks between and during rounds."""

    def __init__(self, grace: float = INTERRUPT_GRACE_S) -> None:
        self.grace = grace
        self._event = threading.Event()

    def request(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()


def stop_on_flower_exit() -> StopRequest:
    """A stop request set by Flower's exit handlers (``flwr stop``, SIGINT or SIGTERM to
    the process running the ServerApp), where Flower offers them."""
    request = StopRequest()
    try:
        from flwr.supercore.exit import add_exit_handler
    except ImportError:  # another Flower: the run then stops as Flower stops it
        return request
    add_exit_handler(request.request)
    return request


class StoppableGrid:
    """A Grid whose ``send_and_receive`` honours a ``StopRequest``: none is sent after the
    request, and replies still missing ``grace`` seconds after it abandon the round
    (``RunInterrupted``). Everything else is the wrapped Grid's."""

    def __init__(self, grid, stop: StopRequest, poll_s: float | None = None) -> None:
        self.grid = grid
        self.stop = stop
        # as often as the Grid says it polls (Flower's in-memory Grid: 0.1 s); its HTTP Grid
        # (a deployment) says nothing and would sleep 3 s between pulls: 0.5 s, one small
        # request to the SuperLink each
        self.poll_s = poll_s if poll_s is not None else getattr(grid, "pull_interval", 0.5)

    def __getattr__(self, name: str):
        return getattr(self.grid, name)

    def get_node_ids(self):
        return self.grid.get_node_ids()

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> list[Message]:
        if self.stop.is_set():
            raise RunInterrupted()
        waiting = set(self.grid.push_messages(messages))
        deadline = None if timeout is None else time.monotonic() + timeout
        give_up = None
        replies: list[Message] = []
        while waiting:
            got = list(self.grid.pull_messages(waiting))
            replies.extend(got)
            waiting -= {m.metadata.reply_to_message_id for m in got}
            now = time.monotonic()
            if not waiting or (deadline is not None and now >= deadline):
                break
            if self.stop.is_set():
                give_up = give_up or now + self.stop.grace
                if now >= give_up:
                    raise RunInterrupted()
            time.sleep(self.poll_s)
        return replies

"""The site's verifying launcher for process-isolated ClientApps: only the app bundles the site
pinned run, and any other is refused before any of its code is imported.

Why it exists: a SuperNode installs and runs whatever bundle the SuperLink sends. Flower's own
check (``flower-supernode --trusted-entities``) needs signed verification records that only
Flower's hosted platform issues; a self-hosted SuperLink sends none, so that check refuses every
bundle. With ``flower-supernode --isolation process`` the SuperNode starts no app process itself:
the site does, and this module is what the site runs for that, in place of Flower's SuperExec:

    python -m gep_fed.flower.pinned_clientapp --pinned-fab SHA256[,SHA256] \\
        --runtime-api-address 127.0.0.1:9401 --insecure [--parent-pid PID]

It polls the SuperNode's Runtime API for ClientApp tasks only (an AgentApp or other task type
is never taken, so nothing else of a bundle can be started through it). A task whose bundle is
not pinned is answered here with an error reply (``ErrorCode.INVALID_FAB``: the server sees this
site fail the round) without starting any process; each other task gets a process of its own in
task mode, forked from a fork server that imported Flower's ClientApp runner, torch and gep_fed
once (a fresh interpreter would import them again at every round, about 5 s of CPU). Task mode
is Flower's ``flwr-clientapp`` (same arguments) with one check added:

    python -m gep_fed.flower.pinned_clientapp --pinned-fab SHA256 --token TOKEN \\
        --runtime-api-address 127.0.0.1:9401 --insecure

checks the bundle's bytes as pulled from the Runtime API against the pins, before Flower installs
(unpacks) or imports anything of it, and refuses the same way. Task mode alone is also a drop-in
for ``flwr-clientapp`` under Flower's own ``flower-superexec``. See ``app_pin`` for the pin.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable

from gep_fed.flower.app_pin import UnpinnedAppError, check_fab, check_hash, parse_pins

# A child of Flower's logger: same handler and format as the Flower lines around it.
log = logging.getLogger("flwr.gep_fed.pinned_clientapp")
TOKEN_FLAGS = ("--token", "--token-file", "--token-stdin")


def _runtime_client(address: str, insecure: bool, root_certificates: str | None, token=None):
    """A client of the SuperNode's Runtime API, as Flower's SuperExec (no token) or a ClientApp
    process (with its task token) builds it."""
    from flwr.supercore.interceptors import (
        RuntimeTokenHttpInterceptor,
        RuntimeVersionHttpInterceptor,
    )
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient
    from flwr.supercore.tls import validate_and_resolve_root_certificates

    interceptors = [
        RuntimeVersionHttpInterceptor("SuperExec" if token is None else "flwr-clientapp")
    ]
    if token is not None:
        interceptors.append(RuntimeTokenHttpInterceptor(token))
    return RuntimeHttpClient.from_server_address(
        server_address=address,
        insecure=insecure,
        root_certificates=validate_and_resolve_root_certificates(root_certificates, insecure),
        interceptors=interceptors,
        retry_invoker=make_simple_http_retry_invoker(),
    )


def _reply_refusal(client, message, context, reason: str) -> None:
    """The error reply the server receives for a refused bundle (Flower's FAB-check code)."""
    from flwr.app import Error, Message
    from flwr.common.constant import ErrorCode
    from flwr.supernode.runtime.run_clientapp import push_message

    log.error("refused: %s", reason)
    push_message(client, Message(Error(ErrorCode.INVALID_FAB, reason), reply_to=message), context)


def verifying_pull(pull: Callable, pins: frozenset[str]) -> Callable:
    """Flower's ``pull_task_input`` followed by the pin check, for ``run_clientapp``: the
    bundle's bytes (and the run's claim about them) are checked before it installs or loads
    anything; a refused task gets its error reply here, then fails."""
    from flwr.common.config import get_fab_config, get_metadata_from_config

    def pull_and_verify(client):
        message, context, run, fab = pull(client)
        try:
            fab_hash = check_fab(fab.content, pins)
            # Flower installs under the content's hash but loads from a folder named by the
            # run's fab_id, fab_version and fab.hash_str: all three must name this bundle.
            named = get_metadata_from_config(get_fab_config(fab.content))
            if fab.hash_str != fab_hash or (run.fab_id, run.fab_version) != named:
                raise UnpinnedAppError(
                    f"the run names its bundle {run.fab_id} {run.fab_version} {fab.hash_str}, "
                    f"but the pinned bundle it sent is {named[0]} {named[1]} {fab_hash}"
                )
        except UnpinnedAppError as err:
            _reply_refusal(client, message, context, str(err))
            raise
        log.info("app bundle %s is pinned: handing over to Flower's ClientApp runner", fab_hash)
        return message, context, run, fab

    return pull_and_verify


def run_task(pins: frozenset[str], flwr_clientapp_args: list[str]) -> None:
    """Flower's ``flwr-clientapp`` for one task, with the pin check in its input step."""
    import flwr.supernode.runtime.run_clientapp as runner
    from flwr.supernode.cli.flwr_clientapp import flwr_clientapp

    # The one hook: run_clientapp looks up pull_task_input in its module at call time. Should a
    # Flower release stop doing so, refuse to run at all rather than run unchecked.
    if "pull_task_input" not in runner.run_clientapp.__code__.co_names:
        sys.exit("this Flower's run_clientapp no longer calls pull_task_input: refusing to run")
    runner.pull_task_input = verifying_pull(runner.pull_task_input, pins)
    # A fresh Flower home per task: the bundle is unpacked where nothing else was ever
    # installed, so no earlier folder of the same name can be loaded in its place.
    home = tempfile.mkdtemp(prefix="gep-fed-app-")
    os.environ["FLWR_HOME"] = home
    sys.argv = ["flwr-clientapp", *flwr_clientapp_args]
    try:
        flwr_clientapp()
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _refuse_task(client, fab_hash: str, reason: str) -> None:
    """Answer a claimed task with the error reply, without starting any process for it."""
    from flwr.common.constant import SubStatus
    from flwr.supernode.runtime.run_clientapp import pull_task_input, push_task_output

    message, context, _, _ = pull_task_input(client)  # protobuf only: nothing is imported
    try:
        _reply_refusal(client, message, context, reason)
    finally:
        push_task_output(client, None, SubStatus.FAILED, f"unpinned app bundle {fab_hash}")


# What each forked task process finds imported: the runner, the site's own gep_fed (the
# one a task process imported before loading a bundle anyway: this module is part of it),
# and torch's compiler, which torch imports at a round's first optimizer or convolution's
# per-example gradient (about 2 s of every round at a site otherwise).
TASK_PRELOAD = (
    "flwr.supernode.cli.flwr_clientapp",
    "flwr.supernode.runtime.run_clientapp",
    "gep_fed.flower.clientapp",
    "torch._dynamo",
)


def task_processes() -> multiprocessing.context.BaseContext:
    """Python's fork server, started now (a fresh interpreter importing ``TASK_PRELOAD`` while
    the site waits for its first round); every task process is forked from it. It opens no
    connection, so a task inherits none."""
    from multiprocessing import forkserver

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(TASK_PRELOAD))
    forkserver.ensure_running()
    return context


def _start_task(
    task, token: str, pins: frozenset[str], api: tuple, processes
) -> multiprocessing.process.BaseProcess | None:
    """One claimed ClientApp task: refused here if its bundle is not pinned, else handed to a
    task-mode process of its own (which checks the bundle's bytes again)."""
    address, insecure, root_certificates = api
    try:
        check_hash(task.fab_hash, pins)
    except UnpinnedAppError as err:
        client = _runtime_client(address, insecure, root_certificates, token)
        try:
            _refuse_task(client, task.fab_hash, str(err))
        finally:
            client.close()
        return None
    tls = ["--insecure"] if insecure else []
    if root_certificates is not None and not insecure:
        tls = ["--root-certificates", root_certificates]
    args = ["--runtime-api-address", address, "--token", token, *tls]
    args += ["--parent-pid", str(os.getpid())]
    # by its module's name (this module may be __main__): the fork server has it preloaded
    from gep_fed.flower.pinned_clientapp import run_task as task_mode

    child = processes.Process(target=task_mode, args=(pins, args), name=f"task {task.task_id}")
    child.start()
    return child


def serve(
    pins: frozenset[str],
    runtime_api_address: str,
    insecure: bool,
    root_certificates: str | None = None,
    parent_pid: int | None = None,
    poll_interval: float = 1.0,
) -> None:
    """Poll the Runtime API for ClientApp tasks; refuse unpinned bundles, start task mode for
    the others (one process per task, as Flower's SuperExec does)."""
    from flwr.proto.runtime_pb2 import AcquireTaskRequest
    from flwr.supercore.app_utils import start_parent_process_monitor
    from flwr.supercore.constant import TaskType

    if parent_pid is not None:
        start_parent_process_monitor(parent_pid)  # stop with the SuperNode
    api = (runtime_api_address, insecure, root_certificates)
    processes = task_processes()
    client = _runtime_client(*api)
    children: list[multiprocessing.process.BaseProcess] = []
    log.info("serving ClientApp tasks of %s for pinned bundles %s", runtime_api_address, pins)
    try:
        while True:
            # Only ClientApp tasks: no other task type of a bundle is ever claimed here.
            request = AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP])
            res = client.AcquireTask(request)
            if res.HasField("task") and res.token:
                try:
                    if child := _start_task(res.task, res.token, pins, api, processes):
                        children.append(child)
                except Exception:  # one bad task must not stop the site's launcher
                    log.exception("task %d: failed to refuse or start it", res.task.task_id)
            children = [c for c in children if c.is_alive()]  # reaps finished tasks
            time.sleep(poll_interval)
    finally:
        client.close()


def main(argv: Iterable[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    first = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    first.add_argument("--pinned-fab", required=True)
    known, rest = first.parse_known_args(argv)
    try:
        pins = parse_pins(known.pinned_fab)
    except ValueError as err:
        sys.exit(f"--pinned-fab: {err}")
    if any(arg.split("=", 1)[0] in TOKEN_FLAGS for arg in rest):
        run_task(pins, rest)  # one task: the usual flwr-clientapp arguments
        return
    ap = argparse.ArgumentParser(
        prog="python -m gep_fed.flower.pinned_clientapp --pinned-fab SHA256[,SHA256]",
        description="Run the SuperNode's ClientApp tasks, only for pinned app bundles.",
        allow_abbrev=False,
    )
    ap.add_argument("--runtime-api-address", required=True, help="the SuperNode's, host:port")
    ap.add_argument("--insecure", action="store_true", help="the Runtime API has no TLS")
    ap.add_argument("--root-certificates", help="CA of the Runtime API's TLS certificate")
    ap.add_argument("--parent-pid", type=int, help="exit when this process (the SuperNode) does")
    args = ap.parse_args(rest)
    with contextlib.suppress(KeyboardInterrupt):  # the SuperNode stopped (parent monitor)
        serve(
            pins, args.runtime_api_address, args.insecure, args.root_certificates, args.parent_pid
        )


if __name__ == "__main__":
    main()

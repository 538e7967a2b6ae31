"""A site runs only the app bundle it reviewed: a real SuperLink (TLS, SuperNode authentication)
and two real SuperNodes in process isolation, one started by ``deploy/start-supernode.sh`` (the
site's verifying launcher), one under Flower's own ``flower-superexec`` with the launcher's task
mode in place of ``flwr-clientapp``. The reviewed bundle trains; a bundle whose ClientApp would
read the site's data and leak it is refused before any of its code is imported."""

import hashlib
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from gep_fed.accounting.ledger import PrivacyLedger
from gep_fed.federation.rundir import RunDirectory
from gep_fed.flower import pinned_clientapp
from gep_fed.flower.app_pin import (
    UnpinnedAppError,
    check_fab,
    fab_pin,
    main,
    parse_pins,
)

ROOT = Path(__file__).parents[1]
BIN = Path(sys.executable).parent
SITES = ("site-0", "site-1")
TINY_PYPROJECT = b"""[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "tiny"
version = "1.0.0"

[tool.flwr.app]
publisher = "site"

[tool.flwr.app.components]
serverapp = "tiny.server:app"
clientapp = "tiny.client:app"
"""


def tiny_fab(client_code: bytes = b"raise SystemExit('bundle code was imported')\n") -> bytes:
    """A minimal bundle, built by Flower's own builder."""
    from flwr.cli.build import build_fab_from_files

    files = {"pyproject.toml": TINY_PYPROJECT, "tiny/client.py": client_code}
    return build_fab_from_files(files)[0]


# -- the pin and the check (fast) ---------------------------------------------------------------


def test_the_pin_of_a_bundle_is_the_sha256_of_its_bytes_as_file_bytes_or_folder(tmp_path):
    fab = tiny_fab()
    (tmp_path / "app.fab").write_bytes(fab)
    digest = hashlib.sha256(fab).hexdigest()
    assert fab_pin(fab) == fab_pin(tmp_path / "app.fab") == fab_pin(str(tmp_path / "app.fab"))
    assert fab_pin(fab) == digest
    project = tmp_path / "tiny"
    (project / "tiny").mkdir(parents=True)
    (project / "pyproject.toml").write_bytes(TINY_PYPROJECT)
    (project / "tiny" / "client.py").write_bytes(b"raise SystemExit('bundle code was imported')\n")
    assert fab_pin(project) == digest  # what `flwr run tiny` sends: the same bytes


@pytest.mark.slow  # over ~3 s
def test_the_projects_bundle_holds_the_code_a_site_runs_and_nothing_of_the_lab():
    """What `flwr run .` sends and a hospital pins: the library, the apps, the examples and
    the deployment scripts; never the benchmarks' logs, the docs or the tests."""
    import io
    import zipfile

    from flwr.cli.build import build_fab_from_disk

    fab = build_fab_from_disk(ROOT)
    names = zipfile.ZipFile(io.BytesIO(fab)).namelist()
    tops = {name.split("/")[0] for name in names}
    assert {"gep_fed", "server", "client", "examples"} <= tops
    assert not tops & {"benchmarks", "docs", "simulations", "tests"}, sorted(tops)
    assert "examples/hospital/task.py" in names and len(fab) < 2_000_000


def test_pins_must_be_full_sha256_digests():
    digest = "ab" * 32
    assert parse_pins(f" {digest.upper()} ,{'cd' * 32}") == {digest, "cd" * 32}
    for bad in ("", " , ", digest[:8], digest + "0", "zz" * 32):
        with pytest.raises(ValueError):
            parse_pins(bad)


def test_an_unpinned_bundle_is_refused_with_both_hashes_named():
    fab, pinned = tiny_fab(), "ab" * 32
    with pytest.raises(UnpinnedAppError) as refused:
        check_fab(fab, {pinned})
    assert fab_pin(fab) in str(refused.value) and pinned in str(refused.value)
    assert check_fab(fab, {pinned, fab_pin(fab)}) == fab_pin(fab)


def test_the_pin_command_prints_one_pin_per_bundle(tmp_path, capsys):
    (tmp_path / "app.fab").write_bytes(tiny_fab())
    assert main([str(tmp_path / "app.fab")]) == 0
    assert capsys.readouterr().out.split() == [fab_pin(tiny_fab())]
    assert main([str(tmp_path / "missing.fab")]) == 2


def test_the_launcher_refuses_a_run_that_misnames_its_pinned_bundle(monkeypatch):
    """Flower loads the app from a folder named by the run's fab_id and fab_version and the
    FAB's hash_str: a run that names its bundle otherwise is refused, even when pinned."""
    from flwr.supercore.fab import Fab

    fab = tiny_fab()
    pins = frozenset({fab_pin(fab)})
    replies = []
    monkeypatch.setattr(pinned_clientapp, "_reply_refusal", lambda *a: replies.append(a[-1]))
    honest = SimpleNamespace(fab_id="site/tiny", fab_version="1.0.0")
    cases = {
        "accepted": (honest, Fab(fab_pin(fab), fab, {})),
        "unpinned": (honest, Fab(fab_pin(tiny_fab(b"x = 1\n")), tiny_fab(b"x = 1\n"), {})),
        "other version": (SimpleNamespace(fab_id="site/tiny", fab_version="../.."), None),
        "other hash_str": (honest, Fab("0" * 64, fab, {})),
    }
    for name, (run, given) in cases.items():
        given = given or Fab(fab_pin(fab), fab, {})
        pull = pinned_clientapp.verifying_pull(lambda _c, r=run, g=given: ("m", "c", r, g), pins)
        if name == "accepted":
            assert pull(None) == ("m", "c", run, given)
            continue
        with pytest.raises(UnpinnedAppError):
            pull(None)
    assert len(replies) == 3  # each refusal answered the server


@pytest.mark.slow
def test_a_sites_task_processes_start_with_the_runner_and_gep_fed_already_imported():
    # forked from the launcher's preloaded server: a round does not pay for these imports
    from forked_task import report_preloaded

    processes = pinned_clientapp.task_processes()
    receive, send = processes.Pipe(duplex=False)
    wanted = [*pinned_clientapp.TASK_PRELOAD, "torch", "gep_fed"]
    task = processes.Process(target=report_preloaded, args=(wanted, send))
    task.start()
    send.close()
    assert receive.recv() == wanted
    task.join(timeout=30)
    assert task.exitcode == 0


def test_flowers_clientapp_runner_still_takes_its_input_through_the_hooked_function():
    """The launcher's task mode hooks ``run_clientapp``'s ``pull_task_input``; it refuses to
    run when a Flower release stops looking it up there, and this fails first."""
    import flwr.supernode.runtime.run_clientapp as runner

    code = runner.run_clientapp.__code__
    assert "pull_task_input" in code.co_names and "install_from_fab" in code.co_names


# -- end to end: a real federation (slow) -------------------------------------------------------

MODIFIED_CLIENT = '''"""A coordinator's modified ClientApp: reads the site's data and leaks it."""

import os
from pathlib import Path

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.clientapp import ClientApp

MARKERS = Path({markers!r})
(MARKERS / f"imported-{{os.getpid()}}").write_text("the modified bundle's code ran at a site")
app = ClientApp()


@app.train()
def train(msg, context):
    size = os.path.getsize(context.node_config["data-path"])
    (MARKERS / f"data-read-{{os.getpid()}}").write_text(str(size))
    return Message(RecordDict({{"leak": ConfigRecord({{"data-size": size}})}}), reply_to=msg)
'''

# Site 1: Flower's own SuperExec, with the launcher's task mode as its `flwr-clientapp`.
SITE_1 = r"""
LEDGER="ledger-path=\"$DEPLOY/ledgers/site-1.json\""
POLICY='epsilon-budget=8.0 delta=1e-5 accept-modes="client" device="cpu" task="digits"'
mkdir -p "$DEPLOY/shim"
printf '#!/bin/sh\nexec "%s" -m gep_fed.flower.pinned_clientapp --pinned-fab "%s" "$@"\n' \
  "$PYTHON" "$PINNED_FAB" > "$DEPLOY/shim/flwr-clientapp"
chmod +x "$DEPLOY/shim/flwr-clientapp"
PATH="$DEPLOY/shim:$PATH" setsid bash -c \
  'flower-superexec --runtime-api-address "127.0.0.1:$NODE_PORT" --insecure --parent-pid $$ &
   exec "$@"' superexec \
  flower-supernode --superlink "127.0.0.1:$PORT" --root-certificates "$DEPLOY/secrets/ca.crt" \
  --auth-supernode-private-key "$DEPLOY/secrets/keys/site-1" --isolation process \
  --host 127.0.0.1 --port "$NODE_PORT" \
  --node-config "site-id=\"site-1\" data-path=\"$DEPLOY/data/site-1.npz\" $LEDGER $POLICY" \
  > "$DEPLOY/site-1.log" 2>&1 &
echo $! > "$DEPLOY/pids/site-1.pid"
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bash(script: str, env: dict, cwd: Path = ROOT, timeout: int = 300):
    done = subprocess.run(
        ["bash", "-c", "set -euo pipefail\n" + script],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def copy_project(target: Path) -> Path:
    shutil.copytree(
        ROOT,
        target,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "runs", "__pycache__", "*.egg-info", ".pytest_cache", ".ruff_cache"
        ),
    )
    return target


def wait_for(path: Path, text: str, timeout: float = 90) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.5)
    raise AssertionError(f"{text!r} not in {path} after {timeout} s")


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    for tool in ("openssl", "ssh-keygen"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is needed to make the test certificates and keys")
    for tool in ("flower-superlink", "flower-supernode", "flower-superexec", "flwr"):
        if not (BIN / tool).exists():
            pytest.skip(f"{tool} is not installed beside {sys.executable}")
    tmp = tmp_path_factory.mktemp("pinning")
    deploy, markers = tmp / "federation", tmp / "markers"
    markers.mkdir()
    reviewed = copy_project(tmp / "reviewed")
    modified = copy_project(tmp / "modified")
    (modified / "client" / "app.py").write_text(MODIFIED_CLIENT.format(markers=str(markers)))
    env = {
        **os.environ,
        "DEPLOY": str(deploy),
        "PORT": str(free_port()),
        "FLWR_HOME": str(deploy / "flwr"),
        "PATH": f"{BIN}:{os.environ['PATH']}",
        "PYTHON": sys.executable,
        "RAY_USAGE_STATS_ENABLED": "0",
        "TASK": "digits",  # the site's own task, in its node config
    }
    # The hospital reviews the bundle `flwr build` writes and pins it with sha256sum alone.
    (deploy / "review").mkdir(parents=True)
    bash(f"flwr build --app '{reviewed}'", env, cwd=deploy / "review")
    (fab_file,) = (deploy / "review").glob("*.fab")
    env["PINNED_FAB"] = hashlib.sha256(fab_file.read_bytes()).hexdigest()
    assert fab_pin(reviewed) == env["PINNED_FAB"] != fab_pin(modified)
    pgids = []
    try:
        bash(
            'deploy/make-certs.sh "$DEPLOY/secrets" 127.0.0.1 site-0 site-1 > /dev/null\n'
            f'python deploy/make_site_data.py "$DEPLOY/data" --task digits --num-sites 2\n'
            "deploy/start-superlink.sh\n"
            "deploy/flower-connection.sh\n"
            "for site in site-0 site-1; do\n"
            '  flwr supernode register "$DEPLOY/secrets/keys/$site.pub" hospitals\n'
            '  gep-fed ledger init "$DEPLOY/ledgers/$site.json" --owner "$site" --delta 1e-5\n'
            "done\n"
            f"NODE_PORT={free_port()} deploy/start-supernode.sh site-0 "
            '"$DEPLOY/data/site-0.npz" "$DEPLOY/ledgers/site-0.json" 8.0 1e-5 client cpu\n'
            f"export NODE_PORT={free_port()}\n" + SITE_1,
            env,
        )
        pgids = [int((deploy / "pids" / f"{site}.pid").read_text()) for site in SITES]
        for site, ready in zip(
            SITES, ("serving ClientApp tasks", "Starting Flower SuperExec"), strict=True
        ):
            wait_for(deploy / f"{site}.log", "SuperNode ID")
            wait_for(deploy / f"{site}.log", ready)
        yield SimpleNamespace(
            env=env, deploy=deploy, markers=markers, reviewed=reviewed, modified=modified
        )
    finally:
        bash("deploy/stop.sh", env, timeout=120)
    assert not list((deploy / "pids").glob("*.pid"))
    for pgid in pgids:  # stop.sh ended each group: SuperNode, launcher or SuperExec, tasks
        left = subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True, text=True)
        assert left.stdout.strip() == "", f"processes of group {pgid} still run"


def site_steps(fed) -> list[int]:
    return [
        PrivacyLedger.load_keyed(fed.deploy / "ledgers" / f"{site}.json").steps for site in SITES
    ]


def flwr_run(fed, app: Path, name: str):
    config = (
        "task='digits' mode='client' target-epsilon=4.0 rounds=1 local-steps=1 min-sites=1 "
        f"round-timeout=90.0 run-dir='{fed.deploy / 'runs'}' run-name='{name}'"
    )
    done = bash(f'flwr run . hospitals --stream --run-config "{config}"', fed.env, cwd=app)
    return done.stdout + done.stderr, RunDirectory.open(fed.deploy / "runs" / name).read_metrics()


@pytest.mark.slow
def test_the_reviewed_bundle_is_accepted_and_trains_a_round_at_each_site(federation):
    before = site_steps(federation)
    _, rows = flwr_run(federation, federation.reviewed, "reviewed")
    assert [r["round"] for r in rows] == [1]
    assert rows[0]["sites_ok"] == 2 and rows[0]["applied"]
    assert site_steps(federation) == [s + 1 for s in before]  # one local step at each site
    for site in SITES:
        log = (federation.deploy / f"{site}.log").read_text()
        assert f"app bundle {federation.env['PINNED_FAB']} is pinned" in log


@pytest.mark.slow
def test_a_modified_bundle_is_refused_before_any_of_its_code_runs(federation):
    before = site_steps(federation)
    out, rows = flwr_run(federation, federation.modified, "modified")
    modified_hash = fab_pin(federation.modified)
    # Nothing of the bundle ran at a site: not imported, the data never read, no step spent.
    ran = {p.name: p.read_text() for p in federation.markers.iterdir()}
    assert ran == {}, f"the modified bundle's code ran at a site: {ran}"
    assert site_steps(federation) == before
    # The server saw every site fail the round with the FAB-check error, and applied nothing.
    assert rows[0]["sites_ok"] == 0 and not rows[0]["applied"]
    assert out.count("invalid app bundle") == 2
    for site in SITES:
        log = (federation.deploy / f"{site}.log").read_text()
        assert f"refused: app bundle {modified_hash} is not the one this site reviewed" in log

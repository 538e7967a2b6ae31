"""A hospital's first run (issue 24): failures are loud and named, a simulation can use each
hospital's own folders, a site may lack a class, the server refuses BatchNorm by name."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from folder_task import BatchNormDigits, write_site_folders

from gep_fed.cli.main import main
from gep_fed.data.task import TaskSettings
from gep_fed.federation.config import FederationConfig
from gep_fed.federation.rundir import RunDirectory
from gep_fed.federation.server import FederationServer
from gep_fed.flower.simulation import SiteCheckFailed, check_simulated_sites, simulate
from gep_fed.mechanisms.per_example import IncompatibleModelError
from helpers import gep_fed_in_process

TESTS = Path(__file__).parent
TASK = "folder_task:FolderDigits"


def tiny(tmp_path, **settings) -> FederationConfig:
    base = dict(
        task=TASK,
        rounds=2,
        local_steps=1,
        num_basis=8,
        num_public=100,
        sample_rate=0.5,
        noise_seed=1,
        run_dir=str(tmp_path / "runs"),
        run_name="r",
    )
    return FederationConfig.for_task(**{**base, **settings})


def gep_fed(*args, env=None):
    return subprocess.run(
        [str(Path(sys.executable).parent / "gep-fed"), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(TESTS), **(env or {})},
        timeout=600,
    )


def test_a_site_with_a_corrupt_file_is_reported_before_round_1(tmp_path):
    folders = write_site_folders(tmp_path, {"hospital-a": 40, "hospital-b": 40})
    victim = sorted(Path(folders["hospital-b"]).rglob("*.png"))[3]
    victim.write_bytes(victim.read_bytes()[:30])
    problems = check_simulated_sites(tiny(tmp_path), folders)
    assert problems["hospital-a"] == []
    (found,) = problems["hospital-b"]
    assert str(victim) in found and "cannot be read" in found
    with pytest.raises(SiteCheckFailed, match=r"hospital-b: 1 example\(s\)"):
        simulate(tiny(tmp_path), progress=False, site_data=folders)
    assert not (tmp_path / "runs" / "r").exists()  # nothing started, nothing left behind


def test_sites_whose_inferred_classes_differ_are_refused_before_round_1_naming_the_site_and_classes(
    tmp_path, capsys
):
    """Issue 51: with no declared class list, a hospital without the "0" folder numbered
    "1".."9" as 0..8, every label shifted by one, and the run went ahead."""
    folders = write_site_folders(
        tmp_path, {"hospital-a": 40, "hospital-b": 40}, lacking={"hospital-b": [0]}
    )
    fed = tiny(tmp_path, task="folder_task:InferredFolderDigits")
    declaring = (
        '  ImageFolderDataset(data_path, transform, classes=["0", "1", "2", "3", "4", "5", '
        '"6", "7", "8", "9"])'
    )
    with pytest.raises(SiteCheckFailed) as refused:
        check_simulated_sites(fed, folders)
    lines = str(refused.value).splitlines()
    assert "  hospital-b: has folders 1, 2, 3, 4, 5, 6, 7, 8, 9; lacks 0" in lines
    assert lines[-1] == declaring and not any("hospital-a" in line for line in lines)
    args = ["simulate", "--task", fed.task, "--run-dir", str(tmp_path / "runs")]
    for name, path in folders.items():
        args += ["--site-data", f"{name}={path}"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "hospital-b: has folders 1, 2" in err and declaring in err
    assert not (tmp_path / "runs").exists()
    # the same folders at every site agree, and a declared list lets a site lack a class
    same = {"a": folders["hospital-a"], "b": folders["hospital-a"]}
    assert check_simulated_sites(fed, same) == {"a": [], "b": []}
    assert check_simulated_sites(tiny(tmp_path), folders) == {"hospital-a": [], "hospital-b": []}


def test_a_misspelt_class_folder_stops_a_simulation_before_round_1_naming_the_site_and_count(
    tmp_path,
):
    """Issue 51: a folder matching no declared class was silently left out (359 -> 301
    examples); it stops the run, even with --drop-bad-examples, naming site, folder, count."""
    folders = write_site_folders(tmp_path, {"hospital-a": 40, "hospital-b": 40})
    misspelt = Path(folders["hospital-b"]) / "3"
    count = len(list(misspelt.glob("*.png")))
    misspelt.rename(misspelt.with_name("three"))
    message = rf"hospital-b: .*folder 'three' holds {count} image\(s\), but no declared class"
    with pytest.raises(SiteCheckFailed, match=message):
        check_simulated_sites(tiny(tmp_path), folders)
    with pytest.raises(SiteCheckFailed, match=message):
        simulate(tiny(tmp_path), progress=False, site_data=folders, drop_bad_examples=True)
    assert not (tmp_path / "runs" / "r").exists()


def test_examples_dropped_as_asked_are_each_named_before_round_1(tmp_path, caplog):
    from gep_fed.flower.simulation import checked_simulation

    folders = write_site_folders(tmp_path, {"hospital-a": 40, "hospital-b": 40})
    victim = sorted(Path(folders["hospital-b"]).rglob("*.png"))[3]
    victim.write_bytes(victim.read_bytes()[:30])
    with caplog.at_level("WARNING", logger="gep_fed.simulation"):
        checked_simulation(tiny(tmp_path), "in-process", folders, drop_bad_examples=True)
    (record,) = caplog.records
    assert "loses these examples (--drop-bad-examples)" in record.message
    assert "hospital-b: 1 example(s): example 3: cannot" in record.message
    assert str(victim) in record.message
    assert "hospital-a" not in record.message


def test_batchnorm_in_a_users_model_is_refused_by_name_on_the_server(tmp_path):
    fed = FederationConfig(task="folder_task:BatchNormDigits", num_public=50)
    run = RunDirectory(tmp_path / "r")
    run.path.mkdir()
    with pytest.raises(IncompatibleModelError, match=r"BatchNorm1d.*batchnorm_to_groupnorm"):
        FederationServer(fed, BatchNormDigits(TaskSettings(num_public=50)), run, None)


@pytest.mark.slow
def test_a_simulation_whose_sites_all_fail_exits_nonzero_and_succeeds_once_fixed(tmp_path, capsys):
    folders = write_site_folders(tmp_path, {"hospital-a": 30, "hospital-b": 30})
    for png in Path(tmp_path).rglob("*.png"):
        png.write_bytes(b"not a png")
    args = [
        "simulate",
        "--task",
        TASK,
        "--rounds",
        "2",
        "--local-steps",
        "1",
        "--num-basis",
        "8",
        "--num-public",
        "100",
        "--run-dir",
        str(tmp_path / "runs"),
        "--run-name",
        "r",
    ]
    for name, path in folders.items():
        args += ["--site-data", f"{name}={path}"]
    args += ["--engine", "in-process"]  # what is tested is the run, not Ray
    code, _, err = gep_fed_in_process(capsys, *args)
    assert code == 2  # refused before round 1: every example unreadable
    lines = [x for x in err.splitlines() if x.strip().startswith("hospital-")]
    assert len(lines) == 2 and all("no usable example" in x for x in lines)
    assert not any("1 example(s)" in x for x in lines)  # not one example: none usable
    assert all("(the first: example 0: DataError: " in x and ".png" in x for x in lines)
    code, out, err = gep_fed_in_process(capsys, *args, "--drop-bad-examples")
    assert code == 1
    failed = [x for x in err.splitlines() if x.startswith("FAILED:")]
    assert "the model was not updated in round(s) 1-2" in failed[0]
    for name in folders:
        (line,) = [x for x in failed if x.startswith(f"FAILED: {name}:")]
        assert "refused in every round" in line and "site error: DataError" in line
    (rounds,) = [x for x in out.splitlines() if x.strip().startswith("rounds")]
    assert "2 of 2: replies accepted from every site in 0 round(s)" in rounds
    assert "from none in 2; the model was updated in 0" in rounds
    # nothing trained: said first, in the summary and the report, and not a success even
    # where site failures are allowed (the review: the untrained model's accuracy read as
    # the run's result, exit status 0)
    assert out.strip().splitlines()[0].startswith("NOTHING TRAINED: no round updated the model")
    report = (tmp_path / "runs" / "r" / "report.md").read_text()
    assert report.index("**NOTHING TRAINED") < report.index("final round 2")
    code, out, err = gep_fed_in_process(
        capsys, *args, "--drop-bad-examples", "--allow-site-failures"
    )
    assert code == 1 and "site failures allowed" not in err
    # the hospitals fix their files and run the same command: the unapplied rounds were not
    # checkpointed, so the run resumes before round 1 and plays both again, now a success
    write_site_folders(tmp_path, {"hospital-a": 30, "hospital-b": 30})
    code, out, err = gep_fed_in_process(capsys, *args, "--drop-bad-examples")
    assert code == 0, err[-2000:]
    assert not [x for x in err.splitlines() if x.startswith("FAILED:")]
    (rounds,) = [x for x in out.splitlines() if x.strip().startswith("rounds")]
    assert "2 of 2: replies accepted from every site in 2 round(s)" in rounds
    assert "from none in 0; the model was updated in 2" in rounds
    metrics = RunDirectory(tmp_path / "runs" / "r").read_metrics()
    assert [(r["round"], r["applied"]) for r in metrics] == [
        (1, False),
        (2, False),
        (1, False),  # the attempt with --allow-site-failures
        (2, False),
        (1, True),
        (2, True),
    ]


@pytest.mark.slow
def test_a_simulation_over_per_site_folders_reads_exactly_those_and_a_site_may_lack_a_class(
    tmp_path, monkeypatch
):
    folders = write_site_folders(
        tmp_path, {"hospital-a": 60, "hospital-b": 60}, lacking={"hospital-b": [3, 7]}
    )
    reads = tmp_path / "reads.txt"
    monkeypatch.setenv("FOLDER_TASK_READS", str(reads))
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    reads.write_text("")  # what a site reads does not depend on the mode
    result = simulate(
        tiny(tmp_path, mode="client", run_name="client"),
        progress=False,
        site_data=folders,
        engine="in-process",
    )
    assert all(r["sites_ok"] == 2 and r["applied"] for r in result.metrics)
    assert sorted(result.site_rounds) == ["hospital-a", "hospital-b"]
    read = [Path(line) for line in reads.read_text().splitlines()]
    roots = {Path(p) for p in folders.values()}
    assert read and all(any(root in p.parents for root in roots) for p in read)
    assert {p.parent.parent for p in read} == roots  # both sites' own folders, nothing else
    ledgers = sorted(p.parent.name for p in result.run_dir.glob("sites/*/ledger.json"))
    assert ledgers == ["hospital-a", "hospital-b"]
    assert torch.isfinite(torch.tensor(result.metrics[-1]["test_accuracy"]))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--task", "folder_task:NoEvaluation"], "eval_dataset() is needed"),
        (["--task", "folder_task:Nope"], "module 'folder_task' has no class 'Nope'"),
        (["--task", "folder_task:BatchNormDigits"], "batchnorm_to_groupnorm"),
        (["--site-data", "nameless"], "--site-data must be NAME=PATH"),
    ],
    ids=["no-eval-data", "misspelt-class", "batchnorm", "bad-site-data"],
)
def test_each_new_cli_error_is_one_line_and_leaves_no_run_directory(
    tmp_path, capsys, args, message
):
    code, _, err = gep_fed_in_process(
        capsys, "simulate", *args, "--run-dir", str(tmp_path / "runs")
    )
    assert code == 2
    assert err.strip().count("\n") == 0 and message in err
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_a_cli_error_is_one_line_from_the_installed_command(tmp_path):
    """As above, through the console script in a fresh process: nothing else (no warning of
    an import, no traceback) reaches stderr."""
    done = gep_fed("simulate", "--task", "folder_task:BatchNormDigits", "--run-dir", str(tmp_path))
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "batchnorm_to_groupnorm" in done.stderr


def crashed_after_round_one(tmp_path) -> tuple[FederationConfig, dict[str, str]]:
    """A two-round run over two hospitals' folders that crashed after round 1 was committed
    (the machine went down): its settings and the folders, to resume it."""
    folders = write_site_folders(tmp_path, {"hospital-a": 40, "hospital-b": 40})
    fed = tiny(tmp_path, rounds=2, mode="client")

    def crash(record: dict) -> None:
        raise RuntimeError("the machine went down")

    with pytest.raises(RuntimeError, match="went down"):
        simulate(fed, progress=False, site_data=folders, engine="in-process", on_round=crash)
    return fed, folders


def crashed_in(tmp_path, monkeypatch, owner, method: str) -> tuple[FederationConfig, dict]:
    """A two-round run over two hospitals' folders whose first call of ``owner.method``
    crashed (the machine went down): its settings and the folders, to resume it."""
    folders = write_site_folders(tmp_path, {"hospital-a": 40, "hospital-b": 40})
    fed = tiny(tmp_path, rounds=2, mode="client")

    def crash(self, *args):
        raise RuntimeError("the machine went down")

    with monkeypatch.context() as patched:
        patched.setattr(owner, method, crash)
        with pytest.raises(RuntimeError, match="went down"):
            simulate(fed, progress=False, site_data=folders, engine="in-process")
    return fed, folders


@pytest.mark.slow
def test_a_run_that_crashes_after_its_first_round_keeps_the_record_of_its_sites(tmp_path):
    """sites.json was written only once the simulation returned: a crash after round 1 was
    committed left a resumable run with no record, and a rerun on other data was accepted."""
    from gep_fed.validation import ConfigError

    fed, folders = crashed_after_round_one(tmp_path)
    assert (tmp_path / "runs" / "r" / "checkpoint.pt").exists()
    assert json.loads((tmp_path / "runs" / "r" / "sites.json").read_text())
    other = write_site_folders(tmp_path / "other", {"hospital-b": 40})
    with pytest.raises(ConfigError, match=r"was trained on the sites' own data"):
        simulate(fed, progress=False, site_data={**folders, "hospital-b": other["hospital-b"]},
                 engine="in-process")  # fmt: skip


def test_a_run_that_crashes_inside_its_first_commit_keeps_the_record_of_its_sites(
    tmp_path, monkeypatch
):
    """The record was written with round 1's metrics row, after its checkpoint and ledger: a
    crash in between left a resumable run without it, and a renamed site then trained on
    under a fresh ledger. The record is now written before anything can train."""
    from gep_fed.federation.rundir import RunDirectory
    from gep_fed.validation import ConfigError

    fed, folders = crashed_in(tmp_path, monkeypatch, RunDirectory, "append_metrics")
    assert (tmp_path / "runs" / "r" / "checkpoint.pt").exists()
    renamed = {"hospital-a": folders["hospital-a"], "hospital-c": folders["hospital-b"]}
    with pytest.raises(ConfigError, match=r"was trained on the sites' own data"):
        simulate(fed, progress=False, site_data=renamed, engine="in-process")
    (tmp_path / "runs" / "r" / "sites.json").unlink()  # as an older version could leave it
    with pytest.raises(ConfigError, match=r"has trained \(it holds a checkpoint\) but has no"):
        simulate(fed, progress=False, site_data=renamed, engine="in-process")


def test_a_resumed_run_whose_site_ledger_was_deleted_is_refused_naming_it(tmp_path):
    """A simulated site creates its ledger where it finds none: deleted after round 1, it
    started from zero on resume though its data had spent budget."""
    import shutil

    from gep_fed.validation import ConfigError

    fed, folders = crashed_after_round_one(tmp_path)
    shutil.rmtree(tmp_path / "runs" / "r" / "sites" / "hospital-b")
    missing = r"recorded releases, but site ledger\(s\) .*hospital-b/ledger.json are missing"
    with pytest.raises(ConfigError, match=missing):
        simulate(fed, progress=False, site_data=folders, engine="in-process")


def test_a_renamed_site_is_refused_after_a_release_no_checkpoint_holds(tmp_path, monkeypatch):
    """A client site records its release before it replies: a round that never reached a
    checkpoint (too few sites, or a crash before the commit) still spent the sites' budget,
    and a rerun that renamed a site gave its data a fresh ledger."""
    from gep_fed.federation.server import FederationServer
    from gep_fed.validation import ConfigError

    fed, folders = crashed_in(tmp_path, monkeypatch, FederationServer, "_commit")
    assert not (tmp_path / "runs" / "r" / "checkpoint.pt").exists()
    renamed = {"hospital-a": folders["hospital-a"], "hospital-c": folders["hospital-b"]}
    with pytest.raises(ConfigError, match=r"was trained on the sites' own data"):
        simulate(fed, progress=False, site_data=renamed, engine="in-process")


def test_a_torn_line_in_a_sites_rounds_is_kept_apart_and_the_resumed_run_finishes(tmp_path):
    """The next row was glued to a torn one, and every later run of the directory then ended
    in an error naming no file, with no report."""
    from gep_fed.federation.rundir import read_site_rounds

    fed, folders = crashed_after_round_one(tmp_path)
    rounds = tmp_path / "runs" / "r" / "sites" / "hospital-a" / "rounds.jsonl"
    with open(rounds, "a") as fh:
        fh.write('{"round": 2, "node": 1, "outco')  # a crash while the row was written
    result = simulate(fed, progress=False, site_data=folders, engine="in-process")
    assert [r["round"] for r in result.metrics if r["applied"]] == [1, 2]
    lines = rounds.read_text().splitlines()
    assert '{"round": 2, "node": 1, "outco' in lines  # kept, on a line of its own
    assert [r["round"] for r in read_site_rounds(tmp_path / "runs" / "r")["hospital-a"]] == [1, 2]


def test_a_run_that_fails_before_training_leaves_no_run_directory(tmp_path):
    folders = write_site_folders(tmp_path, {"hospital-a": 40, "hospital-b": 40})
    # refused by the server, once the run has started: delta not below 1/N for 80 examples
    fed = tiny(tmp_path, rounds=2, mode="client", delta=0.05)
    with pytest.raises(Exception, match="not below 1/N"):
        simulate(fed, progress=False, site_data=folders, engine="in-process")
    assert not (tmp_path / "runs" / "r").exists()


def test_a_run_resumed_with_other_sites_or_data_is_refused_and_its_record_kept(tmp_path):
    """A renamed site would train on under a fresh ledger, though its data had spent
    budget; another folder would train on other data; either would overwrite the record of
    which data trained the earlier rounds."""
    from gep_fed.validation import ConfigError

    folders = write_site_folders(tmp_path, {"hospital-a": 40, "hospital-b": 40})
    fed = tiny(tmp_path, rounds=1, mode="client")
    simulate(fed, progress=False, site_data=folders, engine="in-process")
    record = (tmp_path / "runs" / "r" / "sites.json").read_text()
    other = write_site_folders(tmp_path / "other", {"hospital-b": 40})
    changes = [
        {"hospital-a": folders["hospital-a"], "renamed": folders["hospital-b"]},
        {**folders, "hospital-b": other["hospital-b"]},
    ]
    for site_data in changes:
        with pytest.raises(ConfigError, match=r"was trained on the sites' own data \(hospital-a="):
            simulate(fed, progress=False, site_data=site_data, engine="in-process")
    with pytest.raises(ConfigError, match="IID shares of the task's pooled data: resume it"):
        simulate(fed, progress=False, engine="in-process")
    assert (tmp_path / "runs" / "r" / "sites.json").read_text() == record
    relative = {n: os.path.relpath(p) for n, p in folders.items()}
    simulate(fed, progress=False, site_data=relative, engine="in-process")  # the same data


def test_one_folder_given_to_two_sites_is_refused(tmp_path):
    """Every example would train at two sites, under two ledgers."""
    from gep_fed.validation import ConfigError

    folders = write_site_folders(tmp_path, {"hospital-a": 40})
    fed = tiny(tmp_path, rounds=1, mode="client")
    twice = {"hospital-a": folders["hospital-a"], "copy": folders["hospital-a"] + "/."}
    with pytest.raises(ConfigError, match="sites 'hospital-a' and 'copy' are given the same data"):
        simulate(fed, progress=False, site_data=twice, engine="in-process")


def test_client_sites_given_their_own_data_normalise_by_the_size_of_that_data(tmp_path):
    """N is the sites' own data (40 + 40), not the task's pooled set (1,437 digits): each site
    divides by q N / 2 = q 40. The pooled size made client updates about 18 times too small."""
    folders = write_site_folders(tmp_path, {"hospital-a": 40, "hospital-b": 40})
    simulate(tiny(tmp_path, rounds=1, mode="client"), progress=False, site_data=folders,
             engine="in-process")  # fmt: skip
    config = json.loads((tmp_path / "runs" / "r" / "config.json").read_text())
    assert config["resolved-total-examples"] == 80


def test_a_second_simulation_of_a_running_directory_changes_nothing_in_it(tmp_path):
    """The sites' record was checked and written before the run's lock was taken: a second
    simulation with other data overwrote a running one's record, then failed on the lock."""
    import subprocess
    import sys

    from gep_fed.federation.rundir import RunDirectoryError

    folders = write_site_folders(tmp_path, {"hospital-a": 40, "hospital-b": 40})
    fed = tiny(tmp_path, rounds=1, mode="client")
    simulate(fed, progress=False, site_data=folders, engine="in-process")
    record = (tmp_path / "runs" / "r" / "sites.json").read_text()
    holder = subprocess.Popen(  # the first run, still running in another process
        [sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a'); "
         "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)",
         str(tmp_path / "runs" / "r" / "run.lock")],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        other = {"hospital-a": folders["hospital-a"], "hospital-c": folders["hospital-b"]}
        with pytest.raises(RunDirectoryError, match="being run by another process"):
            simulate(fed, progress=False, site_data=other, engine="in-process")
    finally:
        holder.kill()
        holder.wait()
    assert (tmp_path / "runs" / "r" / "sites.json").read_text() == record

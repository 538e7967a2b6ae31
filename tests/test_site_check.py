"""``gep-fed site check``: a site finds its own data problems before it joins, since a run
drops a bad example silently (issue 19, point 2)."""

from pathlib import Path

import numpy as np

from gep_fed.accounting.ledger import PrivacyLedger, create_ledger_key, default_key_path
from gep_fed.cli.main import main
from gep_fed.data.datasets import load_digits
from gep_fed.federation.site_check import check_site


def site(tmp_path, labels=None, ledger=True) -> dict:
    data = load_digits().subset(np.arange(200))
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "data.npz"
    np.savez(path, images=data.images, labels=data.labels if labels is None else labels)
    ledger_path = tmp_path / "ledger.json"
    if ledger:
        key = create_ledger_key(default_key_path(ledger_path))
        PrivacyLedger.open(ledger_path, 1e-5, None, "h1", key=key, create=True)
    return {
        "site-id": "h1",
        "task": "digits",
        "data-path": str(path),
        "ledger-path": str(ledger_path),
        "epsilon-budget": 8.0,
        "delta": 1e-5,
    }


def node_config_string(config: dict) -> str:
    return " ".join(f'{k}="{v}"' if isinstance(v, str) else f"{k}={v}" for k, v in config.items())


def test_a_ready_site_passes_its_check(tmp_path, capsys):
    result = check_site(site(tmp_path))
    assert result.ok and result.examples == 200 and not result.problems
    assert main(["site", "check", "--node-config", node_config_string(site(tmp_path / "b"))]) == 0
    assert "ready to join" in capsys.readouterr().out


def test_the_check_names_each_example_a_run_would_drop(tmp_path, capsys):
    labels = load_digits().labels[:200].copy()
    labels[[3, 50]] = [10, 12]
    config = site(tmp_path, labels)
    result = check_site(config)
    assert [i for i, _ in result.problems] == [3, 50]
    assert "does not suit a multiclass model of 10 output(s)" in result.problems[0][1]
    assert main(["site", "check", "--node-config", node_config_string(config)]) == 1
    out = capsys.readouterr().out
    assert "example 3: target 10" in out and "NOT ready to join" in out


def test_the_check_reports_a_missing_task_ledger_or_data_file(tmp_path):
    config = site(tmp_path)
    assert "needs 'task'" in check_site({k: v for k, v in config.items() if k != "task"}).errors[0]
    missing = check_site({**config, "data-path": str(tmp_path / "none.npz")})
    assert not missing.ok and "none.npz" in missing.errors[0]
    unledgered = site(tmp_path / "c", ledger=False)
    assert "key" in check_site(unledgered).errors[0]
    assert check_site({**unledgered, "new-ledger": True}).ok


def test_the_check_finds_a_task_named_by_import_path_in_the_app_folder(tmp_path, monkeypatch):
    """As the ClientApp loads the task from the app bundle's folder, so does the check."""
    app = tmp_path / "app"
    (app / "hospital_tasks").mkdir(parents=True)
    (app / "hospital_tasks" / "__init__.py").write_text(
        "from gep_fed.data.builtin_tasks import DigitsTask as Digits\n"
    )
    config = {**site(tmp_path / "s"), "task": "hospital_tasks:Digits"}
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    args = ["site", "check", "--node-config", node_config_string(config)]
    assert main(args) == 1  # not importable from here
    assert main([*args, "--app-dir", str(app)]) == 0


def test_the_check_says_which_declared_classes_a_site_lacks_and_passes_it(tmp_path):
    from folder_task import write_site_folders

    folders = write_site_folders(tmp_path, {"h1": 40}, lacking={"h1": [3, 7]})
    config = {**site(tmp_path / "s"), "task": "folder_task:FolderDigits"}
    config["data-path"] = folders["h1"]
    result = check_site(config)
    assert result.ok and result.missing_classes == ("3", "7")
    assert any("no example of class(es) 3, 7" in line for line in result.lines())


def test_the_check_lists_the_classes_a_site_inferred_and_refuses_others_than_the_federations(
    tmp_path, capsys
):
    """Issue 51: a site whose task declares no class list numbers its own folders; the check
    shows them (to compare with the other hospitals) and, given ``--classes``, compares."""
    from folder_task import write_site_folders

    folders = write_site_folders(tmp_path, {"h1": 40}, lacking={"h1": [0]})
    config = {**site(tmp_path / "s"), "task": "folder_task:InferredFolderDigits"}
    config["data-path"] = folders["h1"]
    result = check_site(config)
    assert result.ok and result.classes == tuple("123456789") and not result.classes_declared
    (shown,) = [line for line in result.lines() if "none declared" in line]
    assert "1, 2, 3, 4, 5, 6, 7, 8, 9" in shown and 'classes=["1", "2", "3"' in shown
    federation = [str(c) for c in range(10)]
    refused = check_site(config, expected_classes=federation)
    assert not refused.ok
    assert "h1: has folders 1, 2, 3, 4, 5, 6, 7, 8, 9; lacks 0" in refused.errors[0]
    args = ["site", "check", "--node-config", node_config_string(config)]
    assert main([*args, "--classes", ",".join(federation)]) == 1
    out = capsys.readouterr().out
    assert 'classes=["0", "1", "2"' in out and "NOT ready to join" in out


def test_the_check_reports_a_folder_matching_no_declared_class_with_its_image_count(tmp_path):
    from folder_task import write_site_folders

    folders = write_site_folders(tmp_path, {"h1": 40})
    misspelt = Path(folders["h1"]) / "3"
    count = len(list(misspelt.glob("*.png")))
    misspelt.rename(misspelt.with_name("three"))
    config = {**site(tmp_path / "s"), "task": "folder_task:FolderDigits"}
    config["data-path"] = folders["h1"]
    result = check_site(config)
    assert not result.ok and f"folder 'three' holds {count} image(s)" in result.errors[0]


def test_the_check_reads_a_distributed_sites_key_and_peers_and_names_what_is_wrong(
    tmp_path, capsys
):
    from gep_fed.federation.secure_sum import create_site_key, key_text

    config = site(tmp_path)
    public = create_site_key(tmp_path / "site.pem")
    peers = tmp_path / "peers.txt"
    peers.write_text(f"h1 {key_text(public)}\nh2 {key_text(public[::-1])}\n")
    distributed = {
        **config,
        "accept-modes": "client,distributed",
        "noise-shares": 2,
        "site-key": str(tmp_path / "site.pem"),
        "peers": str(peers),
    }
    assert check_site(distributed).ok
    missing = check_site({**distributed, "site-key": str(tmp_path / "other.pem")})
    assert missing.errors == (
        f"distributed mode: site key {tmp_path / 'other.pem'}: cannot read it "
        "(No such file or directory)",
    )
    peers.write_text("h1\n")
    assert "expected 'NAME PUBLIC-KEY'" in check_site(distributed).errors[0]

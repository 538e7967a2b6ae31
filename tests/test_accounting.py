import json
import math
from dataclasses import replace

import pytest

from gep_fed import (
    BudgetExceededError,
    ImpossibleTargetError,
    LedgerError,
    PrivacyLedger,
    calibrate_noise_multiplier,
)
from gep_fed.accounting.events import PrivacyEvent, epsilon_pld, epsilon_rdp
from gep_fed.accounting.ledger import create_ledger_key, default_key_path, read_ledger_key
from gep_fed.mechanisms.mechanism import BGEP, GEP, GP, mechanism_class

SETTINGS = [(0.01, 1.1, 1000), (0.032, 3.2, 940), (0.1, 0.8, 50)]


@pytest.mark.parametrize("q, sigma, steps", SETTINGS)
def test_rdp_epsilon_matches_opacus_within_one_percent(q, sigma, steps):
    from opacus.accountants import RDPAccountant

    opacus = RDPAccountant()
    opacus.history = [(sigma, q, steps)]
    theirs = opacus.get_epsilon(delta=1e-5)
    ours = epsilon_rdp([GP.event(sigma, q, steps)], 1e-5)
    assert ours == pytest.approx(theirs, rel=0.01)


@pytest.mark.parametrize("q, sigma, steps", SETTINGS)
def test_pld_epsilon_is_at_most_the_rdp_epsilon(q, sigma, steps):
    events = [GEP.event(sigma, q, steps)]
    assert epsilon_pld(events, 1e-5) <= epsilon_rdp(events, 1e-5)


def test_gep_costs_the_same_as_gp_at_sqrt_two_less_noise():
    gep = epsilon_rdp([GEP.event(2.0, 0.05, 100)], 1e-5)
    gp = epsilon_rdp([GP.event(2.0 / math.sqrt(2), 0.05, 100)], 1e-5)
    assert gep == pytest.approx(gp, rel=1e-12)
    assert gep > epsilon_rdp([BGEP.event(2.0, 0.05, 100)], 1e-5)


@pytest.mark.parametrize("mechanism", ["gep", "bgep", "gp"])
@pytest.mark.parametrize("target", [1.0, 2.0, 8.0])
def test_calibration_returns_the_smallest_sigma_meeting_the_target(mechanism, target):
    q, steps, delta = 0.02, 500, 1e-5
    sigma = calibrate_noise_multiplier(target, delta, q, steps, mechanism, tol=1e-4)
    assert epsilon_rdp([mechanism_class(mechanism).event(sigma, q, steps)], delta) <= target
    assert epsilon_rdp([mechanism_class(mechanism).event(sigma - 2e-3, q, steps)], delta) > target


def test_a_remembered_calibration_follows_what_a_step_releases(monkeypatch):
    """Calibrations are remembered by the release they calibrate, not by name: GEP counted as
    one release (as a broken variant counts it) gets its own, smaller sigma, and the honest
    one is the same after."""
    args = (4.0, 1e-5, 0.03, 300)
    honest = calibrate_noise_multiplier(*args, "gep")
    monkeypatch.setattr(GEP, "releases", 1)
    one_release = calibrate_noise_multiplier(*args, "gep")
    assert one_release == pytest.approx(honest / math.sqrt(2), rel=1e-3)
    monkeypatch.undo()
    assert calibrate_noise_multiplier(*args, "gep") == honest


def test_pld_epsilon_of_a_composition_is_the_same_asked_twice_or_split():
    events = [GP.event(1.1, 0.05, 60), GP.event(1.1, 0.05, 40)]
    first = epsilon_pld(events, 1e-5)
    assert epsilon_pld(events, 1e-5) == first == epsilon_pld([GP.event(1.1, 0.05, 100)], 1e-5)
    assert epsilon_pld(events[:1], 1e-5) < first


def test_impossible_target_is_an_error_not_a_silent_cap():
    with pytest.raises(ImpossibleTargetError, match="out of reach"):
        calibrate_noise_multiplier(0.01, 1e-5, 1.0, 10_000, "gp")


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"target_epsilon": -1}, "target_epsilon"),
        ({"target_epsilon": 1e9}, r"target_epsilon must be a finite number in \(0, 1000\]"),
        ({"delta": 1.5}, "delta"),
        ({"mechanism": "x"}, "mechanism"),
    ],
)
def test_calibration_names_the_bad_argument(kwargs, field):
    args = {
        "target_epsilon": 2.0,
        "delta": 1e-5,
        "sample_rate": 0.01,
        "steps": 10,
        "mechanism": "gp",
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        calibrate_noise_multiplier(**args)


def test_composition_merges_equal_events_without_changing_epsilon():
    many = [GEP.event(1.5, 0.02, 1, round=r) for r in range(50)]
    one = [GEP.event(1.5, 0.02, 50)]
    assert epsilon_rdp(many, 1e-5) == pytest.approx(epsilon_rdp(one, 1e-5), rel=1e-12)
    assert epsilon_pld(many, 1e-5) == pytest.approx(epsilon_pld(one, 1e-5), rel=1e-9)


def test_ledger_round_trips_exactly(tmp_path):
    ledger = PrivacyLedger(1e-5, budget_epsilon=80.0, owner="site-1", path=tmp_path / "l.json")
    for r in range(3):
        ledger.record(GEP.event(1.234567890123, 1 / 3, 2, party="site-1", round=r))
    ledger.record(GP.event(0.9, 0.01, 7))
    back = PrivacyLedger.load(tmp_path / "l.json")
    assert back.events == ledger.events
    assert (back.delta, back.budget_epsilon, back.owner) == (1e-5, 80.0, "site-1")
    assert back.epsilon() == ledger.epsilon()
    assert back.to_json() == ledger.to_json()


def test_a_truncated_ledger_is_refused_and_left_untouched(tmp_path):
    path = tmp_path / "l.json"
    ledger = PrivacyLedger(1e-5, path=path)
    ledger.record(GEP.event(1.0, 0.1, 3))
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    with pytest.raises(LedgerError, match="truncated"):
        PrivacyLedger.load(path)
    with pytest.raises(LedgerError):
        PrivacyLedger.open(path, 1e-5)
    assert path.read_text() == text[: len(text) // 2]
    path.write_bytes(b"\xff\xfe binary")
    with pytest.raises(LedgerError, match=f"ledger {path} is not text .* left untouched"):
        PrivacyLedger.load(path)
    assert path.read_bytes() == b"\xff\xfe binary"


def test_an_edited_ledger_fails_its_checksum(tmp_path):
    path = tmp_path / "l.json"
    PrivacyLedger(1e-5, path=path).record(GEP.event(1.0, 0.1, 30))
    path.write_text(path.read_text().replace('"steps": 30', '"steps": 3'))
    with pytest.raises(LedgerError, match="checksum"):
        PrivacyLedger.load(path)


def test_ledger_refuses_a_release_beyond_its_budget_and_keeps_what_it_had(tmp_path):
    path = tmp_path / "l.json"
    ledger = PrivacyLedger(1e-5, budget_epsilon=3.0, owner="site-2", path=path)
    event = GEP.event(2.0, 0.05, 10)
    ledger.record(event)
    spent = ledger.epsilon()
    with pytest.raises(BudgetExceededError, match=r"site-2.*budget 3.*spent so far"):
        for _ in range(100):
            ledger.record(event)
    assert ledger.epsilon() <= 3.0
    assert PrivacyLedger.load(path).events == ledger.events
    assert ledger.epsilon() >= spent


def test_open_continues_an_existing_ledger_and_refuses_a_different_delta(tmp_path):
    path = tmp_path / "l.json"
    first = PrivacyLedger.open(path, 1e-5, 8.0, "s", create=True)
    first.record(GP.event(1.0, 0.1, 5))
    again = PrivacyLedger.open(path, 1e-5, 8.0, "s")
    assert again.steps == 5
    with pytest.raises(LedgerError, match="delta"):
        PrivacyLedger.open(path, 1e-6, 8.0, "s")


def test_two_writers_of_one_ledger_cannot_drop_each_others_releases(tmp_path):
    path = tmp_path / "site.json"
    PrivacyLedger(1e-5, path=path).save()
    first, second = PrivacyLedger.load(path), PrivacyLedger.load(path)
    first.record(GEP.event(1.0, 0.1, 1))
    with pytest.raises(LedgerError, match="changed by another process"):
        second.record(GEP.event(1.0, 0.1, 1))
    assert PrivacyLedger.load(path).steps == 1


def test_an_event_without_the_mechanisms_accounting_sigma_is_refused():
    with pytest.raises(ValueError, match="event"):
        PrivacyEvent.gaussian("gep", 1.0, 0.1, 3)
    with pytest.raises(ValueError, match="release"):
        PrivacyEvent("gep", 1.0, 0.1, 3)  # a number is no dp-accounting event
    # GEP's two releases are accounted at sigma / sqrt(2), from the mechanism class itself
    assert GEP.event(2.0, 0.1).accounting_noise_multiplier == pytest.approx(2.0 / math.sqrt(2))
    assert GP.event(2.0, 0.1).accounting_noise_multiplier == 2.0


def test_a_ledger_record_keeps_its_flat_format_around_the_dp_accounting_event():
    """The ledger file's record is the one every ledger so far holds: an old record reads
    into the event it stands for (its adjacency as dp-accounting's NeighboringRelation) and
    writes back the same."""
    import dp_accounting

    old = {
        "mechanism": "gep",
        "noise_multiplier": 2.0,
        "sample_rate": 0.05,
        "steps": 3,
        "accounting_noise_multiplier": 2.0 / math.sqrt(2),
        "party": "s1",
        "round": 4,
        "placement": "distributed",
        "adjacency": "add-remove",
        "discrete_l2_scale": 0.75,
        "discrete_tau": 1e-9,
        "dimension": 1024,
        "noise_shares": 3,
        "max_colluding_sites": 1,
    }
    event = PrivacyEvent.from_dict(old)
    assert event.adjacency is dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    assert isinstance(event.release, dp_accounting.PoissonSampledDpEvent)
    assert event.to_dict() == old
    assert json.dumps(event.to_dict()) == json.dumps(old)  # same keys, same order
    langevin = {"mechanism": "langevin", "noise_multiplier": 3.0, "sample_rate": 1.0}
    single = PrivacyEvent.from_dict({**langevin, "accounting_noise_multiplier": 3.0})
    assert single.release == dp_accounting.GaussianDpEvent(3.0) and single.steps == 1
    replaced = PrivacyEvent.from_dict({**single.to_dict(), "adjacency": "replace-one"})
    assert replaced.adjacency is dp_accounting.NeighboringRelation.REPLACE_ONE
    assert replaced.to_dict()["adjacency"] == "replace-one"
    with pytest.raises(ValueError, match="unknown privacy event fields"):
        PrivacyEvent.from_dict({**old, "colour": "red"})
    with pytest.raises(ValueError, match="distributed events only"):
        PrivacyEvent.from_dict({**old, "placement": "local"})
    with pytest.raises(ValueError, match="adjacency must be one of"):
        PrivacyEvent.from_dict({**old, "adjacency": "swap-two"})


def test_events_of_different_adjacency_do_not_compose():
    replace_one = PrivacyEvent.gaussian("langevin", 3.0, 1.0, 1, 3.0, adjacency="replace-one")
    with pytest.raises(ValueError, match="adjacency"):
        epsilon_rdp([GP.event(1.0, 0.1), replace_one], 1e-5)
    with pytest.raises(ValueError, match="subsampling"):
        PrivacyEvent.gaussian("langevin", 3.0, 0.5, 1, 3.0, adjacency="replace-one")


def test_a_missing_ledger_is_never_silently_restarted(tmp_path):
    path = tmp_path / "site.json"
    with pytest.raises(LedgerError, match="does not exist"):
        PrivacyLedger.open(path, 1e-5)
    assert not path.exists()
    PrivacyLedger.open(path, 1e-5, create=True).record(GEP.event(1.0, 0.1, 3))
    assert PrivacyLedger.open(path, 1e-5).steps == 3


def test_a_keyed_ledger_edited_without_its_key_is_refused_and_left_untouched(tmp_path):
    path = tmp_path / "site.json"
    key = create_ledger_key(default_key_path(path))
    assert (default_key_path(path).stat().st_mode & 0o777) == 0o600
    ledger = PrivacyLedger.open(path, 1e-5, owner="site-0", key=key, create=True)
    ledger.record(GEP.event(1.0, 0.1, 40))
    assert PrivacyLedger.load(path, key).steps == 40
    # an attacker without the key edits the history and recomputes the plain checksum
    import hashlib
    import json

    body = json.loads(path.read_text())
    body.pop("hmac-sha256")
    body["events"][0]["steps"] = 4
    body["sha256"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    forged = json.dumps(body)
    path.write_text(forged)
    with pytest.raises(LedgerError, match="no HMAC"):
        PrivacyLedger.load(path, key)
    body.pop("sha256")
    body["hmac-sha256"] = "0" * 64  # or guesses a tag
    path.write_text(json.dumps(body))
    with pytest.raises(LedgerError, match="HMAC check"):
        PrivacyLedger.open(path, 1e-5, key=key)
    assert path.read_text() == json.dumps(body)  # left untouched
    # without a key the keyed ledger cannot be read as if it were unprotected
    path.write_text(ledger.to_json())  # the honest site's copy
    with pytest.raises(LedgerError, match="site key"):
        PrivacyLedger.load(path)


def test_a_ledger_key_must_be_private_and_is_never_replaced(tmp_path):
    key_path = tmp_path / "k.key"
    create_ledger_key(key_path)
    with pytest.raises(LedgerError, match="already exists"):
        create_ledger_key(key_path)
    key_path.chmod(0o644)
    with pytest.raises(LedgerError, match="chmod 600"):
        read_ledger_key(key_path)
    with pytest.raises(LedgerError, match="missing"):
        read_ledger_key(tmp_path / "none.key")


# -- issue 19, points 5 and 7: rollback and durability ---------------------------------------


def keyed_ledger(tmp_path, steps: int = 0) -> PrivacyLedger:
    path = tmp_path / "site.json"
    key = create_ledger_key(default_key_path(path))
    ledger = PrivacyLedger.open(path, 1e-5, owner="site-0", key=key, create=True)
    if steps:
        ledger.record(GEP.event(1.0, 0.1, steps))
    return ledger


def test_a_restored_older_ledger_is_refused_naming_both_figures_and_left_untouched(tmp_path):
    """Point 5: yesterday's copy, HMAC intact, copied back over today's ledger."""
    ledger = keyed_ledger(tmp_path, steps=10)
    backup = ledger.path.read_text()
    ledger.record(GEP.event(1.0, 0.1, 100))
    today = PrivacyLedger.load_keyed(ledger.path)
    assert today.steps == 110
    ledger.path.write_text(backup)
    with pytest.raises(LedgerError) as err:
        PrivacyLedger.load_keyed(ledger.path)
    message = str(err.value)
    assert "10 step(s)" in message and "110 step(s)" in message
    assert f"{today.epsilon():.4f}" in message
    assert ledger.path.read_text() == backup  # left as found
    with pytest.raises(LedgerError):
        PrivacyLedger.open(ledger.path, 1e-5, key=ledger.key)


def test_a_deleted_or_forged_high_water_mark_refuses_the_ledger(tmp_path):
    ledger = keyed_ledger(tmp_path, steps=3)
    mark = ledger.mark_path
    assert mark == tmp_path / "site.json.key.mark"
    text = mark.read_text()
    mark.write_text(text.replace('"steps": 3', '"steps": 0'))
    with pytest.raises(LedgerError, match="HMAC"):
        PrivacyLedger.load_keyed(ledger.path)
    mark.unlink()
    with pytest.raises(LedgerError, match=r"mark .* is missing"):
        PrivacyLedger.load_keyed(ledger.path)
    # nor can a fresh ledger be created over the history the mark records
    mark.write_text(text)
    ledger.path.unlink()
    with pytest.raises(LedgerError, match=r"high-water mark .* exists"):
        PrivacyLedger.open(ledger.path, 1e-5, key=ledger.key, create=True)


def test_the_high_water_mark_only_rises_and_follows_every_save(tmp_path):
    ledger = keyed_ledger(tmp_path)
    for steps in (1, 2, 5):
        ledger.record(GP.event(1.0, 0.1, steps))
        reopened = PrivacyLedger.load_keyed(ledger.path)
        assert reopened.steps == ledger.steps


def test_the_ledger_cli_marks_a_ledger_made_before_marks_once(tmp_path, capsys):
    from gep_fed.cli.main import main

    ledger = keyed_ledger(tmp_path, steps=4)
    ledger.mark_path.unlink()
    assert main(["ledger", "show", str(ledger.path)]) == 2
    assert main(["ledger", "mark", str(ledger.path)]) == 0
    assert "4 step(s)" in capsys.readouterr().out
    assert main(["ledger", "show", str(ledger.path)]) == 0
    assert main(["ledger", "mark", str(ledger.path)]) == 2  # a mark is never re-made


def test_ledger_show_says_central_steps_carry_no_guarantee_against_the_coordinator(
    tmp_path, capsys
):
    """Central mode's steps are counted at the noise the coordinator declared; what the site
    sent it was unnoised, so the figure says nothing of the coordinator itself."""
    from gep_fed.cli.main import main

    ledger = keyed_ledger(tmp_path)
    ledger.record(GP.event(50.0, 0.1, 100))  # client-side steps: no such line
    assert main(["ledger", "show", str(ledger.path)]) == 0
    assert "coordinator" not in capsys.readouterr().out
    ledger.record(replace(GP.event(50.0, 0.1, 100), placement="trusted-server"))
    assert main(["ledger", "show", str(ledger.path)]) == 0
    shown = capsys.readouterr().out
    assert "100 step(s) sent unnoised to a trusted coordinator (central mode)" in shown
    assert "against the coordinator itself they carry no guarantee" in shown


@pytest.mark.parametrize("delta", ["1", "-1", "nan"])
def test_a_refused_ledger_init_leaves_no_key_so_the_corrected_one_succeeds(tmp_path, capsys, delta):
    from gep_fed.cli.main import main

    path = tmp_path / "b.json"
    assert main(["ledger", "init", str(path), "--owner", "h1", "--delta", delta]) == 2
    assert "delta must be a finite number in (0, 0.1]" in capsys.readouterr().err
    assert sorted(tmp_path.iterdir()) == []
    assert main(["ledger", "init", str(path), "--owner", "h1", "--delta", "1e-5"]) == 0


def test_a_ledger_save_fsyncs_its_directory_after_the_rename(tmp_path, monkeypatch):
    """Point 7: the rename lives in the directory; without fsyncing it, a power loss after
    the release can bring back the old file, and the ledger under-counts."""
    import os
    import stat

    calls = []
    real_replace, real_fsync = os.replace, os.fsync

    def replace(src, dst):
        calls.append(("replace", str(dst)))
        return real_replace(src, dst)

    def fsync(fd):
        kind = "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"
        calls.append(("fsync", kind))
        return real_fsync(fd)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "fsync", fsync)
    ledger = PrivacyLedger(1e-5, path=tmp_path / "l.json")
    ledger.record(GP.event(1.0, 0.1, 1))
    renamed = calls.index(("replace", str(tmp_path / "l.json")))
    assert ("fsync", "dir") in calls[renamed + 1 :]


def test_our_rdp_orders_are_dp_accountings_default_orders():
    # written out so that importing gep_fed does not import dp-accounting (a second)
    from dp_accounting.rdp.rdp_privacy_accountant import DEFAULT_RDP_ORDERS

    from gep_fed.accounting.events import RDP_ORDERS

    assert list(RDP_ORDERS) == list(DEFAULT_RDP_ORDERS)

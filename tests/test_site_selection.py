"""Issue 53: a private selection with a random number of trials, recorded by each site itself
(``gep_fed.federation.site_selection``, as under ``flwr run``): every trial's releases in the
site's own ledger, against its own budget (the server and the other sites see every trial's
rounds), and each trial in a ledger of its own too, under the selection's bound of one trial
at every RDP order (which the published choice's figure assumes)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from test_wire import round_config

from gep_fed.accounting.events import PrivacyEvent, Selection, epsilon_rdp
from gep_fed.accounting.ledger import (
    BudgetExceededError,
    PrivacyLedger,
    create_ledger_key,
    default_key_path,
)
from gep_fed.federation import wire
from gep_fed.federation.modes import MODE_NAMES
from gep_fed.federation.policy import SiteConfig, SitePolicy
from gep_fed.federation.site_score import score_event
from gep_fed.federation.site_selection import selection_folder, trial_ledger
from gep_fed.federation.wire import RoundRefused, SelectionTerms

SEARCH = "0123456789abcdef" * 2


def one_step(sigma: float = 2.0) -> PrivacyEvent:
    """One central-mode GEP step at q = 0.2 (sensitivity sqrt(2): accounted at sigma/sqrt 2)."""
    return PrivacyEvent.gaussian(
        "gep", sigma, 0.2, 1, sigma / math.sqrt(2), party="site-0", placement="trusted-server"
    )


def selection(steps: int = 4, score: float | None = None) -> PrivacyEvent:
    """A geometric number of trials of mean 2, each at most ``steps`` such steps (and one
    score of that accounting noise multiplier)."""
    return replace(one_step(), steps=steps, party="", selection=Selection(2.0, 1.0, score))


def site_ledger(tmp_path, budget: float = 8.0) -> PrivacyLedger:
    path = tmp_path / "site" / "ledger.json"
    key = create_ledger_key(default_key_path(path))
    return PrivacyLedger.open(path, 1e-5, budget, "site-0", key=key, create=True)


def test_a_site_records_every_trial_in_its_own_ledger_and_each_in_a_ledger_of_its_own(tmp_path):
    """The other sites are sent every trial's global models, so the selection's bound (which
    covers the published choice alone) is no guarantee against them: the site's own ledger
    composes every release of every trial, as in any run."""
    main, event = site_ledger(tmp_path), selection()
    first = trial_ledger(main, SelectionTerms(SEARCH, 1, event))
    first.record(one_step())
    second = trial_ledger(PrivacyLedger.load_keyed(main.path), SelectionTerms(SEARCH, 2, event))
    second.record(one_step(), one_step())
    reloaded = PrivacyLedger.load_keyed(main.path)
    assert reloaded.events == (one_step(),) * 3  # no selection event: the rounds themselves
    assert reloaded.epsilon() == pytest.approx(epsilon_rdp([one_step()] * 3, 1e-5))
    assert first.path != second.path and first.events == (one_step(),)
    assert second.events == (one_step(),) * 2
    assert first.path.parent == selection_folder(main.path, SEARCH)
    assert first.key == main.key  # under the site's own key, each with a mark of its own


def test_a_trial_that_never_releases_spends_nothing_of_the_sites_budget(tmp_path):
    """A round refused after its trial's ledger was opened (a malformed model, a plan above
    the trial's bound) records nothing."""
    main = site_ledger(tmp_path)
    trial = trial_ledger(main, SelectionTerms(SEARCH, 1, selection(steps=4)))
    with pytest.raises(BudgetExceededError, match="above the curve"):
        trial.check_budget([one_step()] * 5)  # the site's budget check of a 5-round plan
    assert PrivacyLedger.load_keyed(main.path).events == () and main.events == ()
    trial.record(one_step())
    assert len(PrivacyLedger.load_keyed(main.path).events) == 1


def test_a_site_refuses_a_poisson_number_of_trials(tmp_path):
    """Theorem 6 bounds a Poisson K where K = 0 is possible and unpublished; the sites only
    ever see searches with at least one trial."""
    event = replace(selection(), selection=Selection(1.0, math.inf))
    with pytest.raises(RoundRefused, match="malformed round"):
        trial_ledger(site_ledger(tmp_path), SelectionTerms(SEARCH, 1, event))


def test_a_site_refuses_a_trial_its_own_budget_cannot_hold_and_records_nothing(tmp_path):
    """Each trial composes in the site's ledger: with the selection's bound at 4 steps a
    trial, the site's budget for 6 such steps lets the first trial through and refuses the
    second's third step, with its ledger intact."""
    budget = epsilon_rdp([one_step()] * 6, 1e-5) * 1.0001
    main = site_ledger(tmp_path, budget=budget)
    trial_ledger(main, SelectionTerms(SEARCH, 1, selection())).record(*[one_step()] * 4)
    second = trial_ledger(main, SelectionTerms(SEARCH, 2, selection()))
    second.record(one_step(), one_step())
    with pytest.raises(BudgetExceededError, match="would bring epsilon"):
        second.check_budget([one_step()])  # the site's check of the rest of the trial's plan
    with pytest.raises(BudgetExceededError, match="would bring epsilon"):
        second.record(one_step())
    assert PrivacyLedger.load_keyed(main.path).steps == 6 and second.steps == 2


def test_a_trial_releases_up_to_the_selections_bound_of_one_trial_and_no_more(tmp_path):
    main = site_ledger(tmp_path)
    trial = trial_ledger(main, SelectionTerms(SEARCH, 1, selection(steps=4)))
    trial.record(one_step(), one_step(), one_step(), one_step())  # the bound: 4 such steps
    with pytest.raises(BudgetExceededError, match="above the curve"):
        trial.record(one_step())
    assert PrivacyLedger.load(trial.path, main.key, trial.mark_path).steps == 4
    # fewer steps than the bound, but one of less noise than the bound's: above its curve
    other = trial_ledger(main, SelectionTerms(SEARCH, 2, selection(steps=4)))
    with pytest.raises(BudgetExceededError, match="above the curve"):
        other.record(one_step(0.9))
    assert other.events == ()


def test_a_trials_score_fits_its_bound_once(tmp_path):
    score = score_event(2.0, "site-0")  # the sites' noised counts, as their ledgers hold them
    event = selection(steps=2, score=score.accounting_noise_multiplier)
    trial = trial_ledger(site_ledger(tmp_path), SelectionTerms(SEARCH, 1, event))
    trial.record(one_step(), one_step(), score)
    with pytest.raises(BudgetExceededError, match="above the curve"):
        trial.record(score)


@pytest.mark.parametrize(
    ("mode", "refused"), [("central", False), ("client", True), ("distributed", True)]
)
def test_a_site_takes_part_in_a_selection_in_central_mode_only(mode, refused):
    """The selection's bound covers what a trusted server publishes; in client and
    distributed mode the server sees every trial's releases, so a site refuses a selection
    there even where it accepts the mode."""
    rc = replace(round_config(), mode=mode, site_examples=300 if mode == "client" else 0)
    rc = replace(rc, selection=SelectionTerms(SEARCH, 1, selection()).to_json())
    assert wire.RoundConfig.from_record(rc.to_record()) == rc
    policy = SitePolicy(
        epsilon_budget=8.0,
        delta=1e-5,
        accepted_modes=(*MODE_NAMES,),
        noise_shares=2,
        max_selection_mean=2.0,
    )
    if refused:
        with pytest.raises(RoundRefused, match="mode not allowed"):
            policy.admit(rc, None)
    else:
        policy.admit(rc, None)
        policy.admit(replace(rc, mode="client", selection=""), None)  # client, no selection


@pytest.mark.parametrize("max_mean", [None, 0.0, 1.5])
def test_a_site_takes_part_only_in_selections_it_opted_in_to(max_mean):
    """The selection's bound trusts the server to draw the number of trials from the declared
    law (here of mean 2): a site opts in with its own max-selection-mean (default 0: none)."""
    rc = replace(round_config(), mode="central")
    rc = replace(rc, selection=SelectionTerms(SEARCH, 1, selection()).to_json())
    node = {"partition-id": 0, "num-partitions": 1, "accept-modes": "client,central"}
    if max_mean is not None:
        node["max-selection-mean"] = max_mean
    policy = SiteConfig.from_node_config(node, None, "/tmp/run").policy
    with pytest.raises(RoundRefused, match="mode not allowed"):
        policy.admit(rc, None)
    policy.admit(replace(rc, selection=""), None)  # the same round, outside a selection


def test_ledger_show_counts_the_trials_and_names_where_their_own_ledgers_are(tmp_path, capsys):
    from gep_fed.cli.main import main

    main_ledger = site_ledger(tmp_path)
    for trial in (1, 2):
        trial_ledger(main_ledger, SelectionTerms(SEARCH, trial, selection())).record(one_step())
    assert main(["ledger", "show", str(main_ledger.path)]) == 0
    shown = capsys.readouterr().out
    assert "2 accounted step(s)" in shown  # each trial's release, in the site's own ledger
    folder = main_ledger.path.parent / "ledger.json.selections"
    assert f"its selections' trials: 2 ledger(s) in {folder}" in shown

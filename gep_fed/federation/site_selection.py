"""A site's side of a private selection with a random number of trials (central mode).

Papernot & Steinke's bound (ICLR 2022) covers what the trusted server publishes: the best of
K trials, K drawn secretly from the declared law. It holds only against those who see the
published choice alone. The coordinator and the other sites see every trial's rounds (each
site is sent each trial's global models), so a site that opted in (``max-selection-mean``)
records every trial's releases in its own ledger, as in any run, against its own budget: a
trial it cannot hold is refused, and its guarantee against everyone is that ledger's. It also
keeps each trial's releases in a ledger of the trial's own, where every release must stay
under the selection's bound of one trial at every RDP order (a trial that would release more
is refused), so that the published choice's figure holds too. In central mode the server sees
every trial's clipped sums: the figures hold only where the site trusts it, as central mode's
noise already does (``Mode.refusal`` refuses a selection in any other mode).

On disk, beside the site's ledger ``L``: ``L.selections/<search>/trial-<n>.json`` (the trial's
ledger, under the site's key, with its own high-water mark).
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from gep_fed.accounting.events import PrivacyEvent, rdp_accountant
from gep_fed.accounting.ledger import PrivacyLedger, selections_folder
from gep_fed.federation.wire import RoundRefused, SelectionTerms


def selection_folder(ledger_path: Path, search: str) -> Path:
    """Where a site keeps a search's trials' ledgers."""
    return selections_folder(ledger_path) / search


def trial_run_curve(event: PrivacyEvent):
    """The RDP curve of one trial as the selection ``event`` accounts it: its bound of the
    trial's rounds and, where the sites score each trial, one score."""
    run = event.selection.run_events(replace(event, selection=None).dp_event())
    return rdp_accountant(event.adjacency).compose(run).rdp


def trial_ledger(main: PrivacyLedger, terms: SelectionTerms) -> PrivacyLedger:
    """The ledger that holds this round's trial, bounded by one trial's curve, which records
    every release in ``main`` first (under ``main``'s budget).

    Raises:
        RoundRefused: "malformed round" where the number of trials is Poisson.
    """
    if main.path is None:
        raise ValueError("a private selection needs the site's ledger on disk")
    if math.isinf(terms.event.selection.shape):
        # Theorem 6 bounds a Poisson K with K = 0 possible and unpublished; a site is sent
        # only searches of K >= 1 trials, which that bound does not cover
        raise RoundRefused("malformed round")
    folder = selection_folder(main.path, terms.search)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"trial-{terms.trial:03d}.json"
    ledger = PrivacyLedger.open(
        path,
        main.delta,
        None,
        main.owner,
        key=main.key,
        mark_path=path.with_suffix(".mark"),
        create=True,
    )
    event = replace(terms.event, party=main.owner)
    return ledger.bound_by(trial_run_curve(event), also=main)

"""A site's side of a private selection with a random number of trials (central mode).

Papernot & Steinke's bound (ICLR 2022) covers what the trusted server publishes: the best of
K trials, K drawn secretly from the declared law. A site that opted in (``max-selection-mean``)
and receives a search's round records that bound once per search, as one event in its own
ledger and against its own budget: a site that cannot hold it refuses the first round it sees,
and a round refused for any reason spends nothing (the selection is recorded when a trial
first releases). It keeps each trial's rounds in a ledger of the trial's own, where every
release must stay under the selection's bound of one trial at every RDP order (a trial that
would release more is refused). In central mode the server sees every trial's clipped sums:
the figure holds only where the site trusts it, as central mode's noise already does
(``Mode.refusal`` refuses a selection in any other mode).

On disk, beside the site's ledger ``L``: ``L.selections/<search>/selection.json`` (the event
recorded, under the ledger's key, written after the ledger holds it: a crash in between
records it again, an over-count, never an under-count) and ``trial-<n>.json`` (the trial's
ledger, under the site's key, with its own high-water mark).
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace
from pathlib import Path

from gep_fed.accounting.events import PrivacyEvent, rdp_accountant
from gep_fed.accounting.ledger import (
    BudgetExceededError,
    PrivacyLedger,
    keyed_record,
    read_keyed_record,
    selections_folder,
)
from gep_fed.federation.wire import RoundRefused, SelectionTerms
from gep_fed.files import write_bytes_atomically

RECORDED = "selection.json"
SELECTION_DOMAIN = b"selection:"


def selection_folder(ledger_path: Path, search: str) -> Path:
    """Where a site keeps a search's record and its trials' ledgers."""
    return selections_folder(ledger_path) / search


def trial_run_curve(event: PrivacyEvent):
    """The RDP curve of one trial as the selection ``event`` accounts it: its bound of the
    trial's rounds and, where the sites score each trial, one score."""
    run = event.selection.run_events(replace(event, selection=None).dp_event())
    return rdp_accountant(event.adjacency).compose(run).rdp


def trial_ledger(main: PrivacyLedger, terms: SelectionTerms) -> PrivacyLedger:
    """The ledger that holds this round's trial, bounded by one trial's curve. The selection
    is recorded in ``main`` (once per search) when the trial first records a release, after
    the round has passed every check: a round refused for any reason spends nothing.

    Raises:
        RoundRefused: "over budget" where ``main``'s budget cannot hold the selection;
            "malformed round" where the search was recorded with another selection, or its
            number of trials is Poisson.
    """
    if main.path is None:
        raise ValueError("a private selection needs the site's ledger on disk")
    if math.isinf(terms.event.selection.shape):
        # Theorem 6 bounds a Poisson K with K = 0 possible and unpublished; a site is sent
        # only searches of K >= 1 trials, which that bound does not cover
        raise RoundRefused("malformed round")
    folder = selection_folder(main.path, terms.search)
    event = replace(terms.event, party=main.owner)
    recorded = folder / RECORDED

    body = {"search": terms.search, "event": event.to_dict()}

    def record_selection(check_only: bool) -> None:
        if recorded.exists():  # under the ledger's key: no hand-written file skips a charge
            if read_keyed_record(recorded, main.key, SELECTION_DOMAIN) != body:
                raise RoundRefused("malformed round")  # the search's terms changed under its id
            return
        try:
            if check_only:
                main.check_budget([event])
                return
            main.record(event)
        except BudgetExceededError:
            raise RoundRefused("over budget") from None
        write_bytes_atomically(recorded, keyed_record(main.key, body, SELECTION_DOMAIN))

    record_selection(check_only=True)
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
    charge = functools.partial(record_selection, check_only=False)
    return ledger.bound_by(trial_run_curve(event), before_first_record=charge)

"""A site's noised validation score (``gep_fed.federation.site_score``): held-out examples
chosen by each one's own coin, per-class counts of sensitivity sqrt(2), a Gaussian release
accounted as dp-accounting accounts it."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import dp_accounting
import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from gep_fed.accounting.events import epsilon_pld, epsilon_rdp
from gep_fed.accounting.ledger import PrivacyLedger
from gep_fed.data.builtin_tasks import DigitsTask
from gep_fed.data.metrics import evaluate
from gep_fed.data.task import CheckedExamples
from gep_fed.federation import wire
from gep_fed.federation.policy import SiteConfig, SitePolicy
from gep_fed.federation.site import Site, site_data_parts, site_dataset
from gep_fed.federation.site_score import (
    SiteScore,
    class_counts,
    held_out_mask,
    model_classes,
    new_coins_key,
    noisy_counts,
    score_event,
    score_from_counts,
    score_spread,
    split_site_data,
)
from gep_fed.federation.wire import RoundRefused
from gep_fed.mechanisms.noise import NoiseSource
from gep_fed.validation import ConfigError


def small_classifier(classes: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, classes))


def small_data(n: int = 40, classes: int = 3) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, classes, (n,)))


def checked(data, model: nn.Module, kind: str = "multiclass") -> CheckedExamples:
    return CheckedExamples.of(data, kind, model)


def test_removing_any_one_example_moves_the_counts_by_at_most_sqrt_2():
    """Brute force over every example: the release's L2 sensitivity is sqrt(2) (its class's
    count, and its right count when the model gets it right), attained, never exceeded."""
    model, data = small_classifier(), small_data()
    full = class_counts(model, checked(data, model), "multiclass", 3)
    moves = []
    for i in range(len(data)):
        rest = torch.utils.data.Subset(data, [j for j in range(len(data)) if j != i])
        rest = checked(rest, model)
        moves.append(np.linalg.norm(full - class_counts(model, rest, "multiclass", 3)))
    assert max(moves) == pytest.approx(math.sqrt(2)) and min(moves) == pytest.approx(1.0)


def test_the_score_release_is_dp_accountings_gaussian_of_multiplier_std_over_sqrt_2():
    std, delta = 3.0, 1e-5
    event = score_event(std, party="site-0")
    assert event.sample_rate == 1 and event.steps == 1 and event.mechanism == "site-score"
    rdp = dp_accounting.rdp.RdpAccountant()
    rdp.compose(dp_accounting.GaussianDpEvent(std / math.sqrt(2)))
    assert epsilon_rdp([event], delta) == pytest.approx(rdp.get_epsilon(delta), rel=1e-9)
    pld = dp_accounting.pld.PLDAccountant()
    pld.compose(dp_accounting.GaussianDpEvent(std / math.sqrt(2)))
    assert epsilon_pld([event], delta) == pytest.approx(pld.get_epsilon(delta), rel=1e-3)


def test_the_coins_are_secret_and_fresh_for_each_run():
    """From the OS's CSPRNG: two runs hold out different examples, at the declared rate;
    only a test's seed repeats them (and then one example added leaves the others' coins)."""
    a, b = held_out_mask(20000, 0.2), held_out_mask(20000, 0.2)
    assert not torch.equal(a, b)
    assert 0.17 < a.float().mean() < 0.23 and 0.17 < b.float().mean() < 0.23  # 10 std
    assert torch.equal(held_out_mask(500, 0.2, 7), held_out_mask(501, 0.2, 7)[:500])
    assert held_out_mask(1000, 0.999999).float().mean() > 0.99
    with pytest.raises(ConfigError, match=r"validation fraction must be in \(0, 1\)"):
        held_out_mask(10, 1.0)


def test_a_simulated_site_never_trains_on_its_held_out_examples():
    task = DigitsTask()
    site = SiteConfig.from_node_config(
        {"partition-id": 1, "num-partitions": 3},
        {"epsilon-budget": 8.0, "delta": 1e-5, "validation-fraction": 0.25},
        "/tmp/unused",
    )
    assert site.validation_fraction == 0.25
    train, held = site_data_parts(task, site, 3, "iid", 0.5, 0)
    whole = site_dataset(task, site, 3, "iid", 0.5, 0)
    assert train.dataset.indices == whole.indices == held.dataset.indices  # the site's share
    assert not set(train.indices) & set(held.indices)
    assert sorted(train.indices + held.indices) == list(range(len(whole)))
    assert 0.15 < len(held) / len(whole) < 0.35
    with pytest.raises(ConfigError, match="validation-fraction must be in"):
        SiteConfig.from_node_config({"partition-id": 0}, {"validation-fraction": 1.5})


def test_a_deployed_site_sets_its_own_held_out_share_and_noise():
    node = {"task": "digits", "data-path": "x", "ledger-path": "l", "delta": 1e-5}
    node = {**node, "site-id": "a", "epsilon-budget": 8.0}
    site = SiteConfig.from_node_config({**node, "validation-fraction": 0.2, "score-noise": 3.0})
    assert site.validation_fraction == 0.2 and site.policy.score_noise == 3.0
    assert SiteConfig.from_node_config(node).policy.score_noise is None  # no score released
    with pytest.raises(ConfigError, match="score-noise must be a std > 0"):
        SiteConfig.from_node_config({**node, "score-noise": 0.0})


def scoring_site(tmp_path, budget: float = 8.0, score_noise: float | None = 2.0) -> Site:
    data = small_data(60)
    train, held = split_site_data(data, 0.25, 5)
    policy = SitePolicy(budget, 1e-5, score_noise=score_noise, noise_seed=4)
    ledger = PrivacyLedger(1e-5, budget, "site-a", tmp_path / "ledger.json")
    return Site("site-a", small_classifier(), train, policy, ledger=ledger, validation=held)


def test_a_site_records_its_score_then_releases_its_noised_counts(tmp_path):
    site = scoring_site(tmp_path)
    exact = class_counts(site.model, site.validation, "multiclass", 3)
    released = site.score_counts(3)
    assert released.shape == (2, 3) and not np.allclose(released, exact)
    assert np.abs(released - exact).max() < 5 * 2.0
    (event,) = site.ledger.events
    assert event.mechanism == "site-score" and event.party == "site-a"
    assert event.accounting_noise_multiplier == pytest.approx(2.0 / math.sqrt(2))


def test_a_site_refuses_a_score_it_does_not_release_or_cannot_afford(tmp_path):
    with pytest.raises(RoundRefused, match="release not allowed"):
        scoring_site(tmp_path / "a", score_noise=None).score_counts(3)
    poor = scoring_site(tmp_path / "b", budget=0.5)  # one score costs more than 0.5
    with pytest.raises(RoundRefused, match="over budget"):
        poor.score_counts(3)
    assert poor.ledger.events == ()


def test_a_score_forwards_at_most_the_sites_max_chunk_examples_at_once(tmp_path):
    """Its memory follows the site's own bound, not the private number of held-out examples
    (1,000 at once before: a device sized for max-chunk failed, after the record, only when
    the site held many)."""
    site = scoring_site(tmp_path)
    site.max_chunk = 4
    widths = []
    site.model.register_forward_hook(lambda _m, args, _out: widths.append(len(args[0])))
    site.score_counts(3)
    assert len(site.validation) > 4 and max(widths) == 4


def test_a_score_the_site_cannot_count_is_refused_before_it_is_recorded(tmp_path):
    site = scoring_site(tmp_path)
    site.kind = "multilabel"
    with pytest.raises(ConfigError, match="counts classes"):
        site.score_counts(3)
    assert site.ledger.events == ()


def test_a_binary_task_with_bool_labels_is_counted_and_its_unreadable_examples_nowhere():
    """A bool label cannot be rounded, and -1 as a bool is True: the counts use float64."""

    class Flagged(CheckedExamples):  # example 0 fails its checks
        def __getitem__(self, i):
            x, y, valid = super().__getitem__(i)
            return x, y, valid and i != 0

    data = TensorDataset(torch.randn(12, 4), torch.arange(12) % 2 == 1)
    model = small_classifier(2)
    counts = class_counts(model, Flagged.of(data, "binary", model), "binary", 2)
    assert counts[0].tolist() == [5.0, 6.0]  # example 0 (label False) counts nowhere


def test_a_score_reply_is_exactly_its_counts():
    good = wire.encode_counts(np.ones((2, 3)))
    arrays = {k: wire.as_wire_array(v) for k, v in good.items()}
    assert wire.decode_counts(arrays, "site", 3).shape == (2, 3)
    bad = [
        ({"counts": np.ones((2, 4))}, "shape"),
        ({"counts": np.ones((2, 3), dtype=np.float32)}, "dtype"),
        ({"counts": np.full((2, 3), np.nan)}, "NaN"),
        ({"counts": np.ones((2, 3)), "more": np.ones(1)}, "unexpected arrays"),
    ]
    for values, message in bad:
        arrays = {k: wire.as_wire_array(v) for k, v in values.items()}
        with pytest.raises(wire.WireError, match=message):
            wire.decode_counts(arrays, "site", 3)
    assert wire.check_score_request(wire.score_request(10)) == 10
    for classes in (1, True, 3.0, 10**6):
        with pytest.raises(wire.WireError, match="classes"):
            wire.check_score_request({**wire.score_request(10), "classes": classes})


def test_exact_counts_give_the_metrics_balanced_accuracy():
    model, data = small_classifier(), small_data(200)
    counts = class_counts(model, checked(data, model), "multiclass", 3)
    assert counts[0].sum() == 200
    expected = evaluate(model, data, "multiclass")
    got = score_from_counts(counts)
    assert got["accuracy"] == pytest.approx(expected["accuracy"])
    assert got["balanced_accuracy"] == pytest.approx(expected["balanced_accuracy"])


def test_a_binary_model_of_one_logit_is_counted_over_two_classes():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    data = TensorDataset(torch.randn(50, 4), torch.randint(0, 2, (50,)).float())
    assert model_classes(model, data[0][0]) == 2
    counts = class_counts(model, checked(data, model, "binary"), "binary", 2)
    assert counts.shape == (2, 2) and counts[0].sum() == 50
    assert score_from_counts(counts)["accuracy"] == pytest.approx(
        evaluate(model, data, "binary")["accuracy"]
    )


def test_labels_outside_the_tasks_classes_count_nowhere():
    model = small_classifier()
    data = TensorDataset(torch.randn(4, 4), torch.tensor([0, 1, 7, -1]))
    assert class_counts(model, checked(data, model), "multiclass", 3)[0].sum() == 2


def test_the_noise_is_unbiased_of_the_sites_std():
    counts = np.full((2, 5), 100.0)
    draws = np.stack([noisy_counts(counts, 4.0, NoiseSource(s)) for s in range(400)])
    assert abs(draws.mean() - 100.0) < 0.2 and draws.std() == pytest.approx(4.0, rel=0.03)


def test_a_bad_site_score_is_named():
    with pytest.raises(ConfigError, match="fraction must be in"):
        SiteScore(0.0, 2.0)
    with pytest.raises(ConfigError, match="score noise must be a finite std > 0"):
        SiteScore(0.2, 0.0)
    with pytest.raises(ConfigError, match="noise_std must be a number"):
        SiteScore(0.2, "2")
    with pytest.raises(ConfigError, match="not for 'multilabel' tasks"):
        class_counts(small_classifier(), checked(small_data(), small_classifier()), "multilabel", 3)


def test_split_site_data_keeps_every_example_once():
    data = small_data(100)
    train, held = split_site_data(data, 0.3)
    assert sorted(train.indices + held.indices) == list(range(100))


class WithUnreadable(torch.utils.data.Dataset):
    """``data`` with one more example at the end that cannot be read (a truncated file) or,
    with ``shape``, that has another shape."""

    def __init__(self, data, shape: tuple[int, ...] | None = None) -> None:
        self.data, self.shape = data, shape

    def __len__(self) -> int:
        return len(self.data) + 1

    def __getitem__(self, i):
        if i < len(self.data):
            return self.data[i]
        if self.shape is None:
            raise OSError("image file is truncated")
        return torch.zeros(self.shape), torch.tensor(1)


@pytest.mark.parametrize("shape", [None, (5,)], ids=["unreadable", "other-shape"])
def test_a_held_out_example_that_cannot_be_read_counts_nowhere_and_the_score_is_released(
    tmp_path, shape
):
    """A neighbouring data set with one bad held-out example gives a score reply, never an
    error: the reply's kind would tell the server, without noise, that the example exists.
    The counts are those of the data set without it (sensitivity 0 for that example)."""
    data, held = split_site_data(small_data(60), 0.25, 5)
    policy = SitePolicy(8.0, 1e-5, score_noise=2.0, noise_seed=4)
    sites = [
        Site("a", small_classifier(), data, policy, validation=v, ledger=PrivacyLedger(
            1e-5, 8.0, "a", tmp_path / f"{i}.json"
        ))
        for i, v in enumerate([held, WithUnreadable(held, shape)])
    ]  # fmt: skip
    clean, neighbour = (
        class_counts(site.model, site.validation, "multiclass", 3) for site in sites
    )
    assert np.array_equal(clean, neighbour) and clean[0].sum() == len(held)
    released = sites[1].score_counts(3)
    assert released.shape == (2, 3) and len(sites[1].ledger.events) == 1


def test_a_coins_key_gives_the_same_held_out_examples_and_a_new_key_others():
    key = new_coins_key()
    a = held_out_mask(20000, 0.2, key=key)
    assert torch.equal(a, held_out_mask(20000, 0.2, key=key))
    assert torch.equal(held_out_mask(500, 0.2, key=key), a[:500])  # one more leaves the rest
    assert not torch.equal(a, held_out_mask(20000, 0.2, key=new_coins_key()))
    assert 0.17 < a.float().mean() < 0.23  # 10 std
    with pytest.raises(ValueError, match="32 bytes"):
        held_out_mask(10, 0.2, key=bytes(16))


def test_every_message_of_a_run_holds_out_the_same_examples_at_a_deployed_site(tmp_path):
    """A deployed site serves each message in a fresh process (no site cached): the key in
    its run state keeps the held-out part, so a score never counts an example the run trained
    on. Another run draws other coins."""
    from flwr.app import Context, RecordDict

    import gep_fed.flower.clientapp as client_app
    from gep_fed.accounting.ledger import create_ledger_key, default_key_path
    from gep_fed.data.datasets import load_digits

    data = load_digits().subset(np.arange(400))
    np.savez(tmp_path / "data.npz", images=data.images, labels=data.labels)
    ledger = tmp_path / "ledger.json"
    key = create_ledger_key(default_key_path(ledger))
    PrivacyLedger.open(ledger, 1e-5, None, "h1", key=key, create=True)
    node = {
        "site-id": "h1", "task": "digits", "data-path": str(tmp_path / "data.npz"),
        "ledger-path": str(ledger), "epsilon-budget": 8.0, "delta": 1e-5, "device": "cpu",
        "validation-fraction": 0.25, "score-noise": 6.0,
    }  # fmt: skip

    def held_out(context):
        client_app._SITES.clear()  # what a fresh process starts with
        site = client_app._site(context, client_app.Served(None, None))
        trained = set(site.dataset.dataset.indices)
        held = set(site.validation.dataset.indices)
        assert not trained & held and len(trained | held) == 400
        return held

    run = Context(1, 1, node, RecordDict(), {"task": "digits"})
    first = held_out(run)
    assert held_out(run) == first and 60 < len(first) < 140
    assert held_out(Context(2, 1, node, RecordDict(), {"task": "digits"})) != first
    client_app._SITES.clear()


def test_a_run_asks_its_sites_for_a_score_and_names_those_that_release_none(tmp_path):
    """In process, the real apps: after the last round the server queries every site; a
    site whose settings set no score-noise refuses by its fixed code, one that does replies
    with its noised counts, recorded in its ledger."""
    from gep_fed.federation.config import FederationConfig
    from gep_fed.flower.simulation import simulate

    fed = FederationConfig(
        num_public=100, num_basis=8, rounds=1, local_steps=1, sample_rate=1.0, num_sites=2,
        noise_seed=3, run_dir=str(tmp_path), run_name="none",
    )  # fmt: skip
    held_out = {"validation-fraction": 0.2}
    simulate(fed, False, engine="in-process", site_settings=held_out, score_sites=True)
    record = json.loads((tmp_path / "none" / "site_score.json").read_text())
    assert record["sites_ok"] == 0 and len(record["rejected"]) == 2
    assert all("release not allowed" in r for r in record["rejected"])
    assert not any(k.startswith("site_val_") for k in record)
    # the run spends the sites' whole budget on its rounds: a score needs a larger one
    noised = {**held_out, "score-noise": 2.0, "epsilon-budget": 2 * fed.target_epsilon}
    fed = replace(fed, run_name="noised")
    simulate(fed, False, engine="in-process", site_settings=noised, score_sites=True)
    record = json.loads((tmp_path / "noised" / "site_score.json").read_text())
    assert record["sites_ok"] == 2 and record["rejected"] == []
    assert 0 <= record["site_val_balanced_accuracy"] <= 1
    for site in ("site-0", "site-1"):
        ledger = PrivacyLedger.load_keyed(tmp_path / "noised" / "sites" / site / "ledger.json")
        assert ledger.events[-1].mechanism == "site-score"


def test_a_finished_run_rerun_does_not_ask_its_sites_again(tmp_path):
    """Rerunning a finished run (a resumed tuning) trains nothing and releases nothing: its
    sites were asked for their score once, and their ledgers hold that one answer."""
    from gep_fed.federation.config import FederationConfig
    from gep_fed.flower.simulation import simulate

    fed = FederationConfig(
        num_public=100, num_basis=8, rounds=1, local_steps=1, sample_rate=1.0, num_sites=2,
        noise_seed=3, run_dir=str(tmp_path), run_name="r",
    )  # fmt: skip
    sites = {"validation-fraction": 0.2, "score-noise": 2.0, "epsilon-budget": 16.0}
    for _ in range(2):
        simulate(fed, False, engine="in-process", site_settings=sites, score_sites=True)
    ledger = PrivacyLedger.load_keyed(tmp_path / "r" / "sites" / "site-0" / "ledger.json")
    assert [e.mechanism for e in ledger.events].count("site-score") == 1


def test_the_score_spread_is_the_noises_own_spread_of_the_balanced_accuracy():
    """Read from one noisy sum of counts, it matches the spread of the balanced accuracy over
    many draws of the sites' noise (first order: within a fifth)."""
    exact = np.array([[60.0, 40.0, 80.0], [45.0, 20.0, 70.0]])
    draws = [
        sum(noisy_counts(exact / 3, 2.0, NoiseSource(10 * i + s)) for s in range(3))
        for i in range(2000)
    ]
    spread = np.std([score_from_counts(d)["balanced_accuracy"] for d in draws])
    assert score_spread(draws[0], 2.0, 3) == pytest.approx(spread, rel=0.2)
    assert math.isnan(score_spread(np.zeros((2, 3)), 2.0, 3))  # no class counted

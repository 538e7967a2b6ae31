"""A site's noised validation score (``gep_fed.federation.site_score``): held-out examples
chosen by each one's own coin, per-class counts of sensitivity sqrt(2), a Gaussian release
accounted as dp-accounting accounts it."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from gep_fed.accounting.events import epsilon_pld, epsilon_rdp
from gep_fed.data.builtin_tasks import DigitsTask
from gep_fed.data.metrics import evaluate
from gep_fed.federation.policy import SiteConfig
from gep_fed.federation.site import site_dataset, site_validation_data
from gep_fed.federation.site_score import (
    SiteScore,
    class_counts,
    held_out_mask,
    model_classes,
    noisy_counts,
    score_event,
    score_from_counts,
    split_site_data,
)
from gep_fed.mechanisms.noise import NoiseSource
from gep_fed.validation import ConfigError


def small_classifier(classes: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, classes))


def small_data(n: int = 40, classes: int = 3) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, classes, (n,)))


def test_removing_any_one_example_moves_the_counts_by_at_most_sqrt_2():
    """Brute force over every example: the release's L2 sensitivity is sqrt(2) (its class's
    count, and its right count when the model gets it right), attained, never exceeded."""
    model, data = small_classifier(), small_data()
    full = class_counts(model, data, "multiclass", 3)
    moves = []
    for i in range(len(data)):
        rest = torch.utils.data.Subset(data, [j for j in range(len(data)) if j != i])
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


def test_an_examples_coin_does_not_depend_on_the_others():
    """Each example's coin is drawn in order from a public key: adding an example leaves
    every other example where it was (training or held out)."""
    a, b = (
        held_out_mask(500, 0.2, "0/site-1/validation"),
        held_out_mask(501, 0.2, "0/site-1/validation"),
    )
    assert torch.equal(a, b[:500])
    assert 0.15 < a.float().mean() < 0.25
    assert not torch.equal(a, held_out_mask(500, 0.2, "0/site-2/validation"))
    with pytest.raises(ConfigError, match=r"validation fraction must be in \(0, 1\)"):
        held_out_mask(10, 1.0, "k")


def test_a_simulated_site_never_trains_on_its_held_out_examples():
    task = DigitsTask()
    site = SiteConfig.from_node_config(
        {"partition-id": 1, "num-partitions": 3},
        {"epsilon-budget": 8.0, "delta": 1e-5, "validation-fraction": 0.25},
        "/tmp/unused",
    )
    assert site.validation_fraction == 0.25
    train = site_dataset(task, site, 3, "iid", 0.5, 0)
    held = site_validation_data(task, site, 3, "iid", 0.5, 0)
    whole = site_dataset(
        task, SiteConfig(site.site_id, site.policy, partition_id=1), 3, "iid", 0.5, 0
    )
    trained = {whole.indices[i] for i in train.indices}
    kept_out = {whole.indices[i] for i in held.indices}
    assert not trained & kept_out and trained | kept_out == set(whole.indices)
    assert 0.15 < len(kept_out) / len(whole) < 0.35
    with pytest.raises(ConfigError, match="validation-fraction must be in"):
        SiteConfig.from_node_config({"partition-id": 0}, {"validation-fraction": 1.5})


def test_a_deployed_site_cannot_hold_out_examples_yet():
    node = {"task": "digits", "data-path": "x", "ledger-path": "l", "delta": 1e-5}
    with pytest.raises(ConfigError, match=r"unknown node config key.*validation-fraction"):
        SiteConfig.from_node_config({**node, "site-id": "a", "validation-fraction": 0.2})


def test_exact_counts_give_the_metrics_balanced_accuracy():
    model, data = small_classifier(), small_data(200)
    counts = class_counts(model, data, "multiclass", 3)
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
    counts = class_counts(model, data, "binary", 2)
    assert counts.shape == (2, 2) and counts[0].sum() == 50
    assert score_from_counts(counts)["accuracy"] == pytest.approx(
        evaluate(model, data, "binary")["accuracy"]
    )


def test_labels_outside_the_tasks_classes_count_nowhere():
    model = small_classifier()
    data = TensorDataset(torch.randn(4, 4), torch.tensor([0, 1, 7, -1]))
    assert class_counts(model, data, "multiclass", 3)[0].sum() == 2


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
        class_counts(small_classifier(), small_data(), "multilabel", 3)


def test_split_site_data_keeps_every_example_once():
    data = small_data(100)
    train, held = split_site_data(data, 0.3, "k")
    assert sorted(train.indices + held.indices) == list(range(100))

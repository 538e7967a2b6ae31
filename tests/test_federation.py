"""The federation's library side (no Flower): sites, central aggregation, resumption."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from example_task import AugmentedDigits, shift_by_copy
from torch.utils.data import Subset

from gep_fed.accounting.events import epsilon_rdp
from gep_fed.accounting.ledger import LedgerError, PrivacyLedger
from gep_fed.data.builtin_tasks import DigitsTask
from gep_fed.data.partition import partition_indices
from gep_fed.data.task import TaskSettings, stack_examples
from gep_fed.federation.config import FederationConfig
from gep_fed.federation.policy import SitePolicy
from gep_fed.federation.site import Site
from gep_fed.federation.wire import RoundRefused
from gep_fed.mechanisms.per_example import per_example_gradients
from gep_fed.mechanisms.sampling import PoissonSampler
from gep_fed.validation import ConfigError
from helpers import tiny_federation

# Sites of these tests trust the server (central mode) and accept noise-free rounds.
TRUSTING = SitePolicy(None, 1e-5, accepted_modes=("client", "central"), allow_no_noise=True)


@pytest.fixture(scope="module")
def digits():
    return DigitsTask(TaskSettings(num_public=300))


def make_server(tmp_path, task, **overrides):
    return tiny_federation(
        tmp_path, task, **{"num_basis": 30, "sample_rate": 0.2, "rounds": 3, **overrides}
    )


@pytest.mark.parametrize("mechanism", ["gep", "bgep", "gp"])
def test_central_mode_without_noise_equals_the_mechanism_on_the_union_of_samples(
    tmp_path, digits, mechanism
):
    server = make_server(
        tmp_path,
        digits,
        mode="central",
        mechanism=mechanism,
        noise_multiplier=0.0,
        server_lr=0.5,
    )
    plan = server.plan_round(1)
    pooled = digits.train_dataset()
    parts = partition_indices(pooled.targets(), 3, "iid", seed=0)
    sites, union_x, union_y = [], [], []
    for i, part in enumerate(parts):
        data = Subset(pooled, part.tolist())
        x, y = stack_examples(data)
        site = Site(
            f"s{i}",
            digits.build_model(),
            data,
            TRUSTING,
            ledger=PrivacyLedger(1e-5),
            sampler_generator=torch.Generator().manual_seed(100 + i),
        )
        site.load_state(server.model.state_dict())
        sites.append(site)
        idx = PoissonSampler(len(x), 0.2, 1, torch.Generator().manual_seed(100 + i)).sample()
        union_x.append(x[idx])
        union_y.append(y[idx])
    sums = [site.central_sums(server.subspace, plan.config) for site in sites]

    before = server.layout.flatten_params(server.model).clone()
    grads = per_example_gradients(
        server.model, F.cross_entropy, torch.cat(union_x), torch.cat(union_y), server.layout
    )
    mech = server.mechanism
    single = mech.reconstruct(
        mech.clipped_sums(grads, server.subspace), server.subspace, 0.2 * len(pooled)
    )
    server.apply_central(1, sums)
    after = server.layout.flatten_params(server.model)
    torch.testing.assert_close(after, before - 0.5 * single, atol=1e-5, rtol=1e-5)


def test_a_sites_rows_are_each_examples_mean_gradient_over_its_augmented_copies(tmp_path, digits):
    server = make_server(
        tmp_path,
        AugmentedDigits(TaskSettings(num_public=300)),
        mode="central",
        mechanism="gp",
        noise_multiplier=0.0,
        clip_norm=1e6,  # nothing clipped: the sum is the sum of the rows
        augmentation_copies=2,
    )
    plan = server.plan_round(1)
    data = digits.train_dataset()
    site = Site(
        "s",
        digits.build_model(),
        data,
        TRUSTING,
        ledger=PrivacyLedger(1e-5),
        sampler_generator=torch.Generator().manual_seed(3),
        max_chunk=7,  # odd: chunks of 3 examples, 6 rows, an example's copies never split
        augmentation=shift_by_copy,
    )
    site.load_state(server.model.state_dict())
    sums = site.central_sums(None, plan.config)

    x, y = stack_examples(data)
    idx = PoissonSampler(len(x), 0.2, 1, torch.Generator().manual_seed(3)).sample()
    model = digits.build_model()
    model.load_state_dict(server.model.state_dict())
    copies = [F.cross_entropy(model(x[idx] + s), y[idx], reduction="sum") for s in (0, 0.5)]
    (sum(copies) / 2).backward()
    expected = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(sums.residual, expected, atol=1e-4, rtol=1e-4)


def test_augmentation_copies_need_a_task_with_an_augmentation(tmp_path, digits):
    with pytest.raises(ConfigError, match=r"augmentation_copies 2: task 'digits'.*no augmentation"):
        make_server(tmp_path, digits, augmentation_copies=2)
    with pytest.raises(ConfigError, match="langevin"):
        FederationConfig(mechanism="langevin", model="linear", augmentation_copies=2)


def test_a_site_whose_task_has_no_augmentation_refuses_augmented_rounds(tmp_path, digits):
    server = make_server(tmp_path, digits, mode="client", noise_multiplier=1.0)
    plan = server.plan_round(1)
    rc = replace(plan.config, augmentation_copies=4)
    ledger = PrivacyLedger(1e-5)
    site = Site("s", digits.build_model(), digits.train_dataset(), TRUSTING, ledger=ledger)
    with pytest.raises(RoundRefused, match="malformed round"):
        site.run_round(rc, server.subspace)
    assert ledger.steps == 0


def test_site_refuses_a_round_beyond_its_own_budget_before_computing(tmp_path, digits):
    server = make_server(tmp_path, digits, mode="client", noise_multiplier=1.0, local_steps=3)
    plan = server.plan_round(1)
    ledger = PrivacyLedger(1e-5, budget_epsilon=0.5, owner="s", path=tmp_path / "site.json")
    data = digits.train_dataset()
    site = Site("s", digits.build_model(), data, SitePolicy(0.5, 1e-5), ledger=ledger)
    site.load_state(server.model.state_dict())
    weights = [p.clone() for p in site.model.parameters()]
    with pytest.raises(RoundRefused, match="over budget"):
        site.run_round(plan.config, server.subspace)
    assert ledger.steps == 0
    assert all(torch.equal(a, b) for a, b in zip(weights, site.model.parameters(), strict=True))


def test_a_site_refuses_at_round_one_a_run_its_budget_cannot_finish_and_spends_nothing(
    tmp_path, digits
):
    """A budget that holds exactly three rounds: a four-round run is refused at its first
    round, with nothing recorded; a three-round run is admitted in every round (no round
    refused early), and a fourth round after it is not."""
    server = make_server(
        tmp_path,
        digits,
        mode="client",
        mechanism="gp",
        noise_multiplier=1.0,
        rounds=4,
        local_steps=2,
        target_epsilon=100.0,
    )
    plan = server.plan_round(1)
    assert plan.config.last_round == 4
    data = digits.train_dataset()
    probe = Site("s", digits.build_model(), data, TRUSTING, ledger=PrivacyLedger(1e-5))
    three_rounds = probe.planned_events(replace(plan.config, last_round=3))
    round_by_round = [
        e for r in (1, 2, 3) for e in probe.round_events(replace(plan.config, round=r))
    ]
    assert sum(e.steps for e in three_rounds) == sum(e.steps for e in round_by_round)
    budget = epsilon_rdp(round_by_round, 1e-5)
    assert epsilon_rdp(three_rounds, 1e-5) == pytest.approx(budget, rel=1e-12)
    ledger = PrivacyLedger(1e-5, budget_epsilon=budget, owner="s", path=tmp_path / "site.json")
    site = Site("s", digits.build_model(), data, SitePolicy(budget, 1e-5), ledger=ledger)
    site.load_state(server.model.state_dict())
    with pytest.raises(RoundRefused, match="over budget"):
        site.run_round(plan.config, server.subspace)
    assert ledger.steps == 0 and not ledger.path.exists()
    last = None
    for round_ in (1, 2, 3):
        site.run_round(replace(plan.config, round=round_, last_round=3), server.subspace, last)
        last = round_
    steps = sum(e.steps for e in round_by_round)
    assert ledger.steps == steps and ledger.epsilon() == pytest.approx(budget)
    with pytest.raises(RoundRefused, match="over budget"):
        site.run_round(replace(plan.config, round=4, last_round=4), server.subspace, last)
    assert PrivacyLedger.load(ledger.path).steps == steps  # what the file holds


def test_a_langevin_site_plans_its_step_dependent_releases_round_by_round(tmp_path):
    """Langevin's sigma changes with the step: a budget that holds exactly rounds 1-3 as the
    ledger records them admits a three-round run in every round and refuses a four-round
    run at round 1 (one round's releases repeated would misjudge both)."""
    task = DigitsTask(TaskSettings(num_public=100, model="linear"))
    server = make_server(
        tmp_path, task, mode="client", mechanism="langevin", model="linear", rounds=4, local_steps=2
    )
    rc = server.plan_round(1).config
    assert rc.last_round == 4  # a Langevin server leaves the budget to the sites' ledgers
    data = task.train_dataset()
    probe = Site("s", task.build_model(), data, TRUSTING, ledger=PrivacyLedger(1e-5))
    by_round = [probe.round_events(replace(rc, round=r)) for r in (1, 2, 3)]
    sigmas = [[e.noise_multiplier for e in events] for events in by_round]
    assert sigmas[0] != sigmas[2]  # step-dependent
    budget = epsilon_rdp([e for events in by_round for e in events], 1e-5)
    ledger = PrivacyLedger(1e-5, budget_epsilon=budget, owner="s")
    site = Site("s", task.build_model(), data, SitePolicy(budget, 1e-5), ledger=ledger)
    site.load_state(server.model.state_dict())
    with pytest.raises(RoundRefused, match="over budget"):
        site.run_round(rc, None)
    assert ledger.steps == 0
    last = None
    for round_ in (1, 2, 3):
        site.run_round(replace(rc, round=round_, last_round=3), None, last)
        last = round_
    assert ledger.epsilon() == pytest.approx(budget)


def test_the_server_announces_the_last_round_its_own_budget_holds(tmp_path, digits):
    """A given sigma whose five rounds outspend the target: the server plans (and tells the
    sites) the two rounds its budget holds; a budget that holds every round plans them all."""
    from gep_fed.mechanisms.mechanism import GEP

    sigma, q = 1.5, 0.2
    two, three = (epsilon_rdp([GEP.event(sigma, q, n)], 1e-5) for n in (2, 3))
    settings = dict(mode="central", noise_multiplier=sigma, sample_rate=q, rounds=5)
    short = make_server(tmp_path / "short", digits, target_epsilon=(two + three) / 2, **settings)
    assert short.plan_round(1).config.last_round == 2
    short.ledger.record(*short.round_events(1))  # round 1 applied
    assert short.last_round(2) == 2
    long = make_server(tmp_path / "long", digits, target_epsilon=50.0, **settings)
    assert long.plan_round(1).config.last_round == 5


def test_resume_restores_the_ledger_written_with_the_last_checkpoint(tmp_path, digits):
    server = make_server(tmp_path, digits, mode="central", noise_multiplier=2.0)
    plan = server.plan_round(1)
    data = digits.train_dataset()
    site = Site("s", digits.build_model(), data, TRUSTING, ledger=PrivacyLedger(1e-5))
    site.load_state(server.model.state_dict())
    server.apply_central(1, [site.central_sums(server.subspace, plan.config)])
    # simulate a crash after the checkpoint but before the ledger file was rewritten
    ledger_path = server.ledger.path
    ledger_path.write_text(PrivacyLedger(1e-5, 8.0, server.ledger.owner).to_json())
    again = make_server(tmp_path, digits, mode="central", noise_multiplier=2.0)
    assert again.resume() == 1
    assert again.ledger.steps == 1 and PrivacyLedger.load(ledger_path).steps == 1
    torch.testing.assert_close(
        again.layout.flatten_params(again.model), server.layout.flatten_params(server.model)
    )


def test_a_resumed_seeded_server_continues_its_noise_rather_than_redrawing_it(tmp_path, digits):
    """A seeded server (tests, benchmarks) that resumed from round 0 of its noise stream
    would add round 1's noise again: two releases whose difference cancels it."""
    settings = dict(mode="central", noise_multiplier=2.0, noise_seed=5)
    server = make_server(tmp_path, digits, **settings)
    plan = server.plan_round(1)
    site = Site(
        "s", digits.build_model(), digits.train_dataset(), TRUSTING, ledger=PrivacyLedger(1e-5)
    )
    site.load_state(server.model.state_dict())
    server.apply_central(1, [site.central_sums(server.subspace, plan.config)])
    drawn = server.noise.state_dict()
    assert drawn["position"] > 0
    again = make_server(tmp_path, digits, **settings)
    assert again.resume() == 1 and again.noise.state_dict() == drawn
    like = torch.zeros(10)
    assert torch.equal(again.noise.gaussian(like, 1.0), server.noise.gaussian(like, 1.0))
    unseeded = make_server(tmp_path / "os", digits, mode="central", noise_multiplier=2.0)
    assert unseeded.noise.state_dict() == {}  # an OS-keyed source writes nothing


def test_a_spent_ledger_without_checkpoint_is_not_started_over(tmp_path, digits):
    server = make_server(tmp_path, digits, mode="central", noise_multiplier=2.0)
    server.plan_round(1)
    server.ledger.record(*server.round_events(1))
    (server.run.path / "checkpoint.pt").unlink(missing_ok=True)
    again = make_server(tmp_path, digits, mode="central", noise_multiplier=2.0)
    with pytest.raises(LedgerError, match="no checkpoint"):
        again.resume()


def test_anchors_use_the_public_datas_own_labels_only_when_asked(tmp_path, digits, monkeypatch):
    import gep_fed.federation.server as server_module

    seen = []
    real = server_module.compute_anchor_subspace

    def spy(model, inputs, layout, config, **kwargs):
        seen.append((config.anchor_labels, kwargs["public_labels"]))
        return real(model, inputs, layout, config, **kwargs)

    monkeypatch.setattr(server_module, "compute_anchor_subspace", spy)
    for labels in ("random", "true"):
        server = make_server(tmp_path / labels, digits, anchor_labels=labels)
        server.plan_round(1)
    assert [s[0] for s in seen] == ["random", "true"]
    _, public_labels = stack_examples(digits.public_dataset())
    assert sorted(seen[1][1].tolist()) == sorted(public_labels.tolist())


def test_model_average_serves_the_warmed_up_running_mean_of_the_iterates(tmp_path, digits):
    server = make_server(tmp_path, digits, mode="client", ema_decay=0.9, server_lr=1.0)
    size = server.layout.size
    iterates, deltas = [], [torch.randn(size) for _ in range(3)]
    for round_, delta in enumerate(deltas, start=1):
        server.apply_client(round_, [delta])
        iterates.append(torch.cat([p.detach().flatten() for p in server.model.parameters()]))
    expected = iterates[0]
    for round_, iterate in zip((2, 3), iterates[1:], strict=True):
        weight = min(0.9, (1 + round_) / (10 + round_))
        expected = weight * expected + (1 - weight) * iterate
    served = torch.cat([p.detach().flatten() for p in server.served_model.parameters()])
    torch.testing.assert_close(served, expected)
    assert not torch.allclose(served, iterates[-1])  # the iterate trains on; the mean is served
    saved = torch.load(server.run.path / "checkpoint.pt", weights_only=False)
    resumed = make_server(tmp_path, digits, mode="client", ema_decay=0.9, server_lr=1.0)
    assert resumed.resume() == 3 and saved["average"] is not None
    torch.testing.assert_close(
        torch.cat([p.detach().flatten() for p in resumed.served_model.parameters()]), expected
    )


def test_without_model_average_the_last_iterate_is_served(tmp_path, digits):
    server = make_server(tmp_path, digits, mode="client")
    server.apply_client(1, [torch.randn(server.layout.size)])
    assert server.served_model is server.model


def test_a_delta_not_below_one_over_n_is_refused_by_name(tmp_path, digits):
    """(epsilon, delta) with delta >= 1/N allows one example to leak whole: the review ran
    delta 0.05 on 1,437 examples (1/N = 7e-4) and got a run reported at epsilon 8."""
    with pytest.raises(ConfigError, match=r"delta 0.05 is not below 1/N = 0.000696 for the 1437"):
        make_server(tmp_path, digits, delta=0.05)
    make_server(tmp_path / "ok", digits, delta=1e-5)


def test_a_basis_capped_by_the_anchors_span_is_said_and_its_size_recorded(tmp_path, digits, caplog):
    # 20 anchors span at most 20 directions per group: num_basis 200 cannot be met.
    server = make_server(tmp_path, digits, num_basis=200, num_anchors=20)
    with caplog.at_level("WARNING", logger="gep_fed.server"):
        plan = server.plan_round(1)
        server.plan_round(2)  # the same basis: said once
    asked = server.layout.allocate_basis(200)
    assert plan.basis_directions == sum(server.subspace.dims) < sum(asked)
    said = [r.getMessage() for r in caplog.records if "num_basis 200" in r.getMessage()]
    assert len(said) == 1 and "20 anchors span no more" in said[0]


def test_a_basis_within_the_anchors_span_is_recorded_without_a_warning(tmp_path, digits, caplog):
    server = make_server(tmp_path, digits, num_basis=30)
    with caplog.at_level("WARNING", logger="gep_fed.server"):
        plan = server.plan_round(1)
    assert plan.basis_directions == sum(server.subspace.dims) > 0
    assert not [r for r in caplog.records if "num_basis" in r.getMessage()]
    assert (
        make_server(tmp_path / "gp", digits, mechanism="gp").plan_round(1).basis_directions is None
    )


@pytest.mark.parametrize("mechanism", ["gp", "langevin"])
def test_a_client_sites_update_says_nothing_of_how_many_examples_it_holds(mechanism):
    """Add/remove adjacency keeps a site's count private: its update is normalised by the
    public size the round declares, so examples that add nothing (zero inputs to a linear
    model without bias: zero gradients) leave a site's noisy update unchanged. Normalised by
    its own count, the update's noise would scale with it: a variance test over many
    coordinates then tells whether one example was added."""
    import json

    from gep_fed.federation.wire import RoundConfig
    from gep_fed.mechanisms.contract import PrivacyContract
    from gep_fed.mechanisms.groups import ParameterLayout
    from gep_fed.mechanisms.noise import NoiseSource

    contract = (
        PrivacyContract("gp", 1.0, 0.5, clip_norm=1.0)
        if mechanism == "gp"
        else PrivacyContract("langevin", 0.0, 0.5, clip_norm=1.0, langevin_beta0=0.1)
    )

    def update(count: int) -> torch.Tensor:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 3, bias=False))
        data = torch.utils.data.TensorDataset(torch.zeros(count, 6), torch.zeros(count).long())
        rc = RoundConfig(
            round=1,
            last_round=1,
            mode="client",
            privacy=contract,
            local_steps=2,
            local_lr=1.0,
            local_momentum=0.0,
            augmentation_copies=0,
            basis_id=-1,
            basis_dtype="float32",
            layout=json.dumps(ParameterLayout.from_model(model).to_dict()),
            site_examples=100,
        )
        site = Site(
            "s",
            model,
            data,
            SitePolicy(50.0, 1e-5),
            ledger=PrivacyLedger(1e-5, 50.0, "s"),
            noise=NoiseSource(7),
            sampler_generator=torch.Generator().manual_seed(1),
        )
        return site.run_round(rc, None).delta

    alone, with_more = update(100), update(300)
    assert alone.abs().sum() > 0  # the noise itself
    assert torch.equal(alone, with_more)


def test_a_run_directory_is_run_by_one_process_at_a_time(tmp_path):
    """A second process with the same run name overwrote a finished run's checkpoint and
    interleaved its metrics: the directory is now locked for as long as a run holds it (the
    operating system releases the lock when the process ends, however it ends)."""
    import subprocess
    import sys

    from gep_fed.federation.rounds import open_server
    from gep_fed.federation.rundir import RunDirectoryError

    fed = FederationConfig(run_dir=str(tmp_path), run_name="r", rounds=2, local_steps=1)
    first = open_server(fed, 0)
    config = (tmp_path / "r" / "config.json").read_text()
    lock = str(tmp_path / "r" / "run.lock")
    holder = (
        "import fcntl, sys\n"
        f"f = open({lock!r}, 'a')\n"
        "try:\n    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept BlockingIOError:\n"
        "    sys.exit(3)\n"
    )
    assert subprocess.run([sys.executable, "-c", holder]).returncode == 3  # another process
    with first.run.lock():  # this process holds it again (the ServerApp within a simulation)
        first.close()
        assert subprocess.run([sys.executable, "-c", holder]).returncode == 3  # still held
    assert subprocess.run([sys.executable, "-c", holder]).returncode == 0  # all let go
    second = open_server(fed, 0)  # the run is over: it may be resumed
    second.close()
    assert (tmp_path / "r" / "config.json").read_text() == config
    forgotten = open_server(fed, 0)  # a server dropped without close (a strategy that failed)
    assert subprocess.run([sys.executable, "-c", holder]).returncode == 3
    del forgotten
    assert subprocess.run([sys.executable, "-c", holder]).returncode == 0  # freed with it
    waiting = subprocess.Popen(
        [sys.executable, "-c", f"import fcntl, time; f = open({lock!r}, 'a'); "
         "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert waiting.stdout.readline().strip() == "held"
        with pytest.raises(RunDirectoryError, match="being run by another process"):
            open_server(fed, 0)
    finally:
        waiting.kill()
        waiting.wait()


def test_a_run_without_its_checkpoint_or_with_an_older_one_is_not_resumed(tmp_path, digits):
    """A Langevin run's server ledger holds no steps (its sites account for themselves), so a
    lost checkpoint restarted the run at round 1 and an older one copied back was taken: the
    metrics' applied rounds now say what the directory trained."""
    from gep_fed.federation.rundir import CHECKPOINT

    server = make_server(tmp_path, digits, mode="central", noise_multiplier=2.0)
    plan = server.plan_round(1)
    site = Site(
        "s", digits.build_model(), digits.train_dataset(), TRUSTING, ledger=PrivacyLedger(1e-5)
    )
    site.load_state(server.model.state_dict())
    server.apply_central(1, [site.central_sums(server.subspace, plan.config)])
    older = server.run.file(CHECKPOINT).read_bytes()
    server.run.append_metrics({"round": 1, "applied": True})
    server.run.append_metrics({"round": 2, "applied": True})  # a later round, committed
    with pytest.raises(LedgerError, match=r"holds round 1, but .* records round 2 applied"):
        make_server(tmp_path, digits, mode="central", noise_multiplier=2.0).resume()
    server.run.file(CHECKPOINT).unlink()
    server.ledger.path.write_text(PrivacyLedger(1e-5, 8.0, server.ledger.owner).to_json())
    with pytest.raises(LedgerError, match="records round 2 applied but holds no checkpoint"):
        make_server(tmp_path, digits, mode="central", noise_multiplier=2.0).resume()
    server.run.file(CHECKPOINT).write_bytes(b"not a checkpoint" + older[:10])
    with pytest.raises(ValueError, match=r"cannot be read \(.*\): restore it") as err:
        make_server(tmp_path, digits, mode="central", noise_multiplier=2.0).resume()
    assert "\n" not in str(err.value)


def test_a_checkpoint_of_another_run_is_not_resumed(tmp_path):
    """A checkpoint copied from another run (other data shares, another model) was resumed
    when its ledger happened to agree, or crashed with a traceback after its ledger had
    been taken: it carries its run's settings' digest, compared first."""
    import shutil

    from gep_fed.federation.rounds import open_server

    def committed(name: str, **settings):
        fed = FederationConfig(
            run_dir=str(tmp_path), run_name=name, rounds=2, num_public=50, num_basis=8, **settings
        )
        server = open_server(fed, 0)
        server._commit(1)  # round 1 accounted and checkpointed
        server.close()
        return fed

    committed("iid", partition="iid")
    other = committed("dirichlet", partition="dirichlet")
    shutil.copy(tmp_path / "iid" / "checkpoint.pt", tmp_path / "dirichlet" / "checkpoint.pt")
    server = open_server(other, 0)
    with pytest.raises(LedgerError, match="written by a run of other settings"):
        server.resume()
    server.close()

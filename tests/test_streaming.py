"""A site streams its data: only the examples each Poisson sample takes are ever read."""

import numpy as np
import torch
from torch.utils.data import Dataset

from gep_fed.accounting.ledger import PrivacyLedger
from gep_fed.data.builtin_tasks import DigitsTask
from gep_fed.data.task import TaskSettings, stack_examples
from gep_fed.federation.config import FederationConfig
from gep_fed.federation.policy import SitePolicy
from gep_fed.federation.rundir import RunDirectory
from gep_fed.federation.server import FederationServer
from gep_fed.federation.site import Site
from gep_fed.mechanisms import GEP
from gep_fed.mechanisms.contract import PrivacyContract
from gep_fed.mechanisms.sampling import PoissonSampler
from gep_fed.mechanisms.step import GEPStep
from gep_fed.mechanisms.step_config import GEPConfig


class CountingDataset(Dataset):
    """Wraps a dataset and records every index read."""

    def __init__(self, inner: Dataset) -> None:
        self.inner, self.reads = inner, []

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i):
        self.reads.append(int(i))
        return self.inner[i]


def test_a_site_reads_exactly_the_examples_its_poisson_samples_take(tmp_path):
    task = DigitsTask(TaskSettings(num_public=200))
    fed = FederationConfig(
        mode="client",
        num_basis=16,
        sample_rate=0.05,
        local_steps=4,
        noise_multiplier=2.0,
        run_dir=str(tmp_path),
        run_name="r",
    )
    run = RunDirectory(fed.run_directory(0))
    run.path.mkdir(parents=True)
    server = FederationServer(fed, task, run, total_examples=len(task.train_dataset()))
    plan = server.plan_round(1)
    data = CountingDataset(task.train_dataset())
    site = Site(
        "s",
        task.build_model(),
        data,
        SitePolicy(8.0, 1e-5),
        ledger=PrivacyLedger(1e-5, 8.0, "s"),
        sampler_generator=torch.Generator().manual_seed(3),
        max_chunk=7,
    )
    # building the site reads its first valid example once (CheckedExamples' reference shape)
    data.reads.clear()
    site.load_state(server.model.state_dict())
    site.run_round(plan.config, server.subspace)
    replay = torch.Generator().manual_seed(3)
    expected = np.concatenate(
        [PoissonSampler(len(data), 0.05, 1, replay).sample().numpy() for _ in range(4)]
    )
    assert sorted(data.reads) == sorted(expected.tolist())
    assert len(data.reads) < 0.1 * 4 * len(data)  # a sample, not the data set


def test_streamed_batches_release_the_same_sums_as_one_batch():
    """Clipping is per example and sums add up: the chunking of a sample changes nothing."""
    task = DigitsTask(TaskSettings(num_public=200))
    x, y = stack_examples(task.train_dataset(), range(50))
    config = GEPConfig(PrivacyContract("gep", 0.0, 0.1), num_basis=16)
    sums = []
    for chunk in (50, 7):
        torch.manual_seed(0)
        model = task.build_model()
        public = stack_examples(task.public_dataset())[0]
        step = GEPStep(
            model,
            public,
            config,
            dataset_size=500,
            generator=torch.Generator().manual_seed(0),
        )
        step.refresh_subspace()
        batches = [(x[i : i + chunk], y[i : i + chunk]) for i in range(0, 50, chunk)]
        sums.append(step.clipped_sums(batches))
    assert isinstance(step.mechanism, GEP)
    torch.testing.assert_close(sums[0].embedding, sums[1].embedding, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sums[0].residual, sums[1].residual, atol=1e-5, rtol=1e-5)

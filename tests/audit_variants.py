"""Deliberately broken variants of the mechanisms, for the audit tests only.

Each is a context manager that patches one thing while the accounting stays as it was. They
live here, in the tests, and nothing in configuration can reach them.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch

from gep_fed.mechanisms import langevin
from gep_fed.mechanisms.mechanism import GEP, Mechanism
from gep_fed.mechanisms.sampling import PoissonSampler


@contextlib.contextmanager
def _patched(owner, name, value):
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def noise_halved():
    """Every release gets half the noise its sigma says; the ledger still records sigma."""
    add_noise = Mechanism.add_noise
    return _patched(
        Mechanism,
        "add_noise",
        lambda self, *args: add_noise(
            replace(self, noise_multiplier=self.noise_multiplier / 2), *args
        ),
    )


def noise_quartered():
    """A gross leak: a quarter of the noise sigma says."""
    add_noise = Mechanism.add_noise
    return _patched(
        Mechanism,
        "add_noise",
        lambda self, *args: add_noise(
            replace(self, noise_multiplier=self.noise_multiplier / 4), *args
        ),
    )


def langevin_noise_cut_a_hundredfold():
    """Langevin's sampling step draws noise of a hundredth of the accounted std."""
    update = langevin.langevin_update
    return _patched(
        langevin,
        "langevin_update",
        lambda params, grad, eta, lam, beta0, noise: update(
            params, grad, eta, lam, beta0 * 1e-4, noise
        ),
    )


def residual_clipped_at_twice_s2():
    """GEP clips the residual to 2 S2 while its noise and accounting use S2."""
    clip = GEP.clip
    return _patched(
        GEP,
        "clip",
        lambda self, grads, subspace: clip(
            replace(self, clip_residual=2 * self.clip_residual), grads, subspace
        ),
    )


def gep_accounted_at_sigma():
    """GEP's two releases accounted as one: calibration and ledger use sigma, not
    sigma / sqrt(2), so the run is noised for an epsilon it then under-reports."""
    return _patched(GEP, "releases", 1)


def sampling_without_replacement():
    """Fixed-size batches drawn by shuffling, epoch by epoch, still accounted as Poisson."""

    def sample(self):
        state = self.__dict__.setdefault("_epoch", {"order": None, "pos": self.num_examples})
        size = round(self.sample_rate * self.num_examples)
        if state["pos"] + size > self.num_examples:
            state["order"] = torch.randperm(self.num_examples, generator=self.generator)
            state["pos"] = 0
        batch = state["order"][state["pos"] : state["pos"] + size]
        state["pos"] += size
        return batch.sort().values

    return _patched(PoissonSampler, "sample", sample)


VARIANTS = {
    "noise halved": ("gp", noise_halved),
    "residual clipped at 2 S2": ("gep", residual_clipped_at_twice_s2),
    "GEP accounted at sigma": ("gep", gep_accounted_at_sigma),
    "sampling without replacement": ("gp", sampling_without_replacement),
}

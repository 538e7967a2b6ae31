"""The noise placements, the design's main axis: one class per mode.

A mode says what a site computes and releases each round, how the site's ledger and the
server's ledger record it, how many private steps a round takes per party, and what the
server does with the replies. Everything else (the site's policy, the trainer, the server,
the Flower adapter) asks the round's mode instead of comparing its name.

- ``CentralMode``: a site sends one Poisson sample's unnoised clipped sums to a server it
  trusts (by opt-in), which adds the noise once per round; the site records the release as
  noised by that server.
- ``ClientMode``: a site takes ``local_steps`` private steps with its own noise and sends its
  noisy model delta; it records every step; the server averages.
- ``DistributedMode``: a site quantises one sample's clipped sums with its share of discrete
  noise and masks them for the secure sum (``gep_fed.federation.secure_sum``); the server
  decodes the sum like central mode's noised sum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar, Protocol

import numpy as np
import torch

from gep_fed.accounting.events import PrivacyEvent
from gep_fed.mechanisms.contract import PrivacyContract
from gep_fed.mechanisms.distributed_noise import MAX_BITS, MIN_BITS
from gep_fed.mechanisms.groups import ParameterLayout
from gep_fed.mechanisms.mechanism import ClippedSums
from gep_fed.mechanisms.subspace import AnchorSubspace
from gep_fed.validation import ConfigError, Range


@dataclass(frozen=True)
class SiteRelease:
    """What a site sends for one round: clipped sums (central), a noisy delta (client) or
    its noised quantised share of a secure sum (distributed: int64 in ``[0, 2**bits)``)."""

    sums: ClippedSums | None = None
    delta: torch.Tensor | None = None
    share: np.ndarray | None = None


class RoundConfig(Protocol):
    """What a mode reads of a round's config (``gep_fed.federation.wire.RoundConfig``)."""

    round: int
    privacy: PrivacyContract
    local_steps: int


class Site(Protocol):
    """What a mode asks of a site (``gep_fed.federation.site.Site``)."""

    site_id: str
    layout: ParameterLayout
    policy: object  # SitePolicy: max_colluding_sites, max_local_steps, noise_shares

    def central_sums(self, subspace: AnchorSubspace | None, rc: RoundConfig) -> ClippedSums: ...

    def distributed_share(self, subspace: AnchorSubspace | None, rc: RoundConfig) -> np.ndarray: ...

    def local_update(self, subspace: AnchorSubspace | None, rc: RoundConfig) -> torch.Tensor: ...

    def langevin_events(self, rc: RoundConfig) -> list[PrivacyEvent]: ...


class Mode:
    """A noise placement. Stateless: one instance per mode (``MODES``)."""

    name: ClassVar[str]
    # How a site's ledger places its release ("local": its own noise).
    site_placement: ClassVar[str]
    # Whether the server sums the sites' clipped sums (noised by it, or by the sites' shares)
    # and steps once per round, rather than averaging the sites' own updates.
    server_steps: ClassVar[bool] = True
    # Whether the replies come through the secure sum's stages.
    secure_sum: ClassVar[bool] = False
    # Whether Langevin DP-SGD can run in it: its noise and accounting are each site's own.
    runs_langevin: ClassVar[bool] = False
    # Who spends the epsilon the server's ledger shows (reports and summaries say it).
    spender: ClassVar[str] = "the federation"

    def check_config(self, cfg) -> None:
        """Raise ``ConfigError`` for a run configuration (``FederationConfig``) this mode
        cannot run."""

    def refusal(self, rc: RoundConfig, policy) -> str | None:
        """Why a site with ``policy`` (``SitePolicy``) refuses this mode's round ``rc``
        beyond its accepted modes (a ``wire.REFUSALS`` key), or None."""
        if rc.privacy.is_distributed:  # a quantised contract outside the secure sum
            return "malformed round"
        return None

    def steps_per_round(self, local_steps: int) -> int:
        """Private steps each party's ledger records per round."""
        return 1

    def ledger_owner(self) -> str:
        """Whose release the server's ledger records."""
        return "federation"

    def rehearsed_as(self, cfg) -> tuple[str, float]:
        """How a rehearsal of run ``cfg`` (``FederationConfig``) on the server's own data
        runs (``gep_fed.federation.tuning.Rehearsal``): the mode, and the factor on sigma,
        that put the same noise on the model's update."""
        return self.name, 1.0

    def site_events(
        self, site: Site, rc: RoundConfig, subspace: AnchorSubspace | None
    ) -> list[PrivacyEvent]:
        """What the round releases, as the site's ledger records it."""
        return rc.privacy.events(
            1, party=site.site_id, round=rc.round, placement=self.site_placement
        )

    def server_events(
        self, contract: PrivacyContract, round_: int, local_steps: int, dimension: int
    ) -> list[PrivacyEvent]:
        """What one round releases, as the server's ledger records it (``dimension``: a
        distributed share's length)."""
        return contract.events(1, party="federation", round=round_)

    def release(self, site: Site, rc: RoundConfig, subspace: AnchorSubspace | None) -> SiteRelease:
        """The site's release for the round (recorded in its ledger before it is computed)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class CentralMode(Mode):
    name = "central"
    site_placement = "trusted-server"

    def refusal(self, rc, policy):
        if rc.server_noise_seeded and policy.noise_seed is None:
            # a seeded server's noise is removable by whoever knows the seed: only a seeded
            # simulation's sites (tests, benchmarks) take part; a deployed site has no seed
            return "over budget"
        return super().refusal(rc, policy)

    def release(self, site, rc, subspace):
        return SiteRelease(sums=site.central_sums(subspace, rc))


class ClientMode(Mode):
    name = "client"
    site_placement = "local"
    server_steps = False
    runs_langevin = True
    spender = "each site"

    def refusal(self, rc, policy):
        if rc.local_steps > policy.max_local_steps:
            return "over compute limit"
        return super().refusal(rc, policy)

    def steps_per_round(self, local_steps: int) -> int:
        return local_steps

    def ledger_owner(self) -> str:
        return "each-site (expected)"

    def site_events(self, site, rc, subspace):
        if rc.privacy.is_langevin:  # step-dependent and size-dependent: the trainer knows
            return site.langevin_events(rc)
        return rc.privacy.events(rc.local_steps, party=site.site_id, round=rc.round)

    def server_events(self, contract, round_, local_steps, dimension):
        return contract.events(local_steps, party="each-site", round=round_)

    def release(self, site, rc, subspace):
        return SiteRelease(delta=site.local_update(subspace, rc))


class DistributedMode(Mode):
    name = "distributed"
    site_placement = "distributed"
    secure_sum = True

    def check_config(self, cfg) -> None:
        Range(0, integer=True).check("noise_shares", cfg.noise_shares)
        if cfg.mechanism == "langevin" or cfg.noise_multiplier == 0:
            raise ConfigError("distributed mode needs gep, bgep or gp with noise")
        if cfg.num_sites < 2:  # a secure sum of one site is its share
            raise ConfigError("distributed mode needs at least 2 sites")
        Range(MIN_BITS, MAX_BITS, integer=True).check("quantization_bits", cfg.quantization_bits)
        if cfg.shares_needed > cfg.num_sites:
            raise ConfigError(
                f"noise_shares ({cfg.noise_shares}) cannot exceed num_sites ({cfg.num_sites})"
            )

    def refusal(self, rc, policy):
        if not rc.privacy.is_distributed:
            return "malformed round"
        if rc.privacy.noise_shares != policy.noise_shares:  # the site sets its own split
            return "other noise split"
        return None

    def site_events(self, site, rc, subspace):
        # the share's length follows this site's own model and the round's basis
        k = subspace.num_basis if subspace is not None else None
        events = rc.privacy.events(
            1,
            party=site.site_id,
            round=rc.round,
            dimension=rc.privacy.quantized_dimension(k, site.layout.size),
        )
        colluders = site.policy.max_colluding_sites  # the assumption the figure rests on
        return [replace(e, max_colluding_sites=colluders) for e in events]

    def server_events(self, contract, round_, local_steps, dimension):
        return contract.events(1, party="federation", round=round_, dimension=dimension)

    def rehearsed_as(self, cfg) -> tuple[str, float]:
        # each of the K sites adds a share of 1/t of the variance: K/t times central's in all
        # (the secure sum itself changes no update)
        return "central", math.sqrt(cfg.num_sites / cfg.shares_needed)

    def release(self, site, rc, subspace):
        return SiteRelease(share=site.distributed_share(subspace, rc))


MODES: dict[str, Mode] = {m.name: m for m in (CentralMode(), ClientMode(), DistributedMode())}
MODE_NAMES = tuple(MODES)


def mode_named(name: str) -> Mode:
    """The mode of that name, or ``ConfigError`` naming the modes."""
    try:
        return MODES[name]
    except (KeyError, TypeError):
        raise ConfigError(f"mode must be one of {list(MODES)}, got {name!r}") from None

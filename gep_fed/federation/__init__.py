"""The federation without Flower: the run's configuration, the wire format, a site's policy,
trainer and self-check, the server's aggregation and accounting, the round loop over any grid
(``rounds.RoundLoop``), the run directory."""

from gep_fed.lazy import lazy_exports

# Each public name's module, imported on first use: ``gep_fed.federation.secure_sum`` (a
# site's ``gep-fed site keygen``) is not made to load PyTorch by its package.
_PUBLIC = {
    "FederationConfig": "gep_fed.federation.config",
    "FederationServer": "gep_fed.federation.server",
    "RoundConfig": "gep_fed.federation.wire",
    "RoundGrid": "gep_fed.federation.rounds",
    "RoundLoop": "gep_fed.federation.rounds",
    "RoundRefused": "gep_fed.federation.wire",
    "RunDirectory": "gep_fed.federation.rundir",
    "Site": "gep_fed.federation.site",
    "SiteConfig": "gep_fed.federation.policy",
    "SitePolicy": "gep_fed.federation.policy",
    "WireError": "gep_fed.federation.wire",
    "check_site": "gep_fed.federation.site_check",
}

__all__ = [
    "FederationConfig",
    "FederationServer",
    "RoundConfig",
    "RoundGrid",
    "RoundLoop",
    "RoundRefused",
    "RunDirectory",
    "Site",
    "SiteConfig",
    "SitePolicy",
    "WireError",
    "check_site",
]


__getattr__ = lazy_exports(__name__, globals(), _PUBLIC)

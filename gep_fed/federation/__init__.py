"""The federation without Flower: the run's configuration, the wire format, a site's policy,
trainer and self-check, the server's aggregation and accounting, the round loop over any grid
(``rounds.RoundLoop``), the run directory."""

from gep_fed.federation.config import FederationConfig
from gep_fed.federation.policy import SiteConfig, SitePolicy
from gep_fed.federation.rounds import RoundGrid, RoundLoop
from gep_fed.federation.rundir import RunDirectory
from gep_fed.federation.server import FederationServer
from gep_fed.federation.site import Site
from gep_fed.federation.site_check import check_site
from gep_fed.federation.wire import RoundConfig, RoundRefused, WireError

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

"""Flower adapter: the Message-API strategy, ClientApp and ServerApp helpers, and the
simulation runner. A team with its own Flower app imports these instead of copying the
project's ``server/`` and ``client/``."""

from gep_fed.flower.clientapp import handle_train, make_client_app
from gep_fed.flower.serverapp import build_strategy, make_server_app
from gep_fed.flower.strategy import GEPStrategy

__all__ = ["GEPStrategy", "build_strategy", "handle_train", "make_client_app", "make_server_app"]

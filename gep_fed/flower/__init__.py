"""Flower adapter: the Message-API strategy, ClientApp and ServerApp helpers, and the
simulation runner. A team with its own Flower app uses ``GEPStrategy.from_config`` in its
ServerApp and ``make_client_app`` for its ClientApp instead of copying the project's
``server/`` and ``client/``."""

from gep_fed.flower.clientapp import handle_train, make_client_app
from gep_fed.flower.serverapp import make_server_app
from gep_fed.flower.strategy import GEPStrategy

__all__ = ["GEPStrategy", "handle_train", "make_client_app", "make_server_app"]

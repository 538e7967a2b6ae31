"""Flower adapter: the Message-API strategy, ClientApp and ServerApp helpers, and the
simulation runner. A team with its own Flower app uses ``GEPStrategy.from_config`` in its
ServerApp and ``make_client_app`` for its ClientApp instead of copying the project's
``server/`` and ``client/``."""

from gep_fed.lazy import lazy_exports

# Each public name's module, imported on first use (``gep_fed.flower.interrupt`` alone
# loads neither PyTorch nor Flower).
_PUBLIC = {
    "GEPStrategy": "gep_fed.flower.strategy",
    "handle_train": "gep_fed.flower.clientapp",
    "make_client_app": "gep_fed.flower.clientapp",
    "make_flwr_server_app": "gep_fed.flower.flwr_app",
    "make_server_app": "gep_fed.flower.serverapp",
}

__all__ = [
    "GEPStrategy",
    "handle_train",
    "make_client_app",
    "make_flwr_server_app",
    "make_server_app",
]


__getattr__ = lazy_exports(__name__, globals(), _PUBLIC)

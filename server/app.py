"""This project's Flower ServerApp: a thin instance of ``gep_fed.flower`` (one run, or a
search where the run config names a candidates file)."""

from gep_fed.flower import make_flwr_server_app

app = make_flwr_server_app()

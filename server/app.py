"""This project's Flower ServerApp: a thin instance of ``gep_fed.flower``."""

from gep_fed.flower import make_server_app

app = make_server_app()

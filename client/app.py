"""This project's Flower ClientApp: a thin instance of ``gep_fed.flower``.

Each site's settings (data, ledger, budget, accepted modes) come from its node config; the run
config only decides the training.
"""

from gep_fed.flower import make_client_app

app = make_client_app()

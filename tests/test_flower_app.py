"""``GEPStrategy`` in a user's own Flower app: Flower's ``Strategy`` contract (initial arrays,
``evaluate_fn``, the ``Result``), and an app laid out as ``flwr new`` lays one out, run by
``flwr run`` on a simulation SuperLink."""

import json
import subprocess
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord

from gep_fed.federation.config import FederationConfig
from gep_fed.federation.rundir import RunDirectory
from gep_fed.flower import GEPStrategy
from helpers import BIN, simulation_superlink

TINY = dict(num_public=200, num_basis=10, sample_rate=0.2, rounds=2, local_steps=1)


class NoSites:
    """A Grid without nodes: every round gets no replies (nothing is applied)."""

    def get_node_ids(self):
        return []

    def send_and_receive(self, messages, timeout=None):
        assert list(messages) == []
        return []


def strategy(tmp_path) -> GEPStrategy:
    fed = FederationConfig(run_dir=str(tmp_path), run_name="r", noise_multiplier=1.0, **TINY)
    return GEPStrategy.from_config(fed, 0, progress=False)


def model_arrays(seed: int) -> ArrayRecord:
    torch.manual_seed(seed)
    return ArrayRecord(FederationConfig(**TINY).make_task().build_model().state_dict())


def flat(state: dict) -> torch.Tensor:
    return torch.cat([v.reshape(-1).double() for v in state.values()])


def test_initial_arrays_that_do_not_fit_the_task_model_are_refused_naming_each_difference(
    tmp_path,
):
    arrays = model_arrays(1)
    first, second, third, *_ = arrays.keys()
    arrays["extra"] = arrays.pop(first)
    arrays[second] = Array(np.zeros(3))
    arrays[third] = Array(np.full(arrays[third].shape, np.nan, np.float32))
    with pytest.raises(ValueError) as err:
        strategy(tmp_path).start(NoSites(), initial_arrays=arrays)
    message = str(err.value)
    assert "task 'digits'" in message
    assert f"missing {first!r}" in message and "unexpected 'extra'" in message
    assert f"{second!r} is float64 [3], the model's is float32" in message
    assert f"{third!r} holds NaN or inf" in message


@pytest.mark.parametrize(
    ("option", "reason"),
    [("train_config", "builds every round's config"), ("evaluate_config", "no federated eval")],
)
def test_round_configs_are_refused_with_the_reason(tmp_path, option, reason):
    with pytest.raises(ValueError, match=rf"{option} \['lr'\] is not accepted: .*{reason}"):
        strategy(tmp_path).start(NoSites(), **{option: ConfigRecord({"lr": 0.1})})


def test_only_the_servers_global_model_is_sent(tmp_path):
    gep = strategy(tmp_path)
    assert len(gep.configure_train(1, gep.global_arrays(), ConfigRecord(), NoSites())) == 0
    with pytest.raises(ValueError, match="not the server's global model"):
        gep.configure_train(2, model_arrays(1), ConfigRecord(), NoSites())


def test_start_uses_the_initial_arrays_and_calls_evaluate_fn_as_flower_does(tmp_path):
    initial = model_arrays(1)
    calls = []

    def evaluate(server_round, arrays):
        calls.append((server_round, flat(arrays.to_torch_state_dict())))
        return MetricRecord({"mine": float(server_round)})

    result = strategy(tmp_path).start(NoSites(), initial_arrays=initial, evaluate_fn=evaluate)
    expected = flat(initial.to_torch_state_dict())
    assert [rnd for rnd, _ in calls] == [0, 1, 2]
    assert all(torch.equal(seen, expected) for _, seen in calls)  # no site replied
    assert torch.equal(flat(result.arrays.to_torch_state_dict()), expected)
    server_metrics = result.evaluate_metrics_serverapp
    assert {rnd: m["mine"] for rnd, m in server_metrics.items()} == {0: 0.0, 1: 1.0, 2: 2.0}
    assert "test_accuracy" in server_metrics[1] and "epsilon" in server_metrics[1]
    rows = RunDirectory(tmp_path / "r").read_metrics()
    assert [(row["round"], row["mine"]) for row in rows] == [(1, 1.0), (2, 2.0)]


@pytest.mark.parametrize("num_rounds", [0, -1, 99, 2.5])
def test_num_rounds_outside_the_configs_rounds_is_refused_by_name(tmp_path, num_rounds):
    """-1 ran nothing, 0 became the config's rounds, and more rounds than the config's
    applied two and then crashed (the sites' plans and sigma are for the config's rounds)."""
    with pytest.raises(ValueError, match=r"num_rounds must be an integer from 1 to the config"):
        strategy(tmp_path).start(NoSites(), num_rounds=num_rounds)


def test_evaluate_fn_may_not_overwrite_what_gep_records_and_is_refused_before_round_one(tmp_path):
    """Refused after a round, the clash lost that round's record: the round was committed
    (its ledger step taken) and no metrics row written, at every attempt (the review: three
    attempts, 3 ledger steps, 0 rows). It is refused on round 0's evaluation."""
    from gep_fed.accounting.ledger import PrivacyLedger

    with pytest.raises(ValueError, match=r"evaluate_fn returned \['epsilon'\]: GEPStrategy"):
        strategy(tmp_path).start(
            NoSites(), evaluate_fn=lambda rnd, arrays: MetricRecord({"epsilon": 0.0})
        )
    assert PrivacyLedger.load(tmp_path / "r" / "ledger.json").steps == 0
    assert not (tmp_path / "r" / "metrics.jsonl").exists()
    # one that returns the key only later is still refused, at that round
    late = strategy(tmp_path / "late")
    with pytest.raises(ValueError, match=r"evaluate_fn returned \['epsilon'\] in round 1"):
        late.start(
            NoSites(), evaluate_fn=lambda rnd, _: MetricRecord({"epsilon": 0.0} if rnd else {})
        )


# -- a Flower app, as `flwr new` lays one out ------------------------------------------------

RUN_CONFIG = {
    "task": "digits",
    "num-sites": 2,
    "num-public": 200,
    "num-basis": 10,
    "sample-rate": 0.2,
    "rounds": 2,
    "local-steps": 1,
    "run-name": "r",
}

APP = {
    "gepapp/__init__.py": '"""A Flower app with GEP."""\n',
    "gepapp/task.py": '''
        """gepapp: the initial model and the server's own evaluation."""

        from functools import cache

        import torch
        from flwr.app import ArrayRecord, MetricRecord

        from gep_fed.data.metrics import predict
        from gep_fed.data.task import TaskSettings
        from gep_fed.data.builtin_tasks import DigitsTask


        @cache
        def task() -> DigitsTask:
            return DigitsTask(TaskSettings(num_public=1))


        def initial_model() -> torch.nn.Module:
            torch.manual_seed(1234)  # not the run's seed: the test checks these are used
            return task().build_model()


        def central_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
            model = task().build_model()
            model.load_state_dict(arrays.to_torch_state_dict())
            logits, targets = predict(model, task().eval_dataset())
            accuracy = (logits.argmax(1) == targets).double().mean().item()
            return MetricRecord({"central-accuracy": accuracy})
    ''',
    "gepapp/server_app.py": '''
        """gepapp: a Flower ServerApp."""

        import json
        from pathlib import Path

        import torch
        from flwr.app import ArrayRecord, Context
        from flwr.serverapp import Grid, ServerApp

        from gep_fed.federation.config import FederationConfig
        from gep_fed.flower import GEPStrategy
        from gepapp.task import central_evaluate, initial_model

        app = ServerApp()


        @app.main()
        def main(grid: Grid, context: Context) -> None:
            fed = FederationConfig.from_record(context.run_config)
            strategy = GEPStrategy.from_config(fed, context.run_id, progress=False)
            result = strategy.start(
                grid,
                initial_arrays=ArrayRecord(initial_model().state_dict()),
                evaluate_fn=central_evaluate,
            )
            out = Path(fed.run_directory(context.run_id))
            torch.save(result.arrays.to_torch_state_dict(), out / "final_model.pt")
            metrics = {
                "train": result.train_metrics_clientapp,
                "server": result.evaluate_metrics_serverapp,
            }
            (out / "result.json").write_text(
                json.dumps({k: {r: dict(m) for r, m in v.items()} for k, v in metrics.items()})
            )
    ''',
    "gepapp/client_app.py": '''
        """gepapp: a Flower ClientApp (a site)."""

        from gep_fed.flower import make_client_app

        app = make_client_app()
    ''',
}


def write_app(root: Path, run_dir: Path) -> None:
    config = {**RUN_CONFIG, "run-dir": str(run_dir)}
    (root / "pyproject.toml").write_text(
        textwrap.dedent(
            """\
            [build-system]
            requires = ["hatchling"]
            build-backend = "hatchling.build"

            [project]
            name = "gepapp"
            version = "1.0.0"
            description = "GEP in a Flower app"
            license = "Apache-2.0"
            dependencies = ["gep-fed", "flwr[simulation]==1.42.*"]

            [tool.hatch.build.targets.wheel]
            packages = ["."]

            [tool.flwr.app]
            publisher = "tests"

            [tool.flwr.app.components]
            serverapp = "gepapp.server_app:app"
            clientapp = "gepapp.client_app:app"

            [tool.flwr.app.config]
            """
        )
        + "".join(f"{key} = {json.dumps(value)}\n" for key, value in config.items())
    )
    for name, text in APP.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())


@pytest.mark.slow
def test_a_flower_app_adds_gep_through_the_public_api(tmp_path):
    app, run_dir = tmp_path / "app", tmp_path / "runs"
    app.mkdir()
    write_app(app, run_dir)
    with simulation_superlink(tmp_path) as env:
        command = [str(BIN / "flwr"), "run", str(app), "sim", "--stream"]
        run = subprocess.run(
            [*command, "--federation-config", "num-supernodes=2"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    out = run_dir / "r"
    logs = run.stdout[-3000:] + run.stderr[-3000:]
    assert run.returncode == 0 and (out / "result.json").exists(), logs

    fed = FederationConfig.from_record({**RUN_CONFIG, "run-dir": str(run_dir)})
    app_initial = model_arrays(1234)  # what the app's task.initial_model() builds
    initial = app_initial.to_torch_state_dict()
    torch.manual_seed(fed.seed)  # the task's seeded model: where GEP starts without them
    seeded = fed.make_task().build_model().state_dict()
    final = torch.load(out / "final_model.pt", weights_only=True)
    assert list(final) == list(initial)
    saved = torch.load(out / "model.pt", weights_only=True)["model"]  # GEP's own copy
    assert torch.equal(flat(final), flat(saved))
    assert not torch.equal(flat(final), flat(initial))
    # two small private rounds moved the model from the app's initial weights, not GEP's own
    moved = torch.linalg.vector_norm(flat(final) - flat(initial))
    assert moved < 0.5 * torch.linalg.vector_norm(flat(final) - flat(seeded))

    result = json.loads((out / "result.json").read_text())
    assert {r: m["sites-ok"] for r, m in result["train"].items()} == {"1": 2, "2": 2}
    assert sorted(result["server"]) == ["0", "1", "2"]
    rows = {str(row["round"]): row for row in RunDirectory(out).read_metrics()}
    for rnd in ("1", "2"):  # evaluate_fn saw each round's global model (GEP's own test set)
        accuracy = result["server"][rnd]["central-accuracy"]
        assert accuracy == pytest.approx(rows[rnd]["test_accuracy"])
        assert rows[rnd]["central-accuracy"] == accuracy

    # The run directory resumes only with the initial model it was started from.
    gep = GEPStrategy.from_config(fed, 0, progress=False)
    with pytest.raises(ValueError, match=r"was started from arrays \w+, not from arrays"):
        gep.start(NoSites(), initial_arrays=model_arrays(1))
    resumed = gep.start(NoSites(), initial_arrays=app_initial)  # all rounds done: none to run
    assert torch.equal(flat(resumed.arrays.to_torch_state_dict()), flat(final))


def test_a_deployed_rounds_replies_are_seen_half_a_second_after_arriving():
    """Flower's HTTP Grid (a deployment) has no ``pull_interval`` and would sleep 3 s
    between pulls: each of a round's exchanges would wait up to 3 s more than its sites."""
    import time

    from gep_fed.flower.interrupt import StoppableGrid, StopRequest

    class HttpLikeGrid:  # the reply arrives between the first and the second pull
        pulls = 0

        def push_messages(self, messages):
            return ["m1"]

        def pull_messages(self, ids):
            self.pulls += 1
            reply = SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id="m1"))
            return [reply] if self.pulls > 1 else []

    began = time.monotonic()
    replies = StoppableGrid(HttpLikeGrid(), StopRequest()).send_and_receive([], timeout=30)
    assert len(replies) == 1 and time.monotonic() - began < 2.0  # 3 s and more before

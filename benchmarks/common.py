"""Shared pieces of the benchmarks: the fixed MNIST split, KMNIST anchors, Opacus DP-SGD."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from gep_fed.data.datasets import (
    MNIST_MEAN,
    MNIST_STD,
    load_kmnist,
    load_mnist,
    mnist_split,
    to_tensor,
    validation_split,
)
from gep_fed.data.metrics import evaluate
from gep_fed.training import OptimizerConfig

SHARED_DATA = Path(
    os.environ.get("GEP_FED_SHARED_DATA", Path(__file__).parents[1] / ".." / "shared" / "data")
).resolve()
RESULTS = Path(__file__).parent / "results"


def tensors(ds):
    return to_tensor(ds.images, MNIST_MEAN, MNIST_STD), torch.from_numpy(ds.labels)


def mnist_data(num_public: int = 2000):
    """The fixed split: fit/val (tuning) carved from the 8,000 training images, test 2,000;
    public anchors: ``num_public`` KMNIST images (labels never used)."""
    train, test = mnist_split(load_mnist(SHARED_DATA / "mnist"))
    fit, val = validation_split(train)
    kmnist = load_kmnist(SHARED_DATA / "kmnist")
    pick = np.random.default_rng(0).permutation(len(kmnist))[:num_public]
    public = to_tensor(kmnist.images[pick], MNIST_MEAN, MNIST_STD)
    return {
        "train": tensors(train),
        "fit": tensors(fit),
        "val": tensors(val),
        "test": tensors(test),
        "public": public,
    }


def train_opacus(
    model,
    x,
    y,
    target_epsilon: float,
    delta: float,
    epochs: int,
    batch_size: int,
    clip: float,
    optimizer: OptimizerConfig,
    seed: int,
    eval_xy,
):
    """DP-SGD with Opacus' own PrivacyEngine (Poisson sampling, its RDP calibration)."""
    from opacus import PrivacyEngine

    gen = torch.Generator().manual_seed(seed)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=batch_size, generator=gen
    )
    opt = torch.optim.SGD(model.parameters(), lr=optimizer.lr, momentum=optimizer.momentum)
    engine = PrivacyEngine(accountant="rdp", secure_mode=False)
    model, opt, loader = engine.make_private_with_epsilon(
        module=model,
        optimizer=opt,
        data_loader=loader,
        target_epsilon=target_epsilon,
        target_delta=delta,
        epochs=epochs,
        max_grad_norm=clip,
        poisson_sampling=True,
        noise_generator=torch.Generator().manual_seed(seed + 1),
    )
    for _ in range(epochs):
        for xb, yb in loader:
            opt.zero_grad(set_to_none=True)
            if len(xb):
                F.cross_entropy(model(xb), yb).backward()
            opt.step()
    accuracy = evaluate(model, eval_xy, "multiclass")["accuracy"]
    return accuracy, engine.get_epsilon(delta), opt.noise_multiplier


def save(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {"written": time.strftime("%Y-%m-%d %H:%M:%S"), **payload}
    path.write_text(json.dumps(payload, indent=1))
    return path

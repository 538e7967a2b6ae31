"""Standard benchmarks (MNIST, Fashion-MNIST, CIFAR-10): GEP, B-GEP, GP, Opacus DP-SGD and
non-private training, tuned the same way on a validation split, then retrained and tested once.

Protocol (issue #13):

- standard splits: the 60,000 training images are split (seeded) into 50,000 fit / 10,000
  validation images for tuning; the official 10,000 test images are used once per method, by
  the setting chosen on validation, retrained on all 60,000. CIFAR-10: the 20,000 images of
  binary batches 1-2 (16,000 fit / 4,000 validation), tested on the 10,000 of batch 5 (the
  split of the library's ``cifar10`` task; the official test batch is not used);
- every method gets a tuning grid of the SAME size (learning rate x clip norm(s) x batch size x
  epochs; GEP and B-GEP also k and S2/S1), the same seed and the same data;
- every private method samples with Poisson sampling at rate q = 1 / ceil(n / B) for
  ``epochs * ceil(n / B)`` steps (B: the nominal batch size; q n <= B is the expected batch),
  Opacus included (its DPDataLoader, whose rate is 1 / len(loader) = the same q);
- sigma is calibrated under RDP (``gep_fed.mechanisms.calibrate_noise_multiplier``) for the
  target epsilon at delta = 1e-5; each run reports its epsilon under RDP and PLD (and Opacus
  its own RDP accountant's); GP and Opacus get the same sigma;
- tuning can be made cheap with TAN (Sander et al., "TAN without a burn: scaling laws of
  DP-SGD", ICML 2023): ``--tan R`` tunes at expected batch q n / R with noise sigma / R and the
  same number of steps, i.e. the same noise per example (sigma / (q n)) as the target run at
  1/R of its compute. Such a tuning run has a much larger epsilon of its own (recorded); the
  target setting's epsilon is recorded beside it. Final runs never use TAN.
- features: ``scatter`` (ScatterNet J=2, L=8 computed once per data set,
  ``gep_fed.data.scatternet``; per-example GroupNorm; linear head, or ``--head cnn``) or
  ``raw`` (the tanh CNN ``gep_fed.data.models.MnistCNN`` on MNIST's images, ResNet20-GN on
  CIFAR-10's); ``--width w`` widens the ScatterNet CNN (channels 16w, 32w; hidden 32w) for
  issue 23's dimension sweep, and each run logs its number of trainable parameters;
- GEP's public anchors: KMNIST (the 10,000 test images; ``--num-public`` of them, seeded),
  through the same front end, with fresh random labels (``--anchor-labels true``: KMNIST's own).
  CIFAR-10: Tiny-ImageNet's 10,000 validation images at 32x32 (random labels only: their 200
  classes are not the model's 10).

Every finished run is appended to ``results/standard/<dataset>.jsonl`` (``--out DIR``: another
folder, e.g. for smoke tests) keyed by its settings and skipped when met again, so the benchmark
resumes across sessions; the table ``results/standard/<dataset>.md`` is rewritten from the whole
log after each run. Each record
keeps wall and CPU seconds. ``--budget-minutes`` stops starting runs after that much wall time.

    python benchmarks/standard.py --dataset mnist --epsilon 2 --methods gep gp opacus nonprivate \
        --stage tune --grid small --tan 8 --threads 1
    python benchmarks/standard.py --dataset mnist --epsilon 2 --stage final --grid small --tan 8
    python benchmarks/standard.py --dataset mnist --table-only
    python benchmarks/standard.py --dataset cifar10 --epsilon 8 --methods gep bgep gp opacus \
        nonprivate --stage tune --grid cifar --tan 8 --threads 1
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib
import json
import math
import os
import socket
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import standard_table
from common import RESULTS, SHARED_DATA
from standard_table import fmt_setting
from warm_refresh import warm_steps

from gep_fed import GEPConfig, PrivacyContract
from gep_fed.accounting import epsilon_pld, epsilon_rdp
from gep_fed.data.augment import crop_and_flip
from gep_fed.data.datasets import MNIST_MEAN, MNIST_STD, load_kmnist, load_mnist, to_tensor
from gep_fed.data.formats import DataError
from gep_fed.data.metrics import evaluate
from gep_fed.data.models import MnistCNN, resnet20_gn
from gep_fed.data.scatternet import scatter_cache_dir
from gep_fed.mechanisms import calibrate_noise_multiplier, mechanism_class
from gep_fed.mechanisms.multiplicity import AugmentationMultiplicity
from gep_fed.mechanisms.noise import NoiseSource
from gep_fed.training import Checkpoint, OptimizerConfig, train_nonprivate, train_private

DELTA = 1e-5
OUT = RESULTS / "standard"
METHODS = ("gep", "bgep", "gp", "opacus", "nonprivate")
PRIVATE = ("gep", "bgep", "gp", "opacus")

_IDX = {"public": "kmnist", "n_train": 60_000, "n_test": 10_000, "val_size": 10_000}
DATASETS = {
    # folder under the shared data; (mean, std) of [0, 1] pixels: the published constants,
    # used by the raw-pixel CNN only (ScatterNet features are scaled by 1/255 alone); public:
    # the anchors' data set; val_size: the default validation carve of the n_train images
    "mnist": {"folder": "mnist", "mean": MNIST_MEAN, "std": MNIST_STD, "title": "MNIST", **_IDX},
    "fmnist": {
        "folder": "fashion-mnist",
        "mean": 0.2860,
        "std": 0.3530,
        "title": "Fashion-MNIST",
        **_IDX,
    },
    # the library's cifar10 task: binary batches 1-2 (train), batch 5 (test)
    "cifar10": {
        "folder": "cifar10",
        "mean": None,
        "std": None,
        "title": "CIFAR-10",
        "public": "tinyimagenet",
        "n_train": 20_000,
        "n_test": 10_000,
        "val_size": 4_000,
    },
}

# (target epsilon, test accuracy to reach); None: the goal is not an accuracy (GOAL_TEXT)
GOALS = {"mnist": (2.0, 98.5), "fmnist": (3.0, 89.7), "cifar10": (8.0, None)}


GRIDS_FILE = Path(__file__).with_name("standard_grids.toml")
GRID_METHODS = ("gp", "gep", "bgep", "nonprivate")


def load_grids(path: Path = GRIDS_FILE) -> dict[tuple[str, str], dict[str, list[dict]]]:
    """The tuning grids of ``standard_grids.toml``, expanded and checked: every
    ``(features, grid)`` gives each method the same number of settings (Opacus runs GP's)."""
    import itertools
    import tomllib

    raw = tomllib.loads(path.read_text())
    grids = {}
    for features, by_name in raw.items():
        for name, methods in by_name.items():
            if sorted(methods) != sorted(GRID_METHODS):
                raise ValueError(f"{path}: grid {features}.{name} has methods {sorted(methods)}")
            grid = {}
            for method, spec in methods.items():
                if set(spec) - {"fixed", "axes"}:
                    raise ValueError(f"{path}: {features}.{name}.{method}: unknown keys")
                names = [axis.split("+") for axis in spec["axes"]]
                settings = []
                for values in itertools.product(*spec["axes"].values()):
                    setting = dict(spec.get("fixed", {}))
                    for keys, value in zip(names, values, strict=True):
                        setting.update(zip(keys, value if len(keys) > 1 else [value], strict=True))
                    settings.append(setting)
                grid[method] = settings
            grid["opacus"] = [dict(s) for s in grid["gp"]]
            sizes = {m: len(v) for m, v in grid.items()}
            if len(set(sizes.values())) != 1:
                raise ValueError(f"{path}: {features}.{name}: unequal tuning budgets {sizes}")
            grids[(features, name)] = grid
    return grids


GRIDS = load_grids()


# Issue 13's levers, measured on validation (TAN like the tuning) on top of each method's
# best tuned setting of the grid: the subspace also spanning past releases (GEP), averaging
# of the iterates (EMA; GEP and GP alike), S1 and S2 set at each subspace computation to the
# median embedding / residual norm of the public anchors (``clip_quantile``: privacy-free; a
# privately estimated quantile would cost budget), and GEP's own knobs beyond the grid (a
# larger k, a smaller residual clip), a public warm start (GEP and GP alike) and, on raw
# images, augmentation multiplicity (each example's gradient the mean over 4 random crops and
# flips of it, De et al. 2022; GEP and GP alike). Not tuning settings: never chosen for a final.
LEVERS = {
    "gep": (
        {"past": 10},
        {"past": 40},
        {"ema": 0.99},
        {"ema": 0.997},
        {"quantile": 0.5},
        {"private_quantile": 0.5},
        {"private_quantile": 0.8},
        {"private_quantile": 0.2},
        {"private_quantile": 0.95},
        # GEP's public knobs (no privacy cost): k, the anchors spanning it, how often it is
        # recomputed, and one subspace for the whole model instead of one per layer group
        {"k": 300},
        {"k": 2000},
        {"anchors": 1000},
        {"refresh": 5},
        {"refresh": 2},
        {"refresh": 1},  # the GEP paper's: a subspace every step
        {"param_groups": "one"},
        # issue 54: a cheap fresh subspace: the power method started from the last basis
        # (one pass), and with the previous refreshes' anchor covariance carried (memory)
        # so that a refresh can use a fifth of the anchors (benchmarks/warm_refresh.py)
        {"refresh": 5, "warm_memory": 0.0},
        {"refresh": 5, "anchors": 200, "warm_memory": 0.8},
        {"refresh": 5, "anchors": 200},
        {"refresh": 5, "anchors": 500, "warm_memory": 0.8},  # ResNet20-GN: k = 1000
        {"s2_ratio": 0.3},
        # issue 54: the paper's residual clip ratio (0.2) and below; GEP's noise relative to
        # DP-SGD's is about 2 (k/p + (S2/S1)^2) when every example is clipped in both parts
        {"s2_ratio": 0.2},
        {"s2_ratio": 0.1},
        {"s2_ratio": 0.8},  # the other way: 0.2 and 0.1 lost on Fashion-MNIST
        # issue 54: weight decay scaled with the step size, wd = lr_wd / lr (the paper's
        # ResNet20 recipe: lr 0.1 x wd 1e-4 = 1e-5; 1e-4: ten times that)
        {"lr_wd": 1e-5},
        {"lr_wd": 1e-4},
        {"s2_ratio": 0.2, "lr_wd": 1e-4},
        {"warm": 10},
        {"warm": 10, "warm_public": 10000},
        {"aug": 4},
    ),
    "gp": (
        {"lr_wd": 1e-5},
        {"lr_wd": 1e-4},
        {"ema": 0.99},
        {"ema": 0.997},
        {"warm": 10},
        {"warm": 10, "warm_public": 10000},
        {"aug": 4},
    ),
}


# GEP's parameter groups by name: the layer-aware default (input layer, each stage, output
# layer, as in the GEP paper) or every parameter in one group
PARAM_GROUPS = {"layers": None, "one": {"all": ["*"]}}


def lever_selected(lever: dict, wanted: list[str] | None, exact: bool = False) -> bool:
    """Whether ``--levers`` picks ``lever``: by a knob it sets (``refresh``) or by a knob and
    its value (``refresh=5``); no ``--levers`` picks every lever. ``exact``
    (``--lever-exact``): the items together name one lever, every knob and value of it
    (``s2_ratio=0.2 lr_wd=0.0001``), so that runs side by side each take one lever."""
    if wanted is None:
        return True
    if exact:
        pairs = dict(item.partition("=")[::2] for item in wanted)
        return pairs == {k: str(v) for k, v in lever.items()}
    for item in wanted:
        knob, _, value = item.partition("=")
        if knob in lever and (not value or str(lever[knob]) == value):
            return True
    return False


def lever_applies(args, lever: dict) -> bool:
    """Whether ``lever`` means anything for this run's inputs: crops and flips are of images,
    not of ScatterNet features."""
    return "aug" not in lever or args.features == "raw"


# ---------------------------------------------------------------------------------------------
# Data


def _cifar10(data_dir: Path) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """(images, labels) of train, test and public data as the library's ``cifar10`` task reads
    them: CIFAR-10 binary batches 1-2, batch 5, and Tiny-ImageNet's 32x32 validation images."""
    from gep_fed.data.builtin_tasks import Cifar10Task
    from gep_fed.data.task import TaskSettings

    task = Cifar10Task(TaskSettings(data_dir=str(data_dir), model="resnet20"))
    try:
        sets = (task.train_dataset(), task.eval_dataset(), task.public_dataset())
    except DataError as err:
        raise SystemExit(f"CIFAR-10 benchmark data: {err}") from err
    return tuple((ds.uint8_images(), ds.targets()) for ds in sets)


class Data:
    """The standard split of one data set, as tensors for the chosen front end, built lazily."""

    def __init__(self, args) -> None:
        self.args = args
        spec = DATASETS[args.dataset]
        if args.dataset == "cifar10":
            train, test, public = _cifar10(Path(args.data_dir))
        else:
            root = Path(args.data_dir) / spec["folder"]
            train, test = load_mnist(root, "train"), load_mnist(root, "test")
            kmnist = load_kmnist(Path(args.data_dir) / "kmnist")
            train, test, public = ((ds.images, ds.labels) for ds in (train, test, kmnist))
        n_train, n_test = spec["n_train"], spec["n_test"]
        if (len(train[0]), len(test[0])) != (n_train, n_test):
            raise SystemExit(
                f"{args.data_dir}: expected the standard {n_train:,} / {n_test:,} split of "
                f"{spec['title']}, got {len(train[0]):,} / {len(test[0]):,}"
            )
        if not 0 < args.val_size < n_train:
            raise SystemExit(f"--val-size must be in 1..{n_train - 1}, got {args.val_size}")
        # the anchors are the first --num-public of a fixed order; a warm start may take more
        self.public_order = np.random.default_rng(0).permutation(len(public[0]))
        if not 0 < args.num_public <= len(self.public_order):
            raise SystemExit(
                f"--num-public must be in 1..{len(self.public_order):,} (the public images), "
                f"got {args.num_public}"
            )
        self.pick = self.public_order[: args.num_public]
        perm = np.random.default_rng(args.split_seed).permutation(n_train)
        self.val_idx, self.fit_idx = perm[: args.val_size], perm[args.val_size :]
        self.labels = {
            "train": torch.from_numpy(train[1]),
            "test": torch.from_numpy(test[1]),
            "public": torch.from_numpy(public[1][self.pick]),
            "public_pool": torch.from_numpy(public[1]),
        }
        self.images = {"train": train[0], "test": test[0], "public": public[0]}
        self.spec = spec
        self._x: dict[str, torch.Tensor] = {}

    def _features(self, name: str) -> torch.Tensor:
        if name not in self._x:
            images = self.images[name]
            if self.args.features == "scatter":
                from gep_fed.data.scatternet import scatter_features

                began = time.perf_counter()
                x = scatter_features(images, cache_dir=self.args.cache_dir, progress=True)
                print(
                    f"scatter features {name}: {tuple(x.shape)} "
                    f"({time.perf_counter() - began:.0f} s)",
                    flush=True,
                )
            elif self.args.dataset == "cifar10":  # per channel, as the library's cifar10 task
                from gep_fed.data.builtin_tasks import CIFAR_MEAN, CIFAR_STD

                mean, std = (torch.tensor(c).view(1, 3, 1, 1) for c in (CIFAR_MEAN, CIFAR_STD))
                x = (to_tensor(images, 0.0, 1.0) - mean) / std
            else:
                x = to_tensor(images, self.spec["mean"], self.spec["std"])
            self._x[name] = x
        return self._x[name]

    def split(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        if name in ("fit", "val"):
            idx = torch.from_numpy(self.fit_idx if name == "fit" else self.val_idx)
            return self._features("train")[idx], self.labels["train"][idx]
        return self._features(name), self.labels[name]

    @property
    def public(self) -> torch.Tensor:
        """The held public images (the anchors' pool), ``--num-public`` of them."""
        return self._features("public")[torch.from_numpy(self.pick)]

    def public_images(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``count`` public images in the anchors' order, with their own labels."""
        if not 0 < count <= len(self.public_order):
            raise SystemExit(
                f"{count} public images asked for; there are {len(self.public_order):,}"
            )
        idx = torch.from_numpy(self.public_order[:count])
        return self._features("public")[idx], self.labels["public_pool"][idx]

    @property
    def feature_shape(self) -> tuple[int, ...]:
        return tuple(self._features("public").shape[1:])


def model_label(args) -> str:
    """The model as the log and the table name it: the head on ScatterNet features (``cnn-w4``:
    the CNN at width 4), or on raw pixels MNIST's CNN and CIFAR-10's ResNet20-GN."""
    if args.features == "raw":
        return "resnet20" if args.dataset == "cifar10" else "cnn"
    return args.head + (f"-w{args.width}" if args.width != 1 else "")


def build_model(args, data: Data, num_classes: int = 10) -> torch.nn.Module:
    if args.features == "raw":
        if args.dataset == "cifar10":
            return resnet20_gn(3, num_classes)
        return MnistCNN(num_classes=num_classes)
    from gep_fed.data.scatternet import scatter_cnn, scatter_linear

    if args.head == "linear":
        return scatter_linear(num_classes, data.feature_shape, groups=args.groups)
    return scatter_cnn(num_classes, data.feature_shape, groups=args.groups, width=args.width)


# ---------------------------------------------------------------------------------------------
# Accounting


@functools.lru_cache(maxsize=512)
def epsilons(
    mechanism: str, sigma: float, q: float, steps: int, count_noise: float | None = None
) -> tuple[float, float]:
    """(RDP, PLD) epsilon at DELTA of ``steps`` Poisson-sampled releases (with
    ``count_noise``: and the adaptive S2's noised counts)."""
    events = [mechanism_class(mechanism).event(sigma, q, steps, count_noise=count_noise)]
    return epsilon_rdp(events, DELTA), epsilon_pld(events, DELTA)


# Lever 5: the count of examples within S2 gets noise of std (expected batch) / 20, Andrew et
# al.'s choice ("Differentially Private Learning with Adaptive Clipping", NeurIPS 2021)
COUNT_NOISE_SHARE = 1 / 20


def schedule(n: int, batch: int, epochs: int) -> tuple[float, int]:
    """Sample rate q = 1/ceil(n/B) and steps = epochs * ceil(n/B)."""
    per_epoch = math.ceil(n / batch)
    return 1.0 / per_epoch, epochs * per_epoch


# ---------------------------------------------------------------------------------------------
# Opacus


def opacus_loader(x, y, batches: int, seed: int) -> torch.utils.data.DataLoader:
    """A DataLoader of ``len`` exactly ``batches``: Opacus takes its Poisson rate from
    1 / len(loader), and no batch size gives every length (50,000 examples in 392 batches).
    Only its length and dataset are used: Opacus replaces its sampler with Poisson sampling."""
    placeholder = torch.utils.data.BatchSampler(
        torch.utils.data.SequentialSampler(range(batches)), batch_size=1, drop_last=False
    )
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y),
        batch_sampler=placeholder,
        generator=torch.Generator().manual_seed(seed),
    )


class StepClock:
    """When each step of a run ended (the GPU synchronised first): its pace, as the first
    step (the device's warm-up; GEP's first subspace), the mean of the later ones, and, once a
    run has more than one epoch, its last epoch (one subspace refresh a epoch in these grids,
    no warm-up): the pace ``full_length.py`` plans with."""

    def __init__(
        self, device: torch.device, steps_per_epoch: int, steps: int = 0, report: float = 300.0
    ) -> None:
        self.device = torch.device(device)
        self.steps_per_epoch = steps_per_epoch
        self.steps = steps
        self.start = time.perf_counter()
        self.ends: list[float] = []
        self.report, self.reported = report, self.start

    def tick(self, step: int | None = None, *_) -> None:
        """After step ``step`` (counted from 1 over the whole run, a resumed one too; None:
        the steps of this process)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.ends.append(now)
        step = step or len(self.ends)
        if self.steps and now - self.reported >= self.report:  # progress on long runs
            self.reported = now
            left = (self.steps - step) * (now - self.start) / len(self.ends)
            print(
                f"  step {step} of {self.steps}, about {left / 60:.0f} min left",
                flush=True,
            )

    def pace(self) -> dict:
        if not self.ends:
            return {}
        first = self.ends[0] - self.start
        later = (self.ends[-1] - self.ends[0]) / max(1, len(self.ends) - 1)
        pace = {"first_step_seconds": first, "later_step_seconds": later if later else first}
        if len(self.ends) > self.steps_per_epoch:
            pace["last_epoch_seconds"] = self.ends[-1] - self.ends[-1 - self.steps_per_epoch]
        return pace


def train_opacus_poisson(
    model, x, y, sigma, clip, q, steps, opt_cfg, seed, max_physical, on_step=None
):
    """DP-SGD with Opacus' PrivacyEngine at a given sigma: its DPDataLoader (Poisson sampling
    at 1 / len(loader) = q), per-sample gradients by its hooks, physical batches of at most
    ``max_physical`` (BatchMemoryManager), each copied to the model's device; ``on_step()``
    after each step. Returns (model, Opacus' own RDP epsilon)."""
    from opacus import PrivacyEngine
    from opacus.utils.batch_memory_manager import BatchMemoryManager

    batches = round(1 / q)
    if abs(batches * q - 1) > 1e-9:
        raise ValueError(f"Opacus needs q = 1 / an integer, got {q}")
    loader = opacus_loader(x, y, batches, seed)
    device = next(model.parameters()).device
    opt, lr_schedule = opt_cfg.make(model, steps)
    engine = PrivacyEngine(accountant="rdp", secure_mode=False)
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=loader,
        noise_multiplier=sigma,
        max_grad_norm=clip,
        poisson_sampling=True,
        # Opacus draws its noise where the gradients are, with this generator
        noise_generator=torch.Generator(device).manual_seed(seed + 1),
    )
    done = 0
    with BatchMemoryManager(
        data_loader=loader, max_physical_batch_size=max_physical, optimizer=opt
    ) as memory_safe:
        while done < steps:
            for xb, yb in memory_safe:
                opt.zero_grad(set_to_none=True)
                if len(xb):
                    F.cross_entropy(model(xb.to(device)), yb.to(device)).backward()
                opt.step()
                if not opt._is_last_step_skipped:
                    lr_schedule.step()
                    done += 1
                    if on_step is not None:
                        on_step()
                    if done == steps:
                        break
    if abs(engine.accountant.history[-1][1] - q) > 1e-12:
        raise RuntimeError(f"Opacus accounted q = {engine.accountant.history[-1][1]}, not {q}")
    return model, engine.get_epsilon(DELTA)


# ---------------------------------------------------------------------------------------------
# The GEP paper's protocol (issue 54): for comparison only, never a default


PROTOCOLS = {
    "honest": "Poisson sampling, GEP accounted as one Gaussian of sensitivity sqrt(2) "
    "(joint release), the final model tested once",
    "paper-accounting": "the official GEP code's accounting alone (two independent subsampled "
    "Gaussians: RDP of one at (q, sigma, T), doubled); Poisson sampling, the final model "
    "tested once",
    "paper": "the official GEP code's protocol: its accounting (two independent subsampled "
    "Gaussians: RDP of one at (q, sigma, T), doubled), shuffled fixed-size batches (each "
    "epoch a random permutation cut into ceil(n / B) batches; accounted as if Poisson), and "
    "the best test accuracy over the epochs reported",
}


def paper_sigma(epsilon: float, q: float, steps: int, method: str) -> float:
    """sigma as the official GEP code calibrates it: RDP (dp-accounting) of one Poisson-
    subsampled Gaussian at (q, sigma, steps), doubled for GEP's two releases
    (``compute_rdp(q, sigma, T, orders) * 2``), i.e. one subsampled Gaussian at sigma for 2T
    steps. The joint release has sensitivity sqrt(2) per example; accounting it as two
    independent mechanisms understates epsilon (``epsilons(method, sigma, q, steps)`` gives
    the true one). GP's accounting is the same either way."""
    releases = 2 if method == "gep" else 1
    return calibrate_noise_multiplier(epsilon, DELTA, q, releases * steps, "gp")


def paper_epsilon(sigma: float, q: float, steps: int, method: str) -> float:
    """The RDP epsilon the official GEP code reports for ``sigma`` (``paper_sigma``'s)."""
    releases = 2 if method == "gep" else 1
    return epsilons("gp", sigma, q, releases * steps)[0]


def train_shuffled(
    model, x, y, public, config, steps, per_epoch, opt_cfg, seed, public_labels, evaluate_fn
):
    """The official GEP code's loop: each epoch a random permutation of the data cut into
    ``per_epoch`` batches of fixed size (about q n each: the expected batch of the Poisson
    runs, which GEPStep divides by), a private step on each; the model tested after each
    epoch. Returns (final accuracy, [accuracy after each epoch]). No privacy claim: shuffled
    batches are not Poisson samples, and testing every epoch to pick the best uses the test set."""
    from gep_fed.mechanisms.step import GEPStep

    step = GEPStep(
        model,
        public,
        config,
        dataset_size=len(x),
        public_labels=public_labels,
        noise=NoiseSource(seed + 1),
        generator=torch.Generator().manual_seed(seed),
    )
    opt, sched = opt_cfg.make(model, steps)
    order = torch.Generator().manual_seed(seed + 3)
    history = []
    for _ in range(steps // per_epoch):
        for idx in torch.tensor_split(torch.randperm(len(x), generator=order), per_epoch):
            opt.zero_grad(set_to_none=True)
            step(x[idx], y[idx])
            opt.step()
            sched.step()
        history.append(evaluate_fn(model)["accuracy"])
    return history[-1], history


# ---------------------------------------------------------------------------------------------
# One run


# A public warm start depends on public data alone: it is computed once per model, lever and
# count, from the model as a seed-0 run initialises it, and shared by every seed of the private
# training (whose spread the seeds then measure) and kept under --warm-cache.
WARM_SEED = 0


def warm_start(args, model: torch.nn.Module, data: Data, setting: dict) -> None:
    """Lever 1: pre-train for ``setting["warm"]`` epochs on public images with their own labels
    (no private data, no privacy cost) before private training: the held anchors, or the
    first ``setting["warm_public"]`` of the public pool (a superset of them). The model's
    weights are replaced by the warm-started ones (``public_warm_start``), kept for reuse."""
    count = setting.get("warm_public", args.num_public)
    cached = warm_cache_path(args, data, setting["warm"], count)
    if cached.exists():
        print(f"warm start from {cached}", flush=True)
    else:
        state = public_warm_start(args, data, setting["warm"], count, cached.parent)
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_suffix(f".{os.getpid()}.partial")  # runs side by side may race
        torch.save(state, partial)
        partial.replace(cached)
    model.load_state_dict(torch.load(cached, map_location="cpu", weights_only=True))


def public_warm_start(args, data: Data, epochs: int, count: int, cache: Path) -> dict:
    """The model initialised as a seed-0 run does, trained for ``epochs`` on the first
    ``count`` public images: KMNIST's 10 classes train the model itself; Tiny-ImageNet's 200
    train a 200-way twin, whose tensors of the model's shapes (all but the classifier) then
    replace the model's."""
    x, y = data.public_images(count)
    flat = x.flatten(1)
    blank = int((flat.amax(1) == flat.amin(1)).sum())
    if blank:
        raise SystemExit(
            f"warm start: {blank} of the {count:,} public images are blank (one value "
            "throughout): a data folder unpacked by device_data.py holds only the anchors. "
            f"Compute this warm start where all the images are, and carry {cache}"
        )
    classes = int(y.max()) + 1
    with torch.random.fork_rng():
        torch.manual_seed(WARM_SEED)
        model = build_model(args, data)
        twin = model if classes == 10 else build_model(args, data, num_classes=classes)
    train_nonprivate(
        twin,
        x,
        y,
        epochs * math.ceil(len(x) / 256),
        256,
        OptimizerConfig(lr=0.01, momentum=0.9),
        generator=torch.Generator().manual_seed(WARM_SEED),
    )
    own = model.state_dict()
    return {k: v if v.shape == own[k].shape else own[k] for k, v in twin.state_dict().items()}


def warm_cache_path(args, data: Data, epochs: int, count: int) -> Path:
    """Where a public warm start is kept, under ``--warm-cache``: it depends on public data
    alone, so every run of the same model, count and epochs reuses it. The key holds
    the public labels and their order, not the pixels, so that a machine holding only the
    anchors (``device_data.py``) can use a warm start computed where all the images are."""
    idx = data.public_order[:count]
    h = hashlib.sha256()
    h.update(
        json.dumps(
            ["warm-v1", args.dataset, args.features, model_label(args), epochs, count, WARM_SEED]
        ).encode()
    )
    h.update(np.ascontiguousarray(idx).tobytes())
    h.update(data.labels["public_pool"][torch.from_numpy(idx)].numpy().tobytes())
    return Path(args.warm_cache) / f"{h.hexdigest()[:20]}.pt"


def weight_decay(setting: dict) -> float:
    """The setting's weight decay: ``lr_wd / lr`` where it has ``lr_wd`` (issue 54's lever:
    the decay scaled with the step size, so that their product, the shrink per step, is
    fixed; it replaces a grid's ``wd``), else ``wd``."""
    if "lr_wd" in setting:
        return setting["lr_wd"] / setting["lr"]
    return setting.get("wd", 0.0)


def optimizer_config(setting: dict) -> OptimizerConfig:
    """SGD with momentum 0.9 at the setting's ``lr``; weight decay (``wd``, or ``lr_wd``
    divided by ``lr``) and ``decay_at`` (the fraction of the steps after which the learning
    rate drops tenfold) when it has them, as the GEP paper's ResNet20 recipe does. Every
    method, Opacus included, uses it."""
    return OptimizerConfig(
        lr=setting["lr"],
        momentum=0.9,
        weight_decay=weight_decay(setting),
        decay_at=setting.get("decay_at"),
    )


def multiplicity(args, setting: dict) -> tuple[AugmentationMultiplicity | None, tuple]:
    """The ``aug`` lever: random crops (4 pixels, reflected) and flips, drawn from the run's
    seed (the augmentation's randomness has no privacy meaning), and the generator they are
    drawn from (saved with the run's checkpoints)."""
    if not setting.get("aug"):
        return None, ()
    draws = torch.Generator().manual_seed(args.seed + 2)
    augment = functools.partial(crop_and_flip, padding=4, generator=draws)
    return AugmentationMultiplicity(setting["aug"], augment), (draws,)


def checkpoint(args, method: str, setting: dict, stage: str, generators: tuple) -> Checkpoint:
    """Where a run keeps its state every ``--checkpoint-minutes`` under ``--checkpoints``, so
    that a run cut off by a session's end resumes there (a file per run key)."""
    name = hashlib.sha256(run_key(args, method, setting, stage).encode()).hexdigest()[:24]
    path = Path(args.checkpoints) / f"{name}.ckpt"
    return Checkpoint(path, 60 * args.checkpoint_minutes, generators)


def run_one(args, data: Data, method: str, setting: dict, stage: str) -> dict:
    train_key, eval_key = ("fit", "val") if stage == "tune" else ("train", "test")
    x, y = data.split(train_key)
    eval_xy = data.split(eval_key)
    n = len(x)
    torch.manual_seed(args.seed)
    model = build_model(args, data)
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if setting.get("warm"):
        warm_start(args, model, data, setting)
    model.to(args.device)
    opt = optimizer_config(setting)
    q, steps = schedule(n, setting["batch"], setting["epochs"])
    rec = {"n_train": n, "n_eval": len(eval_xy[0]), "steps": steps, "params": params}
    wall, cpu = time.perf_counter(), time.process_time()
    if method == "nonprivate":
        res = train_nonprivate(
            model,
            x,
            y,
            steps,
            setting["batch"],
            opt,
            generator=torch.Generator().manual_seed(args.seed),
            evaluate_fn=lambda m: evaluate(m, eval_xy, "multiclass"),
        )
        accuracy = res.accuracy
        rec.update(sigma=0.0, q=None, epsilon_rdp=None, epsilon_pld=None)
    else:
        mech = "gp" if method == "opacus" else method
        tan = args.tan if stage == "tune" else 1
        adaptive = setting.get("private_quantile")  # S2 from an accounted, noised count
        count_target = None if adaptive is None else q * n * COUNT_NOISE_SHARE
        protocol = args.protocol if stage == "final" else "honest"
        if protocol != "honest":
            if adaptive is not None or method not in ("gep", "gp"):
                raise SystemExit(f"--protocol {protocol}: GEP and GP, fixed clips, only")
            sigma_target = paper_sigma(args.epsilon, q, steps, mech)
            rec.update(
                protocol=protocol,
                protocol_text=PROTOCOLS[protocol],
                epsilon_paper_accounting=paper_epsilon(sigma_target, q, steps, mech),
            )
        else:
            sigma_target = calibrate_noise_multiplier(
                args.epsilon, DELTA, q, steps, mech, count_noise=count_target
            )
        sigma, q_run = sigma_target / tan, q / tan
        count_run = None if adaptive is None else count_target / tan  # TAN: same per example
        rec.update(
            sigma=sigma,
            q=q_run,
            expected_batch=q_run * n,
            tan=tan,
            target={"sigma": sigma_target, "q": q, "expected_batch": q * n},
        )
        clock = StepClock(args.device, steps // setting["epochs"], steps)
        if method == "opacus":
            model, rec["epsilon_opacus_rdp"] = train_opacus_poisson(
                model,
                x,
                y,
                sigma,
                setting["clip"],
                q_run,
                steps,
                opt,
                args.seed,
                args.max_chunk,
                clock.tick,
            )
            accuracy = evaluate(model, eval_xy, "multiclass")["accuracy"]
        else:
            s1 = setting["clip"]
            config = GEPConfig(
                PrivacyContract(
                    method,
                    sigma,
                    q_run,
                    clip_embedding=s1,
                    clip_residual=s1 * setting.get("s2_ratio", 1.0),
                    clip_norm=s1,
                ),
                num_basis=setting.get("k", 1),
                num_anchors=setting.get("anchors"),
                anchor_labels=args.anchor_labels,
                basis_refresh=setting.get("refresh", 1),
                past_releases=setting.get("past", 0),
                clip_quantile=setting.get("quantile"),
                residual_quantile=adaptive,
                quantile_count_noise=count_run,
                max_chunk=args.max_chunk,
                groups=PARAM_GROUPS[setting.get("param_groups", "layers")],
            )
            augmentation, augmentation_draws = multiplicity(args, setting)
            if protocol == "paper":
                if augmentation is not None or setting.get("ema"):
                    raise SystemExit("--protocol paper: no aug or ema lever")
                accuracy, history = train_shuffled(
                    model,
                    x,
                    y,
                    data.public,
                    config,
                    steps,
                    steps // setting["epochs"],
                    opt,
                    args.seed,
                    data.labels["public"] if args.anchor_labels == "true" else None,
                    lambda m: evaluate(m, eval_xy, "multiclass"),
                )
                rec.update(
                    epoch_accuracies=history,
                    best_epoch_accuracy=max(history),
                    best_epoch=1 + history.index(max(history)),
                    sampling="shuffled",
                )
            saves = checkpoint(args, method, setting, stage, augmentation_draws)
            if protocol != "paper":
                if saves.path.exists():
                    print(f"  resuming from {saves.path}", flush=True)
                with warm_steps(setting.get("warm_memory")):
                    result = train_private(
                        model,
                        x,
                        y,
                        data.public,
                        config,
                        steps,
                        opt,
                        delta=DELTA,
                        generator=torch.Generator().manual_seed(args.seed),
                        noise=NoiseSource(args.seed + 1),
                        public_labels=data.labels["public"]
                        if args.anchor_labels == "true"
                        else None,
                        average_iterates=setting.get("ema"),
                        multiplicity=augmentation,
                        evaluate_fn=lambda m: evaluate(m, eval_xy, "multiclass"),
                        on_step=clock.tick,
                        checkpoint=saves,
                    )
                accuracy, ledger = result.accuracy, result.ledger
                if result.resumed_at:  # the seconds and the pace are of the later steps only
                    rec["resumed_at_step"] = result.resumed_at
                rec["ledger_epsilon_rdp"] = ledger.epsilon()
        rec.update(clock.pace())
        rec["epsilon_rdp"], rec["epsilon_pld"] = epsilons(mech, sigma, q_run, steps, count_run)
        if tan != 1:
            rec["target"]["epsilon_rdp"], rec["target"]["epsilon_pld"] = epsilons(
                mech, sigma_target, q, steps, count_target
            )
    rec.update(
        accuracy=accuracy,
        seconds=time.perf_counter() - wall,
        cpu_seconds=time.process_time() - cpu,
        threads=torch.get_num_threads(),
        device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
    )
    return rec


# ---------------------------------------------------------------------------------------------
# The log and the table


def write_table(dataset: str, out: Path = OUT) -> Path:
    """``dataset``'s table from its log (``standard_table.write_table``), with the table code
    as it is now: a run of hours must not write the table with the code it started with."""
    importlib.reload(standard_table)
    return standard_table.write_table(
        dataset,
        read_log(dataset, out, superseded=True),
        DATASETS[dataset],
        GOALS[dataset],
        log_path(dataset, out),
        Path(out) / f"{dataset}.md",
    )


def log_path(dataset: str, out: Path = OUT) -> Path:
    return Path(out) / f"{dataset}.jsonl"


def read_log(dataset: str, out: Path = OUT, *, superseded: bool = False) -> list[dict]:
    """The logged runs in log order. A run marked ``superseded`` (with the reason: a defect
    fixed since that changed its result) stays in the log but is returned only with
    ``superseded=True``: it is neither skipped on a rerun nor chosen nor tabulated as a result."""
    path = log_path(dataset, out)
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return records if superseded else [r for r in records if not r.get("superseded")]


def run_key(args, method: str, setting: dict, stage: str) -> str:
    """What makes a run: everything that changes its result (the log is keyed by it)."""
    key = {
        "stage": stage,
        "dataset": args.dataset,
        "features": args.features,
        "head": model_label(args),
        "groups": args.groups if args.features == "scatter" else None,
        "method": method,
        "epsilon": None if method == "nonprivate" else args.epsilon,
        "setting": setting,
        "seed": args.seed,
        "split_seed": args.split_seed,
        "val_size": args.val_size,
        "tan": args.tan if (stage == "tune" and method in PRIVATE) else 1,
    }
    if stage == "final" and getattr(args, "protocol", "honest") != "honest":
        key["protocol"] = args.protocol  # honest runs keep their keys
    if method in ("gep", "bgep"):
        key["anchors"] = {
            "public": DATASETS[args.dataset]["public"],
            "num_public": args.num_public,
            "labels": args.anchor_labels,
        }
    return json.dumps(key, sort_keys=True)


# ---------------------------------------------------------------------------------------------


def final_length(args, setting: dict) -> tuple[dict, dict]:
    """A validation winner's setting for its final run, and what the record adds: with
    ``--final-epochs``, the same setting at another length (sigma is calibrated for the new
    steps; the table keeps such runs apart from the grid's, by ``tuned_epochs``)."""
    if args.final_epochs is None:
        return setting, {}
    return {**setting, "epochs": args.final_epochs}, {"tuned_epochs": setting["epochs"]}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", choices=list(DATASETS), default="mnist")
    ap.add_argument(
        "--methods", nargs="+", choices=METHODS, default=["gep", "gp", "opacus", "nonprivate"]
    )
    ap.add_argument(
        "--epsilon",
        type=float,
        default=None,
        help="target epsilon (default: the goal's, 2 for MNIST, 3 for FMNIST, 8 for CIFAR-10)",
    )
    ap.add_argument("--features", choices=("scatter", "raw"), default="scatter")
    ap.add_argument(
        "--head", choices=("linear", "cnn"), default="linear", help="model on ScatterNet features"
    )
    ap.add_argument("--groups", type=int, default=27, help="GroupNorm groups on the features")
    ap.add_argument(
        "--width",
        type=int,
        default=1,
        help="with --head cnn: channels (16w, 32w) and hidden 32w (the dimension sweep)",
    )
    ap.add_argument(
        "--grid",
        default="small",
        help="which tuning grid: small, main, main2, full (scatter), cifar, small (raw)",
    )
    ap.add_argument(
        "--stage",
        choices=("tune", "final", "all", "levers"),
        default="all",
        help="levers: measure LEVERS on validation on each method's best tuned setting",
    )
    ap.add_argument(
        "--tan",
        type=int,
        default=None,
        help="tune at batch/R and sigma/R, same steps (TAN); 1: tune at full cost (default 1; "
        "with --stage final or levers: the TAN the grid was tuned at, read from the log)",
    )
    ap.add_argument(
        "--num-public",
        type=int,
        default=2000,
        help="public anchors held (KMNIST; Tiny-ImageNet for CIFAR-10)",
    )
    ap.add_argument("--anchor-labels", choices=("random", "true"), default="random")
    ap.add_argument(
        "--val-size",
        type=int,
        default=None,
        help="validation images carved from the training images (default: 10,000 for MNIST "
        "and Fashion-MNIST, 4,000 for CIFAR-10)",
    )
    ap.add_argument("--split-seed", type=int, default=0)
    ap.add_argument(
        "--seed",
        type=int,
        default=0,
        help="of the Poisson samples and the noise (with --stage final or levers, the grid's "
        "winner is read at seed 0, where the grid was tuned, and retrained or run again beside "
        "its levers at this seed: the spread of a chosen setting over seeds)",
    )
    ap.add_argument(
        "--max-chunk",
        type=int,
        default=1024,
        help="per-example gradients at once (memory bound; Opacus physical batch)",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the model trains (the data stays on the CPU; batches are copied over)",
    )
    ap.add_argument(
        "--final-epochs",
        type=int,
        default=None,
        help="with --stage final (or levers --lever-final): retrain each method's validation "
        "winner for this many epochs instead of its tuned number (a full-length run; sigma is "
        "calibrated for its steps)",
    )
    ap.add_argument(
        "--budget-minutes",
        type=float,
        default=None,
        help="start no run after this many wall minutes",
    )
    ap.add_argument(
        "--only",
        type=int,
        nargs="+",
        default=None,
        help="tune only these indices of each method's grid",
    )
    ap.add_argument("--data-dir", default=str(SHARED_DATA))
    ap.add_argument(
        "--cache-dir", default=str(scatter_cache_dir()), help="ScatterNet feature cache"
    )
    ap.add_argument(
        "--out", default=str(OUT), help="folder of the log and the table (e.g. for smoke tests)"
    )
    ap.add_argument(
        "--warm-cache",
        default=str(scatter_cache_dir().parent / "warm"),
        help="public warm starts, kept for reuse (public data only: no privacy cost)",
    )
    ap.add_argument(
        "--checkpoints",
        default=str(scatter_cache_dir().parent / "checkpoints"),
        help="where GEP and GP runs keep their state, to resume where a cut-off run stopped",
    )
    ap.add_argument(
        "--checkpoint-minutes",
        type=float,
        default=5.0,
        help="minutes between a run's checkpoints",
    )
    ap.add_argument(
        "--protocol",
        choices=list(PROTOCOLS),
        default="honest",
        help="final runs only, for comparison, never a result: 'paper' runs the official GEP "
        "code's protocol (its accounting of GEP as two independent subsampled Gaussians, "
        "shuffled fixed-size batches, the best test accuracy over epochs reported, each "
        "labelled); 'paper-accounting' its accounting alone. Default: honest",
    )
    ap.add_argument("--table-only", action="store_true")
    ap.add_argument(
        "--levers",
        nargs="+",
        default=None,
        metavar="KNOB[=VALUE]",
        help="with --stage levers: only the levers that set one of these knobs (e.g. warm ema), "
        "or set it to this value (e.g. refresh=5)",
    )
    ap.add_argument(
        "--grid-tan",
        type=int,
        default=None,
        metavar="R",
        help="with --stage levers: the TAN the grid was tuned at (default: --tan if given, "
        "else read from the log); at another --tan the grid's winner and its levers run at "
        "that TAN (--tan 1: the real batch)",
    )
    ap.add_argument(
        "--logged-levers",
        action="store_true",
        help="with --lever-final: choose among the levers already logged, run no new one",
    )
    ap.add_argument(
        "--lever-exact",
        action="store_true",
        help="with --levers: the items together name one lever exactly (each knob=value)",
    )
    ap.add_argument(
        "--lever-final",
        action="store_true",
        help="with --stage levers: test the best lever setting if it beat the grid on validation",
    )

    args = ap.parse_args(argv)
    if args.epsilon is None:
        args.epsilon = GOALS[args.dataset][0]
    if args.val_size is None:
        args.val_size = DATASETS[args.dataset]["val_size"]
    if args.stage in ("tune", "all") or args.table_only:
        args.tan = 1 if args.tan is None else args.tan
    if args.grid_tan is None:
        args.grid_tan = args.tan  # None: read from the log (``resolve_grid_tan``)
    if args.lever_exact and not any(
        lever_selected(lever, args.levers or [], True)
        for levers in LEVERS.values()
        for lever in levers
    ):
        raise SystemExit(f"--lever-exact --levers {' '.join(args.levers or [])}: no such lever")
    for item in args.levers or ():
        if not any(lever_selected(lever, [item]) for levers in LEVERS.values() for lever in levers):
            known = sorted(
                {f"{k}={v}" for levers in LEVERS.values() for lv in levers for k, v in lv.items()}
            )
            raise SystemExit(
                f"--levers {item}: no lever sets that; the levers are {', '.join(known)}"
            )
    if not args.checkpoint_minutes > 0:
        raise SystemExit(f"--checkpoint-minutes must be > 0, got {args.checkpoint_minutes}")
    if args.lever_final and None not in (args.tan, args.grid_tan):
        check_lever_final(args)
    final = args.stage == "final" or (args.stage == "levers" and args.lever_final)
    if args.protocol != "honest" and not (final and set(args.methods) <= {"gep", "gp"}):
        raise SystemExit(
            f"--protocol {args.protocol}: final runs of gep and gp only (--stage final, or "
            "--stage levers --lever-final, --methods gep gp)"
        )
    if args.final_epochs is not None and (args.final_epochs < 1 or not final):
        raise SystemExit(
            f"--final-epochs {args.final_epochs}: a number of epochs >= 1, with --stage final "
            "or --stage levers --lever-final"
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: PyTorch sees no CUDA device here")
    if args.width < 1 or (args.width != 1 and (args.features, args.head) != ("scatter", "cnn")):
        raise SystemExit(f"--width {args.width}: a width >= 1 of --head cnn on scatter features")
    if args.dataset == "cifar10" and not args.table_only and args.anchor_labels == "true":
        raise SystemExit(
            "--anchor-labels true is not supported for cifar10: the Tiny-ImageNet anchors' "
            "labels are 200 classes, the model has 10 outputs; use --anchor-labels random"
        )
    return args


def check_lever_final(args) -> None:
    """``--lever-final`` needs the TAN the grid was tuned at: levers are chosen at seed 0 and
    that TAN; at another seed the final retrains the lever chosen at seed 0 (the spread of
    the chosen setting over seeds)."""
    if args.tan != args.grid_tan:
        raise SystemExit(
            f"--lever-final with --tan {args.tan}: levers are chosen at seed 0 and TAN "
            f"{args.grid_tan}, where the grid was tuned; another TAN measures whether the "
            "tuning scale holds"
        )


def grid_tans(args, grids: dict, done: dict) -> dict[int, int]:
    """For each TAN the log holds seed-0 tuning runs of this grid at: how many of the
    requested methods' grid runs it holds."""
    found = {json.loads(k).get("tan", 1) for k, r in done.items() if r.get("stage") == "tune"}
    counts = {}
    for tan in sorted(found | {1}):
        grid_args = argparse.Namespace(**{**vars(args), "seed": 0, "tan": tan})
        counts[tan] = sum(
            run_key(grid_args, method, s, "tune") in done
            for method in args.methods
            for s in grids[method]
        )
    return counts


def resolve_grid_tan(args, grids: dict, done: dict) -> None:
    """With ``--stage final`` or ``levers`` and no ``--tan`` / ``--grid-tan``: the TAN the
    grid was tuned at, read from the log (the TAN holding the most of its runs), so that a
    command without ``--tan 8`` finds a grid tuned at TAN 8 instead of reporting it empty.
    Lever runs then run at that TAN too (``--tan 1`` asks for the real batch)."""
    if args.grid_tan is None:
        counts = grid_tans(args, grids, done)
        args.grid_tan = max(counts, key=lambda tan: (counts[tan], tan == 1))
        if counts[args.grid_tan]:
            print(
                f"grid {args.grid!r} found tuned at TAN {args.grid_tan} "
                f"({counts[args.grid_tan]} runs of {', '.join(args.methods)})",
                flush=True,
            )
    if args.tan is None:
        args.tan = args.grid_tan
    if args.lever_final:
        check_lever_final(args)


def main(argv=None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.table_only:
        print(write_table(args.dataset, out_dir).read_text())
        return 0
    torch.set_num_threads(args.threads)
    grid_name = (args.features, args.grid)
    if grid_name not in GRIDS:
        raise SystemExit(f"no grid {args.grid!r} for features {args.features!r}")
    grids = GRIDS[grid_name]
    done = {r["key"]: r for r in read_log(args.dataset, out_dir)}
    if args.stage in ("final", "levers"):
        resolve_grid_tan(args, grids, done)
    data = Data(args)
    began = time.perf_counter()

    def out_of_time() -> bool:
        return (
            args.budget_minutes is not None
            and time.perf_counter() - began > 60 * args.budget_minutes
        )

    def run(method: str, setting: dict, stage: str, extra: dict | None = None) -> dict | None:
        key = run_key(args, method, setting, stage)
        if key in done:
            return done[key]
        if out_of_time():
            return None
        print(f"{stage} {method} {fmt_setting(method, setting)} ...", flush=True)
        out = run_one(args, data, method, setting, stage)
        rec = {
            "key": key,
            "stage": stage,
            "dataset": args.dataset,
            "features": args.features,
            "head": model_label(args),
            "method": method,
            "epsilon": None if method == "nonprivate" else args.epsilon,
            "grid": args.grid,
            "setting": setting,
            "seed": args.seed,
            **(extra or {}),
            **out,
            "host": socket.gethostname(),
            "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        with open(log_path(args.dataset, out_dir), "a") as fh:
            fh.write(json.dumps(rec) + "\n")
        done[key] = rec
        eps = (
            ""
            if rec["epsilon_rdp"] is None
            else (f" eps rdp {rec['epsilon_rdp']:.3f} pld {rec['epsilon_pld']:.3f}")
        )
        print(
            f"  -> acc {rec['accuracy']:.4f}{eps} sigma {rec['sigma']:.3f} "
            f"{rec['seconds']:.0f} s wall / {rec['cpu_seconds']:.0f} s CPU",
            flush=True,
        )
        write_table(args.dataset, out_dir)
        return rec

    levers_stage = args.stage == "levers"
    for method in args.methods:
        grid = grids[method]
        chosen = [(i, s) for i, s in enumerate(grid) if args.only is None or i in args.only]
        tuned = []
        if args.stage in ("tune", "all"):
            tuned = [run(method, s, "tune") for _, s in chosen]
        else:
            # the grid is tuned once, at seed 0 (levers: at TAN --grid-tan); another seed
            # retrains its winner, or runs it again beside its levers
            grid_args = argparse.Namespace(
                **{**vars(args), "seed": 0, "tan": args.grid_tan if levers_stage else args.tan}
            )
            keys = [run_key(grid_args, method, s, "tune") for s in grid]
            tuned = [done[k] for k in keys if k in done]
        tuned = [r for r in tuned if r is not None]
        if args.stage in ("final", "all", "levers"):
            complete = len(tuned) == len(grid)
            if not complete:
                print(
                    f"{method}: {len(tuned)}/{len(grid)} tuning runs of grid {args.grid!r} "
                    "done; no final run until the grid is complete",
                    flush=True,
                )
                continue
            best = max(tuned, key=lambda r: r["accuracy"])
            if levers_stage:
                wanted = [
                    lever
                    for lever in LEVERS.get(method, ())
                    if lever_selected(lever, args.levers, args.lever_exact)
                    and lever_applies(args, lever)
                ]
                if args.lever_final and (args.seed != 0 or args.logged_levers):
                    # the levers run at seed 0 (logged), the winner retrained at this seed
                    tried = [
                        done.get(run_key(grid_args, method, {**best["setting"], **lever}, "tune"))
                        for lever in wanted
                    ]
                else:
                    if (args.seed, args.tan) != (0, args.grid_tan):  # the base, beside levers
                        run(method, best["setting"], "tune", {"beside_levers": True})
                    tried = [
                        run(
                            method,
                            {**best["setting"], **lever},
                            "tune",
                            {"lever": lever, "base": best["setting"]},
                        )
                        for lever in wanted
                    ]
                tried = [r for r in tried if r is not None]
                winner = max(tried, key=lambda r: r["accuracy"], default=None)
                if args.lever_final and winner and winner["accuracy"] > best["accuracy"]:
                    # the grid plus its levers, chosen on validation, tested once
                    setting, extra = final_length(args, winner["setting"])
                    run(
                        method,
                        setting,
                        "final",
                        {
                            "chosen_val_accuracy": winner["accuracy"],
                            "tuned_runs": len(tuned) + len(tried),
                            "lever": winner["lever"],
                            **extra,
                        },
                    )
                elif args.lever_final:
                    print(
                        f"{method}: no lever beat the grid on validation; no lever final",
                        flush=True,
                    )
                continue
            setting, extra = final_length(args, best["setting"])
            run(
                method,
                setting,
                "final",
                {
                    "chosen_val_accuracy": best["accuracy"],
                    "tuned_runs": len(tuned),
                    "tuning_cpu_seconds": sum(r["cpu_seconds"] for r in tuned),
                    **extra,
                },
            )
    path = write_table(args.dataset, out_dir)
    print(path.read_text())
    if out_of_time():
        print("stopped at the time budget; rerun the same command to continue", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

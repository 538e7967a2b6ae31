"""A site's noised validation score: how a model is scored without a server's own
validation data (``gep-fed tune --site-validation``).

A site that agrees holds out a share of its examples, each by its own secret coin, drawn
once for each run (independent of the data: a neighbouring data set differs in one example,
which lands in the training part or the held-out part, never both). After a trial, it counts, per
class, its held-out examples and those the model predicts right, adds Gaussian noise of its
own standard deviation to each count, and releases the counts. One example changes its
class's two counts by at most one each: L2 sensitivity sqrt(2), so the release is a Gaussian
mechanism of noise multiplier ``std / sqrt(2)``, recorded in the site's ledger before the
counts are computed. The server sums the sites' noisy counts and scores balanced accuracy
from them: post-processing.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from torch import nn
from torch.utils.data import Dataset, Subset

from gep_fed.accounting.events import PrivacyEvent
from gep_fed.data.metrics import predict
from gep_fed.data.task import CheckedExamples
from gep_fed.mechanisms.noise import NoiseSource
from gep_fed.validation import ConfigError

SCORE_RELEASE = "site-score"  # the ledger's name for the release
SENSITIVITY = math.sqrt(2.0)  # one example: its class's held-out count and right count


def new_coins_key() -> bytes:
    """A run's secret key for its held-out coins: 256 bits from the OS's CSPRNG."""
    return os.urandom(32)


def held_out_mask(
    n: int, fraction: float, seed: int | None = None, key: bytes | None = None
) -> torch.Tensor:
    """Which of ``n`` examples a site holds out: an independent coin of probability
    ``fraction`` per example, from ChaCha20's keystream under ``key`` (``new_coins_key``:
    the same key gives the same coins at every message of a run), from the OS's CSPRNG when
    no key is given (``seed``: a generator seeded for tests, never in a real run).

    Secret: the guarantee couples a neighbouring data set's coins example by example, which
    holds for coins no one can predict. Coins fixed by a known key would follow the examples'
    positions, and one example inserted would move every later one between the parts."""
    if not 0 < fraction < 1:
        raise ConfigError(f"validation fraction must be in (0, 1), got {fraction!r}")
    if seed is not None:
        return torch.rand(n, generator=torch.Generator().manual_seed(seed)) < fraction
    if key is None:
        stream = os.urandom(8 * n)
    else:
        if len(key) != 32:
            raise ValueError(f"a coins key is 32 bytes, got {len(key)}")
        cipher = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None)
        stream = cipher.encryptor().update(bytes(8 * n))
    words = np.frombuffer(stream, dtype=np.uint64)
    threshold = np.uint64(int(fraction * 2**53) << 11)  # fraction to 53 bits, below 2**64
    return torch.from_numpy(words < threshold)


def split_site_data(
    dataset: Dataset, fraction: float, seed: int | None = None, key: bytes | None = None
) -> tuple[Subset, Subset]:
    """The site's (training, held-out) parts (``held_out_mask``), drawn once per run."""
    mask = held_out_mask(len(dataset), fraction, seed, key)
    held = torch.nonzero(mask).flatten().tolist()
    kept = torch.nonzero(~mask).flatten().tolist()
    return Subset(dataset, kept), Subset(dataset, held)


def score_event(noise_std: float, party: str = "") -> PrivacyEvent:
    """The release of one site's noisy counts, as its ledger records it."""
    if not (noise_std > 0 and math.isfinite(noise_std)):
        raise ConfigError(f"score noise must be a finite std > 0, got {noise_std!r}")
    return PrivacyEvent.gaussian(
        SCORE_RELEASE, noise_std, 1.0, 1, noise_std / SENSITIVITY, party=party
    )


class _CountedPairs(Dataset):
    """Checked examples as ``(x, y)`` pairs for ``predict``: one that cannot be read or
    checked gets target -1, which counts nowhere."""

    def __init__(self, examples: CheckedExamples) -> None:
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y, valid = self.examples[i]
        # float64 whatever the label's dtype: a bool label has no -1 and cannot be rounded
        return x, y.to(torch.float64) if valid else torch.full(y.shape, -1.0, dtype=torch.float64)


def check_countable(kind: str) -> None:
    """``ConfigError`` unless a task of ``kind`` can be scored by class counts: checked
    before the release is recorded, so a score the site cannot compute spends nothing."""
    if kind not in ("multiclass", "binary"):
        raise ConfigError(f"a site's score counts classes: not for {kind!r} tasks")


def class_counts(
    model: nn.Module, data: CheckedExamples, kind: str, classes: int, batch_size: int = 128
) -> np.ndarray:
    """(2, classes): per class, the held-out examples and those ``model`` predicts right.
    ``classes`` is the task's (public: the model's outputs), never read from the data; an
    example whose label is not one of them counts nowhere, as training drops it, and so does
    one that cannot be read or checked: an error would tell the server it exists.
    ``batch_size`` examples at most are forwarded at once (a site's ``max_chunk``: its memory
    follows no private count)."""
    check_countable(kind)
    counts = np.zeros((2, classes))
    if len(data) == 0:
        return counts
    logits, targets = predict(model, _CountedPairs(data), batch_size=batch_size)
    if logits.ndim == 1 or logits.shape[1] == 1:
        predicted = (logits.reshape(-1) > 0).long()
    else:
        predicted = logits.argmax(dim=1)
    targets = targets.reshape(-1)
    known = (targets == targets.round()) & (targets >= 0) & (targets < classes)
    targets, predicted = targets[known].long(), predicted[known]
    np.add.at(counts[0], targets.numpy(), 1)
    np.add.at(counts[1], targets[predicted == targets].numpy(), 1)
    return counts


def model_classes(model: nn.Module, example: torch.Tensor) -> int:
    """The classes a model scores (its output width; one logit: binary, two classes), from
    one public-shaped input."""
    with torch.no_grad():
        width = model.eval()(example[None]).reshape(1, -1).shape[1]
    return max(2, width)


def noisy_counts(counts: np.ndarray, noise_std: float, noise: NoiseSource) -> np.ndarray:
    """``counts`` with Gaussian noise of ``noise_std`` on every entry."""
    like = torch.zeros(counts.shape, dtype=torch.float64)
    return counts + noise.gaussian(like, noise_std).numpy()


def score_spread(counts: np.ndarray, noise_std: float, sites: int) -> float:
    """About how far the noise alone moves the balanced accuracy of ``counts`` (the sum of
    ``sites`` sites' noisy counts; one standard deviation, to first order), read from the
    noisy counts themselves: post-processing. A class's recall r = right / n moves by about
    ``noise_std * sqrt(sites) * sqrt(1 + r**2) / n``."""
    total, right = counts[0], np.clip(counts[1], 0, None)
    present = total >= 1
    if not present.any():
        return math.nan
    n, recall = total[present], np.clip(right[present] / total[present], 0.0, 1.0)
    per_class = noise_std * math.sqrt(sites) * np.sqrt(1 + recall**2) / n
    return float(np.sqrt((per_class**2).sum()) / present.sum())


def score_from_counts(counts: np.ndarray) -> dict[str, float]:
    """Accuracy and balanced accuracy from summed (noisy) counts: each class's recall is
    its right count over its count, clipped to [0, 1], over the classes whose noisy count
    is at least one."""
    total, right = counts[0], np.clip(counts[1], 0, None)
    present = total >= 1
    if not present.any():
        return {}
    recall = np.clip(right[present] / total[present], 0.0, 1.0)
    accuracy = min(1.0, right.sum() / max(total.sum(), 1.0))
    return {"accuracy": float(accuracy), "balanced_accuracy": float(recall.mean())}


@dataclass(frozen=True)
class SiteScore:
    """How a tuning scores a trial without the server's own validation data: each site
    holds out ``fraction`` of its examples and releases its per-class counts on them with
    Gaussian noise of std ``noise_std`` (in counts), once per trial, in its ledger.

    Attributes:
        fraction: share of each site's examples held out (never trained on), in (0, 1).
        noise_std: the noise's std on each count: larger is more private and a noisier
            score (the release's noise multiplier is ``noise_std / sqrt(2)``).
    """

    fraction: float
    noise_std: float

    def __post_init__(self) -> None:
        for name in ("fraction", "noise_std"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"site score {name} must be a number, got {value!r}")
        if not 0 < self.fraction < 1:
            raise ConfigError(f"site score fraction must be in (0, 1), got {self.fraction}")
        score_event(self.noise_std)  # names a bad std

    def event(self, party: str = "") -> PrivacyEvent:
        return score_event(self.noise_std, party)

    def to_dict(self) -> dict[str, float]:
        return {"fraction": float(self.fraction), "noise_std": float(self.noise_std)}

    def site_settings(self) -> dict[str, float]:
        """The node-config keys a simulated site scores by."""
        return {"validation-fraction": self.fraction, "score-noise": self.noise_std}

"""Per-example losses and evaluation metrics for multi-class, binary and multi-label tasks.

The losses take ``(outputs, targets)`` of a batch and reduce by the mean, so
``per_example_gradients`` can call them on a batch of one example. The metrics are
scikit-learn's, computed on all of an evaluation set's logits at once.

Privacy: evaluation runs on the server's (or a site's own) evaluation data. Metrics of a
site's private data are not covered by the guarantee and must not be released.

Kinds:
    "multiclass": logits ``(N, C)``, int targets ``(N,)`` in ``[0, C)``; cross-entropy.
    "binary": one logit ``(N, 1)`` or ``(N,)`` with 0/1 targets (BCE with logits), or two
        logits ``(N, 2)`` with int targets (cross-entropy); the positive class is 1.
    "multilabel": logits ``(N, L)``, float 0/1 targets ``(N, L)``; BCE with logits per label.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

KINDS = ("multiclass", "binary", "multilabel")

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits ``(B, C)`` against int class indices ``(B,)``."""
    return F.cross_entropy(outputs, targets.long())


def bce_with_logits(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean binary cross-entropy with logits, over the batch and the labels.

    Binary: ``outputs`` ``(B, 1)`` or ``(B,)``, ``targets`` 0/1 of ``(B,)`` or ``(B, 1)`` (any
    dtype). Multi-label: ``outputs`` ``(B, L)``, ``targets`` float 0/1 ``(B, L)``. For one
    example (a batch of one) this is the mean over its labels, as torch's
    ``F.binary_cross_entropy_with_logits`` with mean reduction.
    """
    return F.binary_cross_entropy_with_logits(
        outputs, targets.to(outputs.dtype).reshape(outputs.shape)
    )


LOSSES: Mapping[str, LossFn] = {
    "cross_entropy": cross_entropy,
    "bce_with_logits": bce_with_logits,
}


def loss_for(kind: str, num_outputs: int) -> LossFn:
    """The training loss of a task of ``kind`` whose model has ``num_outputs`` outputs."""
    _check_kind(kind)
    if kind == "multilabel" or (kind == "binary" and num_outputs == 1):
        return bce_with_logits
    if kind == "binary" and num_outputs != 2:
        raise ValueError(f"a binary task has 1 or 2 outputs, the model has {num_outputs}")
    return cross_entropy


def evaluate_predictions(
    logits: torch.Tensor, targets: torch.Tensor, kind: str
) -> dict[str, float]:
    """Accuracy, balanced accuracy, mean loss and AUROC of ``logits`` against ``targets``.

    Returns ``{"accuracy", "balanced_accuracy", "loss", "auroc", "n"}`` as floats, plus
    ``"label_accuracy"`` for multi-label. Metrics are scikit-learn's; the loss is the training
    loss (``LOSSES``) averaged over examples.

    - multiclass: accuracy and balanced accuracy of the arg-max; AUROC macro one-vs-rest on
      the softmax, NaN unless every class ``0..C-1`` occurs in ``targets``.
    - binary: the positive-class probability (sigmoid of one logit, or softmax column 1),
      thresholded at 1/2; AUROC on that probability, NaN unless both classes occur.
    - multilabel: ``accuracy`` is the subset accuracy (every label right, scikit-learn's
      ``accuracy_score``), ``label_accuracy`` the share of right labels
      (``1 - hamming_loss``); balanced accuracy and AUROC are macro averages over the labels
      in which both classes occur (NaN if none).
    """
    from sklearn import metrics

    _check_kind(kind)
    logits = logits.detach().cpu().to(torch.float64)
    targets = targets.detach().cpu()
    n = logits.shape[0]
    if n == 0:
        raise ValueError("no examples to evaluate")
    if targets.shape[0] != n:
        raise ValueError(f"{n} predictions but {targets.shape[0]} targets")
    nan = float("nan")
    out: dict[str, float] = {}
    with warnings.catch_warnings():
        # balanced accuracy warns when a predicted class is absent from the targets
        warnings.filterwarnings("ignore", "y_pred contains classes not in y_true")
        if kind == "multilabel":
            if logits.ndim != 2 or tuple(targets.shape) != tuple(logits.shape):
                raise ValueError(
                    f"multilabel needs logits and targets of the same (N, L) shape, got "
                    f"{tuple(logits.shape)} and {tuple(targets.shape)}"
                )
            y = targets.numpy().astype(np.int64)
            prob = torch.sigmoid(logits).numpy()
            pred = (logits >= 0).numpy().astype(np.int64)
            both = [j for j in range(y.shape[1]) if 0 < y[:, j].sum() < n]
            out["accuracy"] = float(metrics.accuracy_score(y, pred))
            out["label_accuracy"] = 1.0 - float(metrics.hamming_loss(y, pred))
            out["balanced_accuracy"] = (
                float(np.mean([metrics.balanced_accuracy_score(y[:, j], pred[:, j]) for j in both]))
                if both
                else nan
            )
            out["loss"] = float(bce_with_logits(logits, targets))
            out["auroc"] = (
                float(metrics.roc_auc_score(y[:, both], prob[:, both], average="macro"))
                if both
                else nan
            )
        else:
            logits = _as_class_logits(logits, kind)
            y = targets.reshape(-1).long().numpy()
            if logits.shape[1] == 1:  # binary, one logit
                prob = torch.sigmoid(logits[:, 0]).numpy()
                pred = (logits[:, 0] >= 0).numpy().astype(np.int64)
                loss = bce_with_logits(logits, targets)
            else:
                probs = torch.softmax(logits, dim=1).numpy()
                prob = probs[:, 1] if kind == "binary" else probs
                pred = logits.argmax(1).numpy()
                loss = cross_entropy(logits, torch.from_numpy(y))
            out["accuracy"] = float(metrics.accuracy_score(y, pred))
            out["balanced_accuracy"] = float(metrics.balanced_accuracy_score(y, pred))
            out["loss"] = float(loss)
            num_classes = 2 if kind == "binary" else logits.shape[1]
            every_class = set(np.unique(y).tolist()) == set(range(num_classes))
            if not every_class:
                out["auroc"] = nan
            elif num_classes == 2:
                out["auroc"] = float(
                    metrics.roc_auc_score(y, prob if prob.ndim == 1 else prob[:, 1])
                )
            else:
                out["auroc"] = float(
                    metrics.roc_auc_score(
                        y, prob, multi_class="ovr", average="macro", labels=list(range(num_classes))
                    )
                )
    out["n"] = float(n)
    return out


@torch.no_grad()
def predict(
    model: nn.Module,
    data: Dataset | tuple[torch.Tensor, torch.Tensor],
    batch_size: int = 1000,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All of ``model``'s logits on ``data`` and the targets, gathered on the CPU; the model
    runs in eval mode without gradients, and its training mode is restored afterwards.

    Args:
        data: a ``Dataset`` of ``(x, y)`` pairs (read with a ``DataLoader`` in order), or the
            tensors ``(x, y)``.
        batch_size: examples per forward pass.
        device: where the model runs (default: where its parameters are).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if device is None:
        device = next(model.parameters()).device
    if (
        isinstance(data, tuple | list)
        and len(data) == 2
        and all(isinstance(t, torch.Tensor) for t in data)
    ):
        inputs, labels = data
        if len(inputs) != len(labels):
            raise ValueError(f"{len(inputs)} inputs but {len(labels)} targets")
        batches = [
            (inputs[i : i + batch_size], labels[i : i + batch_size])
            for i in range(0, len(inputs), batch_size)
        ]
    elif isinstance(data, Dataset):
        batches = ((b[0], b[1]) for b in DataLoader(data, batch_size=batch_size, shuffle=False))
    else:
        raise TypeError(f"data must be a Dataset or an (x, y) pair of tensors, got {type(data)}")
    was_training = model.training
    model.eval()
    logits, targets = [], []
    try:
        with torch.no_grad():
            for batch_inputs, batch_targets in batches:
                logits.append(model(batch_inputs.to(device)).float().cpu())
                targets.append(batch_targets.cpu())
    finally:
        model.train(was_training)
    if not logits:
        raise ValueError("no examples to evaluate")
    return torch.cat(logits), torch.cat(targets)


def evaluate(
    model: nn.Module,
    data: Dataset | tuple[torch.Tensor, torch.Tensor],
    kind: str,
    batch_size: int = 1000,
    device: torch.device | str | None = None,
) -> dict[str, float]:
    """``evaluate_predictions`` of ``model`` on ``data`` (see ``predict``)."""
    _check_kind(kind)
    return evaluate_predictions(*predict(model, data, batch_size, device), kind)


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {list(KINDS)}, got {kind!r}")


def _as_class_logits(logits: torch.Tensor, kind: str) -> torch.Tensor:
    if logits.ndim == 1 and kind == "binary":
        logits = logits[:, None]
    if logits.ndim != 2:
        raise ValueError(f"{kind} needs (N, classes) logits, got shape {tuple(logits.shape)}")
    if kind == "binary" and logits.shape[1] not in (1, 2):
        raise ValueError(f"binary needs 1 or 2 logits per example, got {logits.shape[1]}")
    if kind == "multiclass" and logits.shape[1] < 2:
        raise ValueError("multiclass needs at least 2 logits per example")
    return logits


__all__ = [
    "KINDS",
    "LOSSES",
    "bce_with_logits",
    "cross_entropy",
    "evaluate",
    "evaluate_predictions",
    "loss_for",
    "predict",
]

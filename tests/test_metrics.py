"""Per-example losses and evaluation metrics, checked against torch and scikit-learn."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from gep_fed.data.metrics import (
    LOSSES,
    bce_with_logits,
    cross_entropy,
    evaluate,
    evaluate_predictions,
    loss_for,
)
from gep_fed.data.models import MLP
from gep_fed.mechanisms.groups import ParameterLayout
from gep_fed.mechanisms.per_example import per_example_gradients

MULTICLASS_LOGITS = torch.tensor(
    [
        [2.0, 0.1, -1.0],
        [0.3, 1.2, 0.2],
        [-0.5, 0.4, 1.5],
        [1.0, 0.9, 0.8],
        [0.2, -0.3, 0.9],
        [0.0, 2.0, -2.0],
        [1.5, -0.2, 0.3],
        [-1.0, 0.5, 0.4],
    ]
)
MULTICLASS_TARGETS = torch.tensor([0, 1, 2, 1, 2, 1, 2, 0])


def test_losses_by_name():
    assert {"cross_entropy": cross_entropy, "bce_with_logits": bce_with_logits} == LOSSES
    assert loss_for("multiclass", 5) is cross_entropy
    assert loss_for("binary", 2) is cross_entropy
    assert loss_for("binary", 1) is bce_with_logits
    assert loss_for("multilabel", 4) is bce_with_logits
    with pytest.raises(ValueError, match="kind must be one of"):
        loss_for("regression", 1)


def test_multiclass_metrics_agree_with_scikit_learn():
    from sklearn import metrics as skm

    got = evaluate_predictions(MULTICLASS_LOGITS, MULTICLASS_TARGETS, "multiclass")
    y = MULTICLASS_TARGETS.numpy()
    probs = MULTICLASS_LOGITS.double().softmax(1).numpy()
    pred = probs.argmax(1)
    assert got["accuracy"] == pytest.approx(skm.accuracy_score(y, pred))
    assert got["balanced_accuracy"] == pytest.approx(skm.balanced_accuracy_score(y, pred))
    assert got["loss"] == pytest.approx(skm.log_loss(y, probs), rel=1e-9)
    assert got["auroc"] == pytest.approx(
        skm.roc_auc_score(y, probs, multi_class="ovr", average="macro"), rel=1e-12
    )
    assert got["n"] == 8.0
    assert all(isinstance(v, float) for v in got.values())


def test_multiclass_auroc_is_nan_when_a_class_is_missing():
    from sklearn import metrics as skm

    targets = torch.tensor([0, 1, 0, 1, 0, 1, 0, 1])  # class 2 never occurs
    got = evaluate_predictions(MULTICLASS_LOGITS, targets, "multiclass")
    assert math.isnan(got["auroc"])
    assert got["accuracy"] == pytest.approx(
        skm.accuracy_score(targets.numpy(), MULTICLASS_LOGITS.argmax(1).numpy())
    )


def test_binary_one_logit_agrees_with_scikit_learn():
    from sklearn import metrics as skm

    logits = torch.tensor([[1.2], [-0.3], [0.4], [-2.0], [0.1], [-0.7]])
    targets = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    got = evaluate_predictions(logits, targets, "binary")
    y = targets.numpy().astype(int)
    p = torch.sigmoid(logits[:, 0].double()).numpy()
    pred = (p >= 0.5).astype(int)
    assert got["accuracy"] == pytest.approx(skm.accuracy_score(y, pred))
    assert got["balanced_accuracy"] == pytest.approx(skm.balanced_accuracy_score(y, pred))
    assert got["loss"] == pytest.approx(skm.log_loss(y, p), rel=1e-9)
    assert got["auroc"] == pytest.approx(skm.roc_auc_score(y, p))
    one_class = evaluate_predictions(logits, torch.ones(6), "binary")
    assert math.isnan(one_class["auroc"])


def test_binary_two_logits_use_the_positive_class_probability():
    from sklearn import metrics as skm

    logits = MULTICLASS_LOGITS[:, :2]
    targets = torch.tensor([0, 1, 1, 0, 1, 1, 0, 0])
    got = evaluate_predictions(logits, targets, "binary")
    probs = logits.double().softmax(1).numpy()
    assert got["auroc"] == pytest.approx(skm.roc_auc_score(targets.numpy(), probs[:, 1]))
    assert got["loss"] == pytest.approx(skm.log_loss(targets.numpy(), probs), rel=1e-9)
    assert got == evaluate_predictions(logits, targets, "multiclass")


def test_multilabel_metrics_agree_with_scikit_learn():
    from sklearn import metrics as skm

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(10, 4, generator=gen)
    targets = (torch.rand(10, 4, generator=gen) < 0.5).float()
    targets[:, 3] = 0.0  # label 3 has no positives: left out of the macro averages
    targets[0, :3] = torch.tensor([1.0, 0.0, 1.0])
    targets[1, :3] = torch.tensor([0.0, 1.0, 0.0])
    got = evaluate_predictions(logits, targets, "multilabel")
    y = targets.numpy().astype(int)
    p = torch.sigmoid(logits.double()).numpy()
    pred = (p >= 0.5).astype(int)
    assert got["accuracy"] == pytest.approx(skm.accuracy_score(y, pred))
    assert got["label_accuracy"] == pytest.approx(1 - skm.hamming_loss(y, pred))
    assert got["balanced_accuracy"] == pytest.approx(
        np.mean([skm.balanced_accuracy_score(y[:, j], pred[:, j]) for j in range(3)])
    )
    assert got["auroc"] == pytest.approx(skm.roc_auc_score(y[:, :3], p[:, :3], average="macro"))
    per_label_log_loss = [skm.log_loss(y[:, j], p[:, j], labels=[0, 1]) for j in range(4)]
    assert got["loss"] == pytest.approx(np.mean(per_label_log_loss), rel=1e-6)
    no_label_has_both = evaluate_predictions(logits, torch.zeros(10, 4), "multilabel")
    assert math.isnan(no_label_has_both["auroc"])
    assert math.isnan(no_label_has_both["balanced_accuracy"])


def test_bad_shapes_and_kinds_are_refused():
    with pytest.raises(ValueError, match="kind must be one of"):
        evaluate_predictions(MULTICLASS_LOGITS, MULTICLASS_TARGETS, "multi-class")
    with pytest.raises(ValueError, match="1 or 2 logits"):
        evaluate_predictions(MULTICLASS_LOGITS, MULTICLASS_TARGETS, "binary")
    with pytest.raises(ValueError, match="same"):
        evaluate_predictions(MULTICLASS_LOGITS, MULTICLASS_TARGETS, "multilabel")
    with pytest.raises(ValueError, match="no examples"):
        evaluate_predictions(torch.empty(0, 3), torch.empty(0), "multiclass")


def test_multilabel_bce_per_example_loss_equals_torch_on_a_batch_of_one():
    gen = torch.Generator().manual_seed(0)
    outputs = torch.randn(5, 4, generator=gen)
    targets = (torch.rand(5, 4, generator=gen) < 0.5).float()
    for i in range(5):
        expected = F.binary_cross_entropy_with_logits(outputs[i : i + 1], targets[i : i + 1])
        torch.testing.assert_close(
            bce_with_logits(outputs[i : i + 1], targets[i : i + 1]), expected
        )
    # binary: one logit, int targets of shape (B,)
    torch.testing.assert_close(
        bce_with_logits(outputs[:, :1], targets[:, 0].long()),
        F.binary_cross_entropy_with_logits(outputs[:, :1], targets[:, :1]),
    )


@pytest.mark.parametrize(
    ("loss", "num_outputs", "make_targets"),
    [
        (bce_with_logits, 4, lambda g: (torch.rand(6, 4, generator=g) < 0.5).float()),
        (bce_with_logits, 1, lambda g: torch.randint(2, (6,), generator=g)),
        (cross_entropy, 3, lambda g: torch.randint(3, (6,), generator=g)),
    ],
    ids=["multilabel", "binary-one-logit", "multiclass"],
)
def test_losses_give_per_example_gradients_equal_to_a_loop(loss, num_outputs, make_targets):
    gen = torch.Generator().manual_seed(1)
    model = MLP(5, num_outputs, hidden=(7,))
    layout = ParameterLayout.from_model(model)
    x, y = torch.randn(6, 5, generator=gen), make_targets(gen)
    grads = per_example_gradients(model, loss, x, y, layout, max_chunk=4)
    params = dict(model.named_parameters())
    for i in range(6):
        model.zero_grad(set_to_none=True)
        loss(model(x[i : i + 1]), y[i : i + 1]).backward()
        expected = layout.flatten({n: params[n].grad for n in layout.names})
        torch.testing.assert_close(grads[i], expected, rtol=1e-5, atol=1e-7)


def test_evaluate_runs_without_gradients_in_eval_mode_on_datasets_and_tensors():
    gen = torch.Generator().manual_seed(2)
    model = MLP(5, 3, hidden=(7,))
    model.train()
    x, y = torch.randn(23, 5, generator=gen), torch.arange(23) % 3
    seen = []
    model.register_forward_hook(lambda m, i, o: seen.append((m.training, o.requires_grad)))
    from_tensors = evaluate(model, (x, y), "multiclass", batch_size=10)
    from_dataset = evaluate(model, TensorDataset(x, y), "multiclass", batch_size=4)
    assert model.training  # restored
    assert seen and all(not training and not grad for training, grad in seen)
    with torch.no_grad():
        expected = evaluate_predictions(model(x), y, "multiclass")
    for key, value in expected.items():
        assert from_tensors[key] == pytest.approx(value, rel=1e-6)
        assert from_dataset[key] == pytest.approx(value, rel=1e-6)

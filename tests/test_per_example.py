import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gep_fed import IncompatibleModelError
from gep_fed.data.models import MnistCNN, resnet20_gn
from gep_fed.mechanisms.groups import ParameterLayout
from gep_fed.mechanisms.per_example import (
    batchnorm_to_groupnorm,
    per_example_gradients,
    validate_model,
)


def loop_gradients(model, x, y, layout):
    rows = []
    params = dict(model.named_parameters())
    for i in range(x.shape[0]):
        model.zero_grad()
        F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        rows.append(torch.cat([params[n].grad.reshape(-1) for n in layout.names]))
    return torch.stack(rows)


@pytest.mark.parametrize("engine", ["layers", "vmap"])
@pytest.mark.parametrize(
    "make_model, shape",
    [(MnistCNN, (1, 28, 28)), (resnet20_gn, (3, 32, 32))],
    ids=["mnist_cnn", "resnet20_gn"],
)
def test_per_example_gradients_match_a_plain_loop(make_model, shape, engine):
    # float64: a batched float32 forward rounds differently from a one-example forward, and
    # a ReLU whose input is within that rounding of 0 then takes the other branch
    model = make_model().double()
    layout = ParameterLayout.from_model(model)
    x, y = torch.randn(6, *shape, dtype=torch.float64), torch.randint(10, (6,))
    fast = per_example_gradients(model, F.cross_entropy, x, y, layout, 4, engine)
    slow = loop_gradients(model, x, y, layout).float()
    assert fast.shape == (6, layout.size)
    torch.testing.assert_close(fast, slow, atol=1e-6, rtol=1e-5)


def test_chunk_size_does_not_change_the_gradients():
    model = MnistCNN()
    layout = ParameterLayout.from_model(model)
    x, y = torch.randn(10, 1, 28, 28), torch.randint(10, (10,))
    a = per_example_gradients(model, F.cross_entropy, x, y, layout, max_chunk=3)
    b = per_example_gradients(model, F.cross_entropy, x, y, layout, max_chunk=10)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_empty_batch_gives_an_empty_matrix():
    model = MnistCNN()
    layout = ParameterLayout.from_model(model)
    g = per_example_gradients(
        model, F.cross_entropy, torch.zeros(0, 1, 28, 28), torch.zeros(0, dtype=torch.long), layout
    )
    assert g.shape == (0, layout.size)


def test_batchnorm_is_refused_with_the_fix_in_the_message():
    model = nn.Sequential(nn.Conv2d(1, 8, 3), nn.BatchNorm2d(8), nn.Flatten(), nn.LazyLinear(10))
    with pytest.raises(IncompatibleModelError, match=r"1 \(BatchNorm2d\).*batchnorm_to_groupnorm"):
        validate_model(model)
    batchnorm_to_groupnorm(model)
    validate_model(model)
    assert isinstance(model[1], nn.GroupNorm) and model[1].num_channels == 8

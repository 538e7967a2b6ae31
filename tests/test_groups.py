import math

import pytest

from gep_fed.data.models import MLP, MnistCNN, resnet20_gn
from gep_fed.mechanisms.groups import ParameterLayout


def test_default_groups_are_input_layer_stages_and_output_layer():
    layout = ParameterLayout.from_model(resnet20_gn())
    assert [g.name for g in layout.groups] == ["conv1", "layer1", "layer2", "layer3", "fc"]
    assert "norm1.weight" in layout.groups[0].param_names  # a norm layer joins the layer before
    assert [g.name for g in ParameterLayout.from_model(MnistCNN()).groups] == [
        "conv1",
        "conv2",
        "fc",
    ]


def test_groups_are_contiguous_and_cover_every_parameter_once():
    model = resnet20_gn()
    layout = ParameterLayout.from_model(model)
    assert layout.size == sum(p.numel() for p in model.parameters())
    assert layout.groups[0].start == 0
    for a, b in zip(layout.groups, layout.groups[1:], strict=False):
        assert a.stop == b.start


def test_pattern_groups_override_the_default_and_name_unmatched_parameters():
    model = MLP(8, 3, hidden=(4,))
    layout = ParameterLayout.from_model(model, {"weights": ["*.weight"], "biases": ["*.bias"]})
    assert [g.name for g in layout.groups] == ["weights", "biases"]
    assert layout.groups[0].size == 8 * 4 + 4 * 3
    with pytest.raises(ValueError, match=r"out.bias.*match no group"):
        ParameterLayout.from_model(model, {"w": ["*.weight"], "hidden": ["hidden.*"]})


def test_basis_is_shared_in_proportion_to_sqrt_group_size_with_at_least_one_each():
    layout = ParameterLayout.from_model(resnet20_gn())
    dims = layout.allocate_basis(500)
    roots = [math.sqrt(s) for s in layout.group_sizes]
    expected = [max(1, math.floor(500 * r / sum(roots))) for r in roots]
    assert list(dims) == expected
    assert all(d >= 1 for d in layout.allocate_basis(5))
    assert max(layout.allocate_basis(500, max_rank=20)) == 20
    with pytest.raises(ValueError, match="smaller than the number of parameter groups"):
        layout.allocate_basis(3)


def test_layout_round_trips_through_its_dict_form():
    layout = ParameterLayout.from_model(resnet20_gn())
    assert ParameterLayout.from_dict(layout.to_dict()) == layout

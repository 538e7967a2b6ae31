"""Data held on another device than the model (CPU tensors for a model on a GPU) is copied
over before the model sees it, on every route of a step. Without a GPU, "another device" is a
tensor subclass that the model refuses until ``.to`` has been called on it."""

import pytest
import torch
from torch import nn

from gep_fed import GEPConfig, GEPStep, PrivacyContract
from gep_fed.data.models import resnet20_gn


class Elsewhere(torch.Tensor):
    """A tensor on "another device": indexing keeps it there, ``.to(...)`` brings it to the
    model's device (a plain tensor) unless it is asked to go where another such tensor is."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = super().__torch_function__(func, types, args, kwargs)
        if func is torch.Tensor.to and isinstance(out, Elsewhere):
            targets = [*args[1:], *kwargs.values()]
            if not any(isinstance(t, Elsewhere) for t in targets):
                return out.as_subclass(torch.Tensor)
        return out


class RefusesOtherDevices(nn.Module):
    """The model as a GPU holds it: its first layer refuses inputs from elsewhere."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x):
        if isinstance(x, Elsewhere):
            raise RuntimeError("the model was given inputs still on another device")
        return self.model(x)


def elsewhere(t: torch.Tensor) -> Elsewhere:
    return t.as_subclass(Elsewhere)


def test_the_guard_refuses_inputs_not_moved_and_accepts_moved_ones():
    model = RefusesOtherDevices(nn.Linear(3, 2))
    x = elsewhere(torch.randn(4, 3))
    with pytest.raises(RuntimeError, match="another device"):
        model(x[:2])
    assert model(x[:2].to("cpu")).shape == (2, 2)


@pytest.mark.parametrize("mechanism", ["gep", "bgep", "gp"])
@pytest.mark.parametrize("factored_layers", [True, False])
def test_a_step_copies_private_and_public_data_held_elsewhere_to_the_models_device(
    mechanism, factored_layers
):
    torch.manual_seed(0)
    model = RefusesOtherDevices(resnet20_gn(3, 10))
    gen = torch.Generator().manual_seed(0)
    public = elsewhere(torch.randn(12, 3, 8, 8, generator=gen))
    x = elsewhere(torch.randn(6, 3, 8, 8, generator=gen))
    y = elsewhere(torch.randint(0, 10, (6,), generator=gen))
    contract = PrivacyContract(
        mechanism, 1.0, 0.5, clip_embedding=1.0, clip_residual=0.5, clip_norm=1.0
    )
    config = GEPConfig(
        contract, num_basis=4, num_anchors=8, max_chunk=4, factored_layers=factored_layers
    )
    step = GEPStep(model, public, config, dataset_size=12, generator=gen)
    step(x, y)  # a subspace from the anchors (GEP, B-GEP), then the clipped, noised step
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)

"""``PrivacyContract``: the privacy settings of a private step, declared once.

Everything that decides a release's privacy (the mechanism, sigma, q and the clip norms) lives
here and nowhere else: a single-machine step (``GEPConfig`` holds one), the federation's
server (its central noise), every site (what it clips, noises and accounts) and every ledger
event are built from a contract object, never from copies of its fields. Sigma is resolved
once, into the contract (``for_budget`` calibrates it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace

from gep_fed.accounting.events import PrivacyEvent
from gep_fed.mechanisms.clip_bounds import CLIP_BOUND
from gep_fed.mechanisms.mechanism import GP, Mechanism, calibrate_noise_multiplier, mechanism_class
from gep_fed.validation import NOISE_MULTIPLIER, PROBABILITY, ConfigError, Range, check_choice

MECHANISMS = ("gep", "bgep", "gp")
FEDERATED_MECHANISMS = (*MECHANISMS, "langevin")

# GEP's best known step: the setting every standard benchmark (MNIST, Fashion-MNIST, CIFAR-10
# on ScatterNet features; benchmarks/standard.py) chose on validation, for GEP (S1, S2/S1 = 0.5,
# k, anchors, refresh) and for GP (S). Pinned to the benchmark's log by tests/test_defaults.py.
DEFAULT_CLIP_EMBEDDING = 0.1
DEFAULT_CLIP_RESIDUAL = 0.05
DEFAULT_CLIP_NORM = 0.1
DEFAULT_NUM_BASIS = 100
DEFAULT_NUM_ANCHORS = 1000
DEFAULT_BASIS_REFRESH = 20


@dataclass(frozen=True)
class PrivacyContract:
    """What one private step releases and how it is accounted.

    Attributes:
        mechanism: "gep" (embedding and residual, two releases per step), "bgep" (embedding
            only), "gp" (DP-SGD) or "langevin" (noisy SGD with a Gaussian prior; its noise
            comes from ``langevin_beta0`` and its events from the Langevin schedule).
        noise_multiplier: sigma, noise standard deviation divided by the clip norm of each
            released vector; 0 means no noise and no privacy (infinite epsilon).
        sample_rate: q, each private example's independent chance to be in a step's Poisson
            sample; smaller amplifies privacy.
        clip_embedding, clip_residual: S1 and S2, per-example bounds of the embedding and the
            residual (GEP, B-GEP); their noise is ``sigma * S1`` and ``sigma * S2``.
        clip_norm: S, per-example gradient bound (GP; Langevin's G). Clip norms must lie in
            ``CLIP_BOUND`` ([1e-30, 1e30]): there every bound holds in float32 with the proven
            rounding margins of ``gep_fed.mechanisms.clip_bounds``; a round config outside it
            is refused as malformed.
        langevin_beta0: Langevin's prior variance. It scales the noise and the step sizes of
            the multi-pass schedule together, so it shapes training, not privacy: multi-pass
            epsilon depends only on the steps, the batch, n and delta.
    """

    mechanism: str
    noise_multiplier: float
    sample_rate: float
    clip_embedding: float = DEFAULT_CLIP_EMBEDDING
    clip_residual: float = DEFAULT_CLIP_RESIDUAL
    clip_norm: float = DEFAULT_CLIP_NORM
    langevin_beta0: float = 0.0

    def __post_init__(self) -> None:
        check_choice("mechanism", self.mechanism, FEDERATED_MECHANISMS)
        NOISE_MULTIPLIER.check("noise_multiplier", self.noise_multiplier)
        PROBABILITY.check("sample_rate", self.sample_rate)
        for name in ("clip_embedding", "clip_residual", "clip_norm"):
            CLIP_BOUND.check(name, getattr(self, name))
        beta0 = Range(0, low_open=self.is_langevin)
        beta0.check("langevin_beta0", self.langevin_beta0)

    @classmethod
    def for_budget(
        cls,
        mechanism: str,
        target_epsilon: float,
        delta: float,
        sample_rate: float,
        steps: int,
        *,
        count_noise: float | None = None,
        **clips: float,
    ) -> PrivacyContract:
        """The contract whose sigma is the smallest that keeps ``steps`` releases at rate
        ``sample_rate`` within ``(target_epsilon, delta)`` (RDP, ``dp-accounting``); ``clips``
        are S1, S2, S. ``count_noise``: each step also releases a noised count (adaptive S2)."""
        sigma = calibrate_noise_multiplier(
            target_epsilon, delta, sample_rate, steps, mechanism, count_noise=count_noise
        )
        return cls(mechanism, sigma, sample_rate, **clips)

    @property
    def is_langevin(self) -> bool:
        return self.mechanism == "langevin"

    @property
    def mechanism_type(self) -> type[Mechanism]:
        """The class of the released mechanism (Langevin clips like GP)."""
        return GP if self.is_langevin else mechanism_class(self.mechanism)

    def build_mechanism(
        self, clip_embedding: float | None = None, clip_residual: float | None = None
    ) -> Mechanism:
        """The mechanism with this contract's sigma and clip norms (or the given S1, S2, e.g.
        derived from public anchors: they change the clipping, not the accounting)."""
        s1 = self.clip_embedding if clip_embedding is None else clip_embedding
        s2 = self.clip_residual if clip_residual is None else clip_residual
        cls, sigma = self.mechanism_type, self.noise_multiplier
        if cls.name == "gep":
            return cls(s1, s2, noise_multiplier=sigma)
        if cls.name == "bgep":
            return cls(s1, noise_multiplier=sigma)
        return cls(self.clip_norm, noise_multiplier=sigma)

    def events(
        self,
        steps: int,
        *,
        count_noise: float | None = None,
        party: str = "",
        round: int | None = None,
        placement: str = "local",
    ) -> list[PrivacyEvent]:
        """``steps`` releases under this contract, one event each (each carries its round).
        ``count_noise``: each also releases a count noised with that std (adaptive S2).
        Langevin's events depend on the step index and the data size: ``LangevinTrainer``
        builds those."""
        if self.is_langevin:
            raise ValueError("Langevin events come from LangevinTrainer.multi_pass_events")
        event = self.mechanism_type.event(
            self.noise_multiplier,
            self.sample_rate,
            count_noise=count_noise,
            party=party,
            round=round,
            placement=placement,
        )
        return [event] * steps

    def with_noise(self, noise_multiplier: float) -> PrivacyContract:
        return replace(self, noise_multiplier=noise_multiplier)

    def to_record(self, prefix: str = "privacy.") -> dict:
        """Flat ``{prefix + field: value}`` (a Flower ConfigRecord holds scalars only)."""
        return {prefix + k: v for k, v in asdict(self).items()}

    @classmethod
    def from_record(cls, record: Mapping, prefix: str = "privacy.") -> PrivacyContract:
        """Decode and validate; a missing, mistyped or out-of-range value is a
        ``ConfigError`` naming the field."""
        values = {}
        for f in fields(cls):
            key = prefix + f.name
            if key not in record:
                raise ConfigError(f"{key} is missing")
            value = record[key]
            if f.name != "mechanism" and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            values[f.name] = value
        return cls(**values)

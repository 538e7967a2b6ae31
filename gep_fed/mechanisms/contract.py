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

from gep_fed.accounting.events import PrivacyEvent, calibrate
from gep_fed.mechanisms.clip_bounds import CLIP_BOUND
from gep_fed.mechanisms.distributed_noise import (
    MAX_SHARE_SCALE,
    MIN_SHARE_SCALE,
    DistributedNoise,
    distributed_event,
    padded_dimension,
)
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
        noise_shares, quantization_bits, quantization_step: distributed mode only (0
            otherwise; ``gep_fed.mechanisms.distributed_noise``): the sum must hold the noise
            shares of at least ``noise_shares`` sites, each adding 1/t of the variance as
            discrete Gaussian noise on its clipped sums quantised with this step (in clip
            norms) modulo ``2**quantization_bits``. The step grows the sensitivity and
            every site's ledger accounts for it.
    """

    mechanism: str
    noise_multiplier: float
    sample_rate: float
    clip_embedding: float = DEFAULT_CLIP_EMBEDDING
    clip_residual: float = DEFAULT_CLIP_RESIDUAL
    clip_norm: float = DEFAULT_CLIP_NORM
    langevin_beta0: float = 0.0
    noise_shares: int = 0
    quantization_bits: int = 0
    quantization_step: float = 0.0

    def __post_init__(self) -> None:
        check_choice("mechanism", self.mechanism, FEDERATED_MECHANISMS)
        NOISE_MULTIPLIER.check("noise_multiplier", self.noise_multiplier)
        PROBABILITY.check("sample_rate", self.sample_rate)
        for name in ("clip_embedding", "clip_residual", "clip_norm"):
            CLIP_BOUND.check(name, getattr(self, name))
        beta0 = Range(0, low_open=self.is_langevin)
        beta0.check("langevin_beta0", self.langevin_beta0)
        if self.is_distributed:
            if self.is_langevin:
                raise ConfigError("langevin runs in client mode only, not distributed")
            _ = self.distributed_noise  # validates t, bits and step
        elif self.quantization_bits or self.quantization_step:
            raise ConfigError("quantization-bits and -step are for distributed mode only")

    def checked_share_scale(self) -> PrivacyContract:
        """This contract, if each site's noise share is at least as wide as Kairouz, Liu &
        Steinke's divergence bound assumes (Thm. 1: scale >= 1/2 quantisation step; checked
        on a contract to release, not on calibration's probes); else ``ConfigError``."""
        if self.is_distributed:
            scale = self.distributed_noise.share_scale(self.noise_multiplier)
            if not scale >= MIN_SHARE_SCALE:
                raise ConfigError(
                    f"each site's noise share has scale {scale:.3g} quantisation steps, below "
                    f"the {MIN_SHARE_SCALE} the distributed bound assumes: use more "
                    "quantization bits or fewer noise shares"
                )
            if not scale <= MAX_SHARE_SCALE:
                raise ConfigError(
                    f"each site's noise share has scale {scale:.3g} quantisation steps, above "
                    f"{MAX_SHARE_SCALE:g}: the quantization-step is far finer than any "
                    "modulus of the secure sum holds"
                )
        return self

    @property
    def is_distributed(self) -> bool:
        """Noise shared among sites inside a secure sum (distributed mode)."""
        return self.noise_shares != 0

    @property
    def distributed_noise(self) -> DistributedNoise:
        if not self.is_distributed:
            raise ValueError("this contract is not for distributed mode")
        return DistributedNoise(self.noise_shares, self.quantization_bits, self.quantization_step)

    def quantized_dimension(self, num_basis: int | None, num_params: int) -> int:
        """The length of a site's quantised release: embedding (k) and residual (p) as the
        mechanism releases them, padded to an order of the rotation."""
        cls = self.mechanism_type
        length = (num_basis or 0) * cls.uses_subspace + num_params * (cls.name != "bgep")
        return padded_dimension(length)

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
        dimension: int | None = None,
    ) -> list[PrivacyEvent]:
        """``steps`` releases under this contract, one event each (each carries its round).
        ``count_noise``: each also releases a count noised with that std (adaptive S2).
        A distributed contract's events are placed "distributed" and need ``dimension``, the
        quantised release's length (``quantized_dimension``). Langevin's events depend on
        the step index and the data size: ``LangevinTrainer`` builds those."""
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
        if self.is_distributed:
            if count_noise is not None or dimension is None:
                raise ValueError("a distributed release needs its dimension and no count")
            event = distributed_event(
                event, self.distributed_noise, dimension, self.mechanism_type.releases
            )
        return [event] * steps

    def to_record(self, prefix: str = "privacy.") -> dict:
        """Flat ``{prefix + field: value}`` (a Flower ConfigRecord holds scalars only)."""
        return {prefix + k: v for k, v in asdict(self).items()}

    def with_distributed_noise(
        self,
        noise_shares: int,
        bits: int,
        steps: int,
        dimension: int,
        max_norm: float,
        max_sites: int,
        budget: tuple[float, float] | None,
    ) -> PrivacyContract:
        """This contract in distributed mode: the quantisation step that fits the sum in
        ``2**bits`` (``DistributedNoise.for_sum``) and, with a ``budget`` (epsilon, delta),
        the smallest sigma whose ``steps`` distributed releases stay within it. The step
        depends on sigma and sigma on the step: sigma is calibrated without rounding, the
        step fitted to it, then sigma calibrated again at that step (the noise grows
        slightly, so the range still fits)."""

        def fitted(sigma: float) -> PrivacyContract:
            noise = DistributedNoise.for_sum(
                max(sigma, 1e-3), noise_shares, bits, dimension, max_norm, max_sites
            )
            return replace(
                self,
                noise_multiplier=sigma,
                noise_shares=noise_shares,
                quantization_bits=bits,
                quantization_step=noise.step,
            )

        if budget is None:
            return fitted(self.noise_multiplier).checked_share_scale()
        epsilon, delta = budget

        def sigma_for(step: float) -> float:
            def event_for(s: float) -> PrivacyEvent:
                c = replace(fitted(s), quantization_step=step)
                return replace(c.events(1, dimension=dimension)[0], steps=steps)

            return calibrate(epsilon, delta, event_for)

        first = fitted(sigma_for(1e-12))
        final = replace(first, noise_multiplier=sigma_for(first.quantization_step))
        return final.checked_share_scale()

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
            is_float = f.name not in ("mechanism", "noise_shares", "quantization_bits")
            if is_float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            values[f.name] = value
        return cls(**values).checked_share_scale()  # a site checks the contract it releases at

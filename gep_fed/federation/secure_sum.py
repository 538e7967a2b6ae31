"""The secure sum of distributed mode: pairwise masks over every pair of a round's sites,
agreement keys signed by each site's pinned long-term key, no dropout recovery.

Protocol: the pairwise masking of Bonawitz et al., "Practical Secure Aggregation for
Privacy-Preserving Machine Learning" (CCS 2017), with its active-adversary authentication
(each site signs its round keys with a long-term key that the others know from a PKI; here,
the peers pinned in each site's own node config), in the case without dropout recovery:
the complete graph, no Shamir shares, no self masks and no unmask stage. A cross-silo
federation is small and rarely loses a site mid-round, and without the unmask stage a site
never reveals any secret, so no sequence of messages can make it help remove its own masks.
A round in which any listed site's vector is missing is abandoned: its masks do not cancel
and nothing about any share can be recovered from what was sent.

One round, for site ``i`` of the listed sites ``L``:

1. advertise: ``i`` draws a fresh X25519 agreement key and signs ``(PROTOCOL, run, round,
   settings, agreement key)`` with its Ed25519 site key, where ``settings`` is the digest of
   the round's configuration as the server announces it (``RoundBinding``);
2. collect: the server forwards every listed site's signed key with the round's
   configuration. ``i`` refuses unless that configuration's digest is the one it signed, every
   key verifies under a peer it pinned (or its own) over the same digest, no peer appears
   twice, its own key is there once, and ``|L|`` reaches its ``noise-shares +
   max-colluding-sites``. Then for each other site ``j`` it derives ``k_ij =
   HKDF-SHA256(X25519(a_i, A_j), info = PROTOCOL, run, round, settings, the two agreement keys
   in order)`` and the mask ``m_ij = ChaCha20(k_ij)``'s
   keystream as 32-bit words, and sends ``y_i = x_i + 1 e_0 + sum_j s_ij m_ij (mod 2**b)``
   (``b``: the shares' own bits, at most 32)
   with ``s_ij = +1`` when ``A_i < A_j``, else ``-1``. Its agreement key is then erased.
3. the server adds the ``y_i``: the masks cancel, coordinate 0 counts the sites (a check
   that every site used the same list), the rest is the sum of the shares modulo ``2**b``
   (modulo more, its carries would count the sites whose share is negative, coordinate by
   coordinate).

Why a deviating server learns no share: the masks between two honest sites are unknown to
it (it holds neither agreement key), so a sum it can unmask that holds ``x_i`` holds every
honest site ``i`` listed, and ``i`` listed at least ``noise-shares + max-colluding-sites``
pinned sites; each honest site checks the round's noise split against its own node config,
and every site in the sum signed the same settings, so none was given a finer quantisation
step or another noise than its peers (which would shrink their noise relative to its share).
A site answers each round once (its ledger records the round before it replies).

Security level (bits, against the best known attacks): Ed25519 signatures and X25519
agreement about 128; HKDF-SHA256's 256-bit output keys, each used for one ChaCha20 stream
(256-bit key, one nonce per key), 256. Every mask is expanded from the whole agreed secret:
no seed is folded or expanded by a non-cryptographic generator.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from gep_fed.validation import ConfigError

PROTOCOL = b"gep-fed secure sum v2"  # v2: bound to the round's settings
SETTINGS_BYTES = 32  # SHA-256
MODULUS_BITS = 32
MODULUS = 1 << MODULUS_BITS
KEY_BYTES = 32
SIGNATURE_BYTES = 64


class SecureSumRefused(Exception):
    """A site refuses a secure-sum stage. ``reason``: a ``wire.REFUSALS`` key (all the
    server learns); ``detail``: for the site's own log (it may name a peer or a key)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


# -- long-term site keys ---------------------------------------------------------------


def key_text(public_key: bytes) -> str:
    """A public key as hospitals exchange it (base64)."""
    return base64.b64encode(public_key).decode("ascii")


def _public_bytes(key: Ed25519PublicKey | X25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def create_site_key(path: str | Path) -> bytes:
    """Write a new Ed25519 site key to ``path`` (PEM, mode 600; never overwritten) and
    return its public key."""
    path = Path(path)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ConfigError(f"site key {path} exists: it is never overwritten") from None
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)
    return _public_bytes(key.public_key())


def load_site_key(path: str | Path) -> Ed25519PrivateKey:
    """The site's Ed25519 key from its PEM file, or ``ConfigError`` naming the problem."""
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except OSError as err:
        raise ConfigError(f"site key {path}: cannot read it ({err.strerror})") from None
    except ValueError:
        raise ConfigError(f"site key {path}: not a PEM private key") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"site key {path}: not an Ed25519 key (make one: gep-fed site keygen)")
    return key


def site_public_key(key: Ed25519PrivateKey) -> bytes:
    return _public_bytes(key.public_key())


@dataclass(frozen=True)
class PinnedPeers:
    """The sites a site accepts in a secure sum: public key -> name, from its own file."""

    names: Mapping[bytes, str]

    @classmethod
    def read(cls, path: str | Path) -> PinnedPeers:
        """A peers file: one ``NAME BASE64-ED25519-PUBLIC-KEY`` a line (``#`` comments)."""
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except OSError as err:
            raise ConfigError(f"peers file {path}: cannot read it ({err.strerror})") from None
        names: dict[bytes, str] = {}
        for number, line in enumerate(lines, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            where = f"peers file {path}, line {number}"
            if len(parts) != 2:
                raise ConfigError(f"{where}: expected 'NAME PUBLIC-KEY', got {line!r}")
            name, text = parts
            try:
                key = base64.b64decode(text, validate=True)
            except ValueError:
                key = b""
            if len(key) != KEY_BYTES:
                raise ConfigError(f"{where}: {text!r} is not a base64 Ed25519 public key")
            if key in names or name in names.values():
                raise ConfigError(f"{where}: {name} or its key is listed twice")
            names[key] = name
        if not names:
            raise ConfigError(f"peers file {path} names no peer")
        return cls(names)

    def name(self, key: bytes) -> str | None:
        return self.names.get(key)


# -- one round at a site ------------------------------------------------------------------


@dataclass(frozen=True)
class RoundBinding:
    """What a round's signatures and masks are bound to: the run, the round, and the digest
    of the round's settings (``gep_fed.federation.wire.settings_digest``) as the site received
    them."""

    run_id: int
    round: int
    settings: bytes

    def __post_init__(self) -> None:
        if not (isinstance(self.settings, bytes) and len(self.settings) == SETTINGS_BYTES):
            raise ValueError(f"a round's settings digest is {SETTINGS_BYTES} bytes")

    def encoded(self) -> bytes:
        return PROTOCOL + _u64(self.run_id) + _u64(self.round) + self.settings


@dataclass(frozen=True)
class SignedKey:
    """A site's agreement key for one round, signed by its site key."""

    site_key: bytes
    agreement_key: bytes
    signature: bytes

    @staticmethod
    def signed_message(binding: RoundBinding, agreement_key: bytes) -> bytes:
        return binding.encoded() + agreement_key

    def verified(self, binding: RoundBinding) -> bool:
        if not (
            len(self.site_key) == KEY_BYTES
            and len(self.agreement_key) == KEY_BYTES
            and len(self.signature) == SIGNATURE_BYTES
        ):
            return False
        try:
            Ed25519PublicKey.from_public_bytes(self.site_key).verify(
                self.signature, self.signed_message(binding, self.agreement_key)
            )
        except (InvalidSignature, ValueError):
            return False
        return True

    def as_list(self) -> list[bytes]:
        return [self.site_key, self.agreement_key, self.signature]


def advertise(site_key: Ed25519PrivateKey, binding: RoundBinding) -> tuple[bytes, SignedKey]:
    """A fresh agreement key for the round: (its private bytes, kept by the site until the
    collect stage; the signed public key, sent)."""
    agreement = X25519PrivateKey.generate()
    public = _public_bytes(agreement.public_key())
    signature = site_key.sign(SignedKey.signed_message(binding, public))
    private = agreement.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    return private, SignedKey(site_public_key(site_key), public, signature)


def check_keys(
    keys: Sequence[SignedKey],
    own: SignedKey,
    peers: PinnedPeers,
    binding: RoundBinding,
    needed: int,
) -> None:
    """Refuse (``SecureSumRefused``) a collect stage's list of keys unless every key is
    signed for this run, round and settings by a pinned peer or this site, none twice, this
    site's own once, and at least ``needed`` sites (this one included) are listed."""
    seen_sites, seen_agreement = set(), set()
    for key in keys:
        own_site = key.site_key == own.site_key
        name = "this site" if own_site else peers.name(key.site_key)
        if name is None:
            raise SecureSumRefused(
                "unpinned peer", f"a key signed by {key_text(key.site_key)}, not a pinned peer"
            )
        if not key.verified(binding):
            raise SecureSumRefused(
                "unpinned peer",
                f"the key listed for {name} is not signed by it for this round and settings",
            )
        if key.site_key in seen_sites or key.agreement_key in seen_agreement:
            raise SecureSumRefused("malformed round", f"{name} is listed twice")
        if own_site and key != own:
            raise SecureSumRefused("malformed round", "this site's key is not the one it sent")
        seen_sites.add(key.site_key)
        seen_agreement.add(key.agreement_key)
    if own.site_key not in seen_sites:
        raise SecureSumRefused("malformed round", "this site's own key is not listed")
    if len(seen_sites) < needed:
        raise SecureSumRefused(
            "too few sites",
            f"{len(seen_sites)} sites listed; this site's noise split and colluders need {needed}",
        )


def mask_stream(shared_key: bytes, length: int) -> np.ndarray:
    """``length`` 32-bit words of ChaCha20's keystream under a 256-bit pairwise key."""
    nonce = bytes(16)  # one stream per key: each key is derived for one pair and round
    encryptor = Cipher(algorithms.ChaCha20(shared_key, nonce), mode=None).encryptor()
    stream = encryptor.update(bytes(4 * length)) + encryptor.finalize()
    return np.frombuffer(stream, dtype="<u4").astype(np.int64)


def pairwise_key(
    private: bytes, own_agreement: bytes, other_agreement: bytes, binding: RoundBinding
) -> bytes:
    """The 256-bit mask key of two sites for one round: HKDF-SHA256 of their X25519 secret,
    bound to the protocol, run, round, settings and both agreement keys."""
    secret = X25519PrivateKey.from_private_bytes(private).exchange(
        X25519PublicKey.from_public_bytes(other_agreement)
    )
    low, high = sorted((own_agreement, other_agreement))
    info = binding.encoded() + low + high
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


def masked_vector(
    share: np.ndarray,
    private: bytes,
    own: SignedKey,
    keys: Sequence[SignedKey],
    binding: RoundBinding,
    bits: int,
) -> np.ndarray:
    """The site's share (non-negative integers) with a count of one in front, masked by one
    pairwise mask per other listed site, modulo ``2**bits`` (int64; ``bits`` <= 32, the
    shares' own modulus: a sum taken modulo more would show the server its carries, i.e.
    how many sites' shares are negative at each coordinate)."""
    if not 1 <= bits <= MODULUS_BITS:
        raise ValueError(f"bits must be in [1, {MODULUS_BITS}], got {bits}")
    modulus = 1 << bits
    values = np.concatenate([[1], np.asarray(share, dtype=np.int64)]) % modulus
    for key in keys:
        if key.agreement_key == own.agreement_key:
            continue
        mask = mask_stream(
            pairwise_key(private, own.agreement_key, key.agreement_key, binding),
            values.size,
        )
        values = values + mask if own.agreement_key < key.agreement_key else values - mask
        values %= modulus  # 2**bits divides 2**32: the reduced masks stay uniform
    return values


# -- the server ---------------------------------------------------------------------------


def unmasked_sum(vectors: Sequence[np.ndarray], bits: int) -> np.ndarray | None:
    """The sum of the sites' shares modulo ``2**bits`` from their vectors masked modulo
    ``2**bits`` (all of them: a missing one leaves masks in), or None when the count
    coordinate shows that the masks did not cancel (the sites did not mask for the same
    list)."""
    modulus = 1 << bits
    total = np.zeros_like(vectors[0])
    for v in vectors:
        total = (total + v) % modulus
    if int(total[0]) != len(vectors) % modulus:
        return None
    return total[1:]


def _u64(value: int) -> bytes:
    return int(value).to_bytes(8, "big", signed=False)


# -- the stages' records (plain dicts: Flower's ConfigRecord wraps them) -----------------------

SECURE_SUM = "secure-sum"  # the config record of a secure-sum stage (and of its reply)
MASKED_SHARE = "masked-share"  # the collect stage's array record
ADVERTISE, COLLECT = "advertise", "collect"
SIGNED_KEY_BYTES = 2 * KEY_BYTES + SIGNATURE_BYTES


def stage_config(
    stage: str,
    round_: int,
    keys: Sequence[SignedKey] | None = None,
    settings: bytes | None = None,
) -> dict:
    """A stage's config record: its name, its round, (advertise) the digest of the round's
    settings and (collect) every listed key."""
    record: dict = {"stage": stage, "round": round_}
    if settings is not None:
        record["settings"] = settings
    if keys is not None:
        record["keys"] = [b"".join(k.as_list()) for k in keys]
    return record


def read_settings(record: Mapping) -> bytes:
    """The advertise stage's settings digest (``ValueError`` when malformed)."""
    raw = record.get("settings")
    if not (isinstance(raw, bytes) and len(raw) == SETTINGS_BYTES):
        raise ValueError(f"the advertise stage's settings must be a {SETTINGS_BYTES}-byte digest")
    return raw


def read_keys(record: Mapping) -> list[SignedKey]:
    """The collect stage's signed keys (``ValueError`` when malformed)."""
    raw = record.get("keys")
    if not (
        isinstance(raw, list)
        and all(isinstance(b, bytes) and len(b) == SIGNED_KEY_BYTES for b in raw)
    ):
        raise ValueError("the collect stage's keys must be 128-byte signed keys")
    return [SignedKey(b[:32], b[32:64], b[64:]) for b in raw]


def read_signed_key(record: Mapping) -> SignedKey | None:
    """An advertise reply's signed key (None when malformed)."""
    raw = record.get("signed-key")
    if isinstance(raw, bytes) and len(raw) == SIGNED_KEY_BYTES:
        return SignedKey(raw[:32], raw[32:64], raw[64:])
    return None


def read_masked_share(record: Mapping | None) -> np.ndarray:
    """A collect reply's masked share (its ``MASKED_SHARE`` array record) as int64
    (``ValueError`` naming what is malformed)."""
    if record is None or list(record) != [MASKED_SHARE]:
        raise ValueError(f"{MASKED_SHARE} must hold one array")
    array = record[MASKED_SHARE]
    if array.dtype != "uint32" or len(array.shape) != 1:
        raise ValueError(f"{MASKED_SHARE} must be a vector of uint32 (got {array.dtype})")
    return array.numpy().astype(np.int64)

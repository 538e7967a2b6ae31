"""A site's own tools on the command line: ``gep-fed ledger init|show|mark`` and ``gep-fed
site keygen``. They read and write a ledger or a key and nothing else, so they load neither
PyTorch nor Flower (``gep-fed`` answers them from this module alone, in well under a second
plus dp-accounting's import where epsilon is computed)."""

from __future__ import annotations

import argparse
from pathlib import Path

from gep_fed.accounting.events import pld_text
from gep_fed.accounting.ledger import (
    LedgerError,
    PrivacyLedger,
    create_ledger_key,
    default_key_path,
    default_mark_path,
    read_ledger_key,
    selections_folder,
)
from gep_fed.validation import DELTA, ConfigError


def handles(argv: list[str]) -> bool:
    """Whether ``argv`` asks for one of these tools (``--help`` of ``site`` lists ``check``
    too, so it goes to the whole parser)."""
    return argv[:1] == ["ledger"] or argv[:2] == ["site", "keygen"]


def build_parser() -> argparse.ArgumentParser:
    """The ``gep-fed`` parser with these tools alone, as the whole parser has them."""
    parser = argparse.ArgumentParser(prog="gep-fed")
    sub = parser.add_subparsers(dest="command", required=True)
    add_ledger_parser(sub)
    site = sub.add_parser("site")
    add_keygen_parser(site.add_subparsers(dest="site_command", required=True))
    return parser


def _site_keygen(args: argparse.Namespace) -> int:
    from gep_fed.federation.secure_sum import create_site_key, key_text

    if not args.name or any(c.isspace() for c in args.name):
        raise ConfigError(f"--name must be one word, got {args.name!r}")
    public = create_site_key(args.path)
    print(f"{args.name} {key_text(public)}")
    return 0


def _ledger_init(args: argparse.Namespace) -> int:
    path = Path(args.path)
    if path.exists():
        raise LedgerError(f"ledger {path} already exists; not replacing it")
    key_path = Path(args.key) if args.key else default_key_path(path)
    mark = default_mark_path(key_path)
    if mark.exists():
        raise LedgerError(
            f"{mark} exists: this site already has a ledger history; restore the newest copy "
            f"of its ledger instead of creating {path}"
        )
    DELTA.check("delta", args.delta)  # before the key: a refused init leaves nothing behind
    key = create_ledger_key(key_path)
    try:
        PrivacyLedger.open(path, args.delta, None, args.owner, key=key, mark_path=mark, create=True)
    except BaseException:
        if not path.exists():  # no ledger was written: the new key protects nothing
            key_path.unlink(missing_ok=True)
            mark.unlink(missing_ok=True)
        raise
    print(f"created ledger {path} (owner {args.owner!r}, delta {args.delta:g})")
    print(f"created its key {key_path} (mode 600): back it up with the ledger; without it the")
    print("ledger cannot be verified, and whoever holds it can rewrite the ledger")
    print(f"created its high-water mark {mark}: never restore it from a backup; it is what")
    print("refuses an older copy of the ledger")
    return 0


def _ledger_show(args: argparse.Namespace) -> int:
    path = Path(args.path)
    key_path = Path(args.key) if args.key else default_key_path(path)
    key = read_ledger_key(key_path) if key_path.exists() or args.key else None
    ledger = PrivacyLedger.load(path, key, default_mark_path(key_path) if key else None)
    verified = "HMAC and high-water mark verified" if key else "checksum verified, no key"
    print(f"ledger {path} ({verified})")
    print(f"  owner {ledger.owner!r}, {ledger.steps} accounted step(s)")
    print(
        f"  epsilon {ledger.epsilon():.4f} (RDP), {pld_text(ledger.epsilon('pld'))} at "
        f"delta={ledger.delta:g}"
    )
    trusted = [e for e in ledger.events if e.placement == "trusted-server"]
    if trusted:  # the figure above counts them at the noise the coordinator declared
        print(
            f"  {sum(e.steps for e in trusted)} step(s) sent unnoised to a trusted coordinator "
            "(central mode): counted above at the noise it declared it would add; against "
            "the coordinator itself they carry no guarantee"
        )
    distributed = [e for e in ledger.events if e.is_distributed]
    if distributed:
        colluders = max(e.max_colluding_sites for e in distributed)
        print(
            f"  {sum(e.steps for e in distributed)} step(s) in secure sums: epsilon "
            f"{ledger.epsilon_if_shares_exposed():.4f} (RDP) if more than {colluders} other "
            "site(s) colluded with the coordinator and its own noise shares were seen alone"
        )
    for e in ledger.events:
        if e.selection is not None:
            print(
                f"  {e.steps} of those: a private selection (the best of a random number of "
                f"runs of {e.steps} step(s)"
                + (" and a noised score" if e.selection.score_noise_multiplier else "")
                + f", mean {e.selection.mean:.3g}), accounted once"
            )
    searches = selections_folder(path)
    if searches.is_dir():  # each trial of a private selection, in a ledger of its own
        trials = sorted(searches.glob("*/trial-*.json"))
        print(
            f"  its selections' trials: {len(trials)} ledger(s) in {searches}, each under its "
            "selection's bound of one trial (their releases are counted above too)"
        )
    return 0


def _ledger_mark(args: argparse.Namespace) -> int:
    path = Path(args.path)
    key_path = Path(args.key) if args.key else default_key_path(path)
    mark = default_mark_path(key_path)
    if mark.exists():
        raise LedgerError(f"{mark} exists; a high-water mark is only ever raised, by the site")
    key = read_ledger_key(key_path)
    ledger = PrivacyLedger.load(path, key, mark, verify_mark=False)
    ledger.save()
    print(f"recorded {ledger.steps} step(s), epsilon {ledger.epsilon():.4f} as {mark}")
    return 0


def add_ledger_parser(sub) -> None:
    """``gep-fed ledger init|show|mark``."""
    led = sub.add_parser("ledger", help="create or inspect a site's privacy ledger")
    led_sub = led.add_subparsers(dest="ledger_command", required=True)
    init = led_sub.add_parser(
        "init",
        help="create a site's ledger and its HMAC key, once, before the site's first run",
        description="Create an empty ledger and a new HMAC key (mode 600). Refuses to replace "
        "either: a site's accounting is never restarted.",
    )
    init.add_argument("path", help="the ledger file (the site's node config ledger-path)")
    init.add_argument("--owner", required=True, help="the site id recorded in the ledger")
    init.add_argument(
        "--delta", type=float, required=True, help="delta of the site's guarantee (node config)"
    )
    init.add_argument("--key", help="key file (default: <path>.key)")
    init.set_defaults(func=_ledger_init)
    show = led_sub.add_parser("show", help="verify a ledger and print what it has spent")
    show.add_argument("path", help="the ledger file")
    show.add_argument("--key", help="key file (default: <path>.key when it exists)")
    show.set_defaults(func=_ledger_show)
    mark = led_sub.add_parser(
        "mark",
        help="give a ledger kept before high-water marks existed its mark (once)",
        description="Record the ledger's current spending as its high-water mark. Only for a "
        "ledger that has none yet: check first that it is the newest copy, since a mark made "
        "from an older copy forgets the releases after it. Refuses if a mark exists.",
    )
    mark.add_argument("path", help="the ledger file")
    mark.add_argument("--key", help="key file (default: <path>.key)")
    mark.set_defaults(func=_ledger_mark)


def add_keygen_parser(site_sub) -> None:
    """``gep-fed site keygen``."""
    keygen = site_sub.add_parser(
        "keygen",
        help="make the site's secure-sum key (distributed mode) and print its public key",
        description="Writes a new Ed25519 key (PEM, mode 600; never overwritten) for the node "
        "config's site-key, and prints the line the other hospitals add to their peers file: "
        "'NAME PUBLIC-KEY'. Exchange these lines by a channel you trust (and compare them by "
        "phone): a site accepts in a secure sum only keys signed by a peer it pinned.",
    )
    keygen.add_argument("path", help="the key file to create")
    keygen.add_argument("--name", required=True, help="the site's name in the peers files")
    keygen.set_defaults(func=_site_keygen)

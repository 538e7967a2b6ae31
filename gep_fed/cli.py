"""The ``gep-fed`` command line."""

from __future__ import annotations

import argparse
import sys

from gep_fed.accounting import (
    ImpossibleTargetError,
    PrivacyEvent,
    calibrate_noise_multiplier,
    epsilon_pld,
    epsilon_rdp,
)


def _calibrate(args: argparse.Namespace) -> int:
    try:
        sigma = calibrate_noise_multiplier(
            args.epsilon, args.delta, args.sample_rate, args.steps, args.mechanism
        )
    except (ImpossibleTargetError, ValueError) as err:
        print(f"gep-fed calibrate: {err}", file=sys.stderr)
        return 2
    events = [PrivacyEvent(args.mechanism, sigma, args.sample_rate, args.steps)]
    print(
        f"noise multiplier sigma = {sigma:.4f}  ({args.mechanism}, q={args.sample_rate:g}, "
        f"{args.steps} steps)"
    )
    print(
        f"epsilon at delta={args.delta:g}: RDP {epsilon_rdp(events, args.delta):.4f}, "
        f"PLD {epsilon_pld(events, args.delta):.4f}"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gep-fed", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    cal = sub.add_parser(
        "calibrate", help="print the noise multiplier sigma that meets a target epsilon"
    )
    cal.add_argument(
        "--epsilon",
        type=float,
        required=True,
        help="target epsilon: the privacy loss bound to stay within",
    )
    cal.add_argument(
        "--delta",
        type=float,
        default=1e-5,
        help="target delta: the probability the epsilon bound may fail",
    )
    cal.add_argument(
        "--sample-rate",
        type=float,
        required=True,
        help="q: each example's chance to be in a step's Poisson sample",
    )
    cal.add_argument("--steps", type=int, required=True, help="number of noisy releases")
    cal.add_argument(
        "--mechanism",
        choices=["gep", "bgep", "gp"],
        default="gep",
        help="gep releases two vectors per step and is accounted at sigma/sqrt(2)",
    )
    cal.set_defaults(func=_calibrate)
    sim = sub.add_parser("simulate", help="run a federated GEP simulation")
    sim.set_defaults(func=lambda _: _not_yet("simulate"))
    return parser


def _not_yet(command: str) -> int:
    print(f"gep-fed {command}: not yet available in this version", file=sys.stderr)
    return 3


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

"""The one-run privacy audit: its statistics, honest runs under their claims, broken ones."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from audit_variants import VARIANTS, langevin_noise_cut_a_hundredfold, noise_quartered

from gep_fed.accounting.audit import AuditSetup, epsilon_lower_bound, p_value, run_audit


def test_all_guesses_right_without_delta_gives_the_randomised_response_bound():
    """With delta = 0 and every one of r guesses right, epsilon is rejected exactly when
    p(epsilon)^r < alpha, p the accuracy of epsilon-DP randomised response."""
    for r in (10, 100, 1000):
        accuracy = 0.05 ** (1 / r)
        expected = math.log(accuracy / (1 - accuracy))
        assert epsilon_lower_bound(2000, r, r, 0.0, 0.95) == pytest.approx(expected, rel=1e-6)
    assert p_value(100, 50, 25, 0.0, 0.0) > 0.5  # chance-level guessing rejects nothing
    assert epsilon_lower_bound(100, 50, 25, 1e-5) == 0.0


def test_delta_only_weakens_what_the_guesses_can_reject():
    assert p_value(1000, 200, 170, 1.0, 1e-3) > p_value(1000, 200, 170, 1.0, 0.0)
    assert epsilon_lower_bound(1000, 200, 170, 1e-3) < epsilon_lower_bound(1000, 200, 170, 0.0)


@pytest.mark.parametrize("epsilon", [2.0, 8.0])
@pytest.mark.parametrize("mode", ["central", "client"])
@pytest.mark.parametrize("mechanism", ["gep", "bgep", "gp"])
def test_an_honest_run_audits_below_its_claim_and_above_zero(mechanism, mode, epsilon):
    result = run_audit(AuditSetup(mechanism=mechanism, mode=mode, epsilon=epsilon))
    assert result.claimed_epsilon_rdp == pytest.approx(epsilon, abs=0.01)
    assert 0 < result.epsilon_lower_bound <= result.claimed_epsilon_pld
    assert result.steps == 1 and result.canaries == 1000
    expected = "trusted-server" if mode == "central" else "local"
    assert result.placement == expected


@pytest.mark.parametrize(
    "variant", ["noise halved", "residual clipped at 2 S2", "GEP accounted at sigma"]
)
def test_a_broken_variant_raises_the_audited_bound(variant):
    """The audit sees each of these leaks: on the same seeds, every broken run audits higher
    than its honest twin (five seeds). At m = 1,000 the bound stays below the claim (the
    method reaches about 40 % of a Gaussian mechanism's epsilon), so these are measured
    shifts, not proofs of a violation."""
    mechanism, broken = VARIANTS[variant]
    shifts = []
    for seed in range(5):
        setup = AuditSetup(mechanism=mechanism, mode="client", epsilon=2.0, seed=seed)
        honest = run_audit(setup)
        with broken():
            leaky = run_audit(setup)
        assert leaky.claimed_epsilon_rdp == pytest.approx(honest.claimed_epsilon_rdp)
        shifts.append(leaky.epsilon_lower_bound - honest.epsilon_lower_bound)
    assert min(shifts) > 0 and sum(shifts) / len(shifts) > 0.15, shifts


@pytest.mark.parametrize(
    "setup, broken",
    [
        (AuditSetup(mechanism="gp", mode="client", epsilon=2.0), noise_quartered),
        (
            AuditSetup(mechanism="langevin", mode="single", steps=5),
            langevin_noise_cut_a_hundredfold,
        ),
    ],
    ids=["gp-noise-quartered", "langevin-noise-cut-100x"],
)
def test_a_gross_leak_is_caught_above_its_claim(setup, broken):
    honest = run_audit(setup)
    assert honest.epsilon_lower_bound <= honest.claimed_epsilon_pld
    with broken():
        leaky = run_audit(setup)
    assert leaky.epsilon_lower_bound > leaky.claimed_epsilon_rdp


def test_langevin_multi_pass_is_audited_on_its_iterates():
    """Every iterate is a release; the auditor reconstructs the noisy clipped gradient sum.
    Its claim here is tiny (epsilon 0.03 after 5 steps on 16 examples), and so is the bound."""
    result = run_audit(AuditSetup(mechanism="langevin", mode="single", steps=5))
    assert result.steps == 4  # step 1 forgets the gradient (lambda_1 eta_1 = 1)
    assert 0 < result.claimed_epsilon_rdp < 0.1
    assert result.epsilon_lower_bound <= result.claimed_epsilon_pld


def test_gep_fed_audit_prints_the_claim_and_the_bound_and_writes_them(tmp_path):
    command = Path(sys.executable).parent / "gep-fed"
    proc = subprocess.run(
        [
            str(command),
            "audit",
            "--mechanism",
            "gp",
            "--mode",
            "central",
            "--epsilon",
            "8",
            "--run-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "claimed epsilon" in proc.stdout and "audited epsilon" in proc.stdout
    (run,) = tmp_path.iterdir()
    result = json.loads((run / "audit.json").read_text())
    assert result["mechanism"] == "gp" and result["mode"] == "central"
    assert 0 < result["epsilon_lower_bound"] < result["claimed_epsilon_rdp"]
    assert "## Privacy audit" in (run / "report.md").read_text()

"""One-run privacy audit: an empirical *lower* bound on epsilon from a single training run.

Method (Steinke, Nasr & Jagielski, "Privacy Auditing with One (1) Training Run", NeurIPS
2023), white box:

1. ``m`` canaries are made; each is included in the private data with probability 1/2, by a
   secret coin. An included canary is an example like any other: at every step it joins the
   Poisson sample with probability q. A canary is injected as a per-example *gradient* (a
   random direction, at twice the clip norm so clipping acts on it), so no model has to
   memorise anything.
2. The auditor sees every noisy release. A canary's score accumulates its inner product with
   each release, each component divided by its noise standard deviation, as the log
   likelihood ratio of "included" against "excluded" under Poisson sampling.
3. The auditor guesses "included" for the highest scores and "excluded" for the lowest, and
   abstains on the rest. Theorem 3 of the paper bounds how many of ``r`` guesses an
   (epsilon, delta)-DP mechanism lets be right; observing more right guesses than that
   rejects (epsilon, delta) at the chosen confidence. The audited epsilon is the largest
   epsilon rejected.

Three analyses of the same guesses and scores, each compared with the claim:

- **Steinke et al.** (epsilon, no assumption on the mechanism): about 40 % of a Gaussian
  mechanism's epsilon at m = 1,000;
- **f-DP** (Mahloujifar, Melis & Chaudhuri 2024, for the Gaussian trade-off curve): a lower
  bound on mu that rejects a mu-GDP claim without further assumptions; 40-60 % of mu;
- **Gaussian fit** of the scores (releases without subsampling only): the standardised
  difference of the included and excluded canaries' scores, with a noncentral-t confidence
  bound. Its assumption, Gaussian scores with one variance, is exactly what a Gaussian
  mechanism claims, and because it measures the scores' spread instead of trusting the
  claimed noise it sees noise that is smaller than accounted, a clip that is larger, or a
  release missing from the accounting: every broken variant in the tests, at m = 1,000.

What it proves: a bound above the claim shows (at 95 % confidence, and for the fit, under
its assumption) that the run leaks more than it accounts. What it does not prove: that the
run *is* private at the claimed epsilon; a bound below the claim says nothing more.

Assumptions: canaries are independent of the rest of the data and of the randomness of the
mechanism; the guesses are a function of the releases and the canaries only; the grid of
guess counts is fixed in advance (a Bonferroni correction covers choosing its best entry).

The package, of which nothing in a real run imports any part:

- ``gep_fed.audit.bounds``: the statistics, lower bounds on epsilon and on mu from the
  auditor's guesses and scores;
- ``gep_fed.audit.canaries``: ``GradientCanaries``, a release observer
  (``gep_fed.mechanisms.observer``) that adds the included canaries' gradients to each
  sample's clipped sums and scores every noisy release;
- ``gep_fed.audit.harness``: ``run_audit``, the one part that builds trainers and a
  federation (``GEPStep``, ``LangevinTrainer``, ``Site``, ``FederationServer``) with the
  canaries attached, runs a federation's rounds through the production round loop and
  ClientApp in process, and the result and report of an audit.
"""

"""Step time and peak memory of a private step: GEP, GP (ours), Opacus DP-SGD, non-private.

Timings are interleaved round-robin in one process and reported as medians and ratios (these
machines are noisy; ratios measured together are what to compare). Peak memory is measured
per method in a fresh subprocess (peak resident set on CPU, ``max_memory_allocated`` on CUDA)
relative to the same process before the step. Anchor-subspace time per refresh is separate:
with ``basis_refresh = R`` it is paid once every R steps.

    python benchmarks/step_time.py                    # MNIST CNN (b=256, k=200) and ResNet20-GN
    python benchmarks/step_time.py --models cnn --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import save

from gep_fed import (
    GEP,
    GP,
    AnchorSubspace,
    MnistCNN,
    NoiseSource,
    ParameterLayout,
    compute_anchor_subspace,
    per_example_gradients,
    resnet20_gn,
)
from gep_fed.config import GEPConfig

SETUPS = {
    # name: (model factory, input shape, batch, k, groups)
    "cnn": (MnistCNN, (1, 28, 28), 256, 200, None),
    "resnet20": (
        resnet20_gn,
        (3, 32, 32),
        64,
        500,
        {
            "input": ["conv1.*", "norm1.*", "layer1.*"],
            "middle": ["layer2.*"],
            "output": ["layer3.*", "fc.*"],
        },
    ),
}
METHODS = ("nonprivate", "gp", "opacus", "gep")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def build(setup: str, device: torch.device, num_anchors: int):
    make, shape, batch, k, groups = SETUPS[setup]
    torch.manual_seed(0)
    model = make().to(device)
    layout = ParameterLayout.from_model(model, groups)
    x = torch.randn(batch, *shape, device=device)
    y = torch.randint(10, (batch,), device=device)
    public = torch.randn(num_anchors, *shape, device=device)
    return model, layout, x, y, public, k


def make_steps(
    setup: str, device: torch.device, num_anchors: int, max_chunk: int, anchors: bool = True
):
    """One callable per method doing a full step (gradient estimate + optimizer step).

    ``anchors=False`` uses a random orthonormal basis of the same sizes (for memory runs,
    so that the anchor computation's own peak does not mask the step's).
    """
    model, layout, x, y, public, k = build(setup, device, num_anchors)
    cfg = GEPConfig(num_basis=k, max_chunk=max_chunk, groups=SETUPS[setup][4])
    began = time.perf_counter()
    if anchors:
        subspace = compute_anchor_subspace(
            model,
            public,
            layout,
            cfg,
            loss_fn=F.cross_entropy,
            generator=torch.Generator().manual_seed(0),
        ).subspace
    else:
        dims = layout.allocate_basis(k, max_rank=num_anchors)
        subspace = AnchorSubspace(
            layout,
            tuple(
                torch.linalg.qr(torch.randn(g.size, d, device=device)).Q
                for g, d in zip(layout.groups, dims, strict=True)
            ),
        )
    _sync(device)
    anchor_seconds = time.perf_counter() - began
    noise = NoiseSource(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    params = dict(model.named_parameters())

    def private(mech):
        def step():
            grads = per_example_gradients(model, F.cross_entropy, x, y, layout, max_chunk)
            noisy = mech.add_noise(mech.clipped_sums(grads, subspace), 1.0, noise)
            flat = mech.reconstruct(noisy, subspace, len(x))
            for name, value in layout.unflatten(flat).items():
                params[name].grad = value
            opt.step()

        return step

    def nonprivate():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    steps = {"nonprivate": nonprivate, "gp": private(GP(1.0)), "gep": private(GEP(1.0, 0.2))}
    steps["opacus"] = _opacus_step(setup, device, x, y)
    return steps, anchor_seconds, layout.size


def _opacus_step(setup, device, x, y):
    """Opacus DP-SGD on its own copy of the model: GradSampleModule + DPOptimizer."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    make = SETUPS[setup][0]
    torch.manual_seed(0)
    model = GradSampleModule(make().to(device))
    opt = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=len(x),
    )

    def step():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def time_steps(steps: dict, repeats: int, device) -> dict:
    for fn in steps.values():  # warm-up (torch.func tracing, allocator)
        fn()
    samples = {name: [] for name in steps}
    for _ in range(repeats):
        for name, fn in steps.items():
            _sync(device)
            t = time.perf_counter()
            fn()
            _sync(device)
            samples[name].append(time.perf_counter() - t)
    return {name: statistics.median(v) for name, v in samples.items()}


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure_peak(fn, device: torch.device) -> float:
    """MiB by which one call of ``fn`` raises memory above the level before it."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS high-water mark
    before = _status_kib("VmRSS")
    fn()
    return (_status_kib("VmHWM") - before) / 1024


def peak_memory(setup: str, method: str, device: str, num_anchors: int, max_chunk: int) -> float:
    """MiB above the process's level just before the step, in a fresh subprocess."""
    code = (
        "import sys, torch; sys.path.insert(0, 'benchmarks');"
        "import step_time as s;"
        f"dev = torch.device('{device}');"
        f"steps, _, _ = s.make_steps('{setup}', dev, {num_anchors}, {max_chunk}, False);"
        "fn = steps['" + method + "']; fn();"
        "print(s.measure_peak(fn, dev))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[1],
        timeout=900,
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return float(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--num-anchors", type=int, default=2000)
    ap.add_argument("--max-chunk", type=int, default=256)
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    results = {}
    lines = [
        f"# Step time and memory ({device}, {torch.get_num_threads()} threads, "
        f"median of {args.repeats} interleaved repeats)",
        "",
    ]
    for setup in args.models:
        steps, anchor_s, p = make_steps(setup, device, args.num_anchors, args.max_chunk)
        times = time_steps(steps, args.repeats, device)
        mem = (
            {}
            if args.no_memory
            else {
                m: peak_memory(setup, m, args.device, args.num_anchors, args.max_chunk)
                for m in METHODS
            }
        )
        _, _, batch, k, _ = SETUPS[setup]
        results[setup] = {
            "params": p,
            "batch": batch,
            "k": k,
            "seconds": times,
            "peak_mib": mem,
            "anchor_seconds_per_refresh": anchor_s,
        }
        lines += [
            f"## {setup}: {p:,} parameters, batch {batch}, k = {k}, {args.num_anchors} anchors",
            "",
            "| method | step ms | x non-private | x our GP | x Opacus | peak MiB | "
            "x Opacus memory |",
            "|---|---|---|---|---|---|---|",
        ]
        for m in METHODS:
            t = times[m]
            mm = mem.get(m)
            ratio_mem = f"{mm / mem['opacus']:.2f}" if mm is not None and mem["opacus"] > 0 else "-"
            lines.append(
                f"| {m} | {1000 * t:.1f} | {t / times['nonprivate']:.2f} | "
                f"{t / times['gp']:.2f} | {t / times['opacus']:.2f} | "
                f"{'-' if mm is None else f'{mm:.0f}'} | {ratio_mem} |"
            )
        lines += [
            "",
            f"Anchor subspace per refresh: {anchor_s:.2f} s "
            f"({anchor_s / times['gep']:.1f} GEP steps)",
            "",
        ]
    report = "\n".join(lines)
    print(report)
    name = f"step_time_{device.type}"
    save(name, {"device": str(device), "threads": torch.get_num_threads(), "results": results})
    (Path(__file__).parent / "results" / f"{name}.md").write_text(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Step time and peak memory of a private step: GEP, B-GEP, GP (ours), Opacus DP-SGD, non-private.

Our methods run on the layer engine (per-example gradients from layer rules, the default);
``gp_vmap`` and ``gep_vmap`` are the same steps on the ``torch.func`` engine, for comparison.

Timings are interleaved round-robin in one process and reported as medians and ratios (these
machines are noisy; ratios measured together are what to compare). Peak memory is measured
per method in a fresh subprocess (peak resident set on CPU, ``max_memory_allocated`` on CUDA)
relative to the same process before the step. Anchor-subspace time per refresh is separate:
with ``basis_refresh = R`` it is paid once every R steps.

    python benchmarks/step_time.py                    # MNIST CNN (b=256, k=200) and ResNet20-GN
    python benchmarks/step_time.py --models cnn --device cuda
    python benchmarks/step_time.py --models resnet18 --threads 1 --repeats 10 \
        --num-anchors 256 --max-chunk 8 --append   # ResNet-18-GN, 64x64, b=32, k~500

``--append`` adds the new section to the results file (and merges the JSON) instead of
replacing it. Opacus ghost clipping (``grad_sample_mode="ghost"``) is a fifth method; where the
installed Opacus cannot build or run it on the model, the table says so and why.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import statistics
import subprocess
import sys
import time
import types
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from common import save

from gep_fed import GEPConfig, PrivacyContract
from gep_fed.data.models import MnistCNN, resnet20_gn
from gep_fed.mechanisms.anchors import compute_anchor_subspace
from gep_fed.mechanisms.groups import ParameterLayout
from gep_fed.mechanisms.layer_gradients import layer_engines
from gep_fed.mechanisms.mechanism import BGEP, GEP, GP
from gep_fed.mechanisms.noise import NoiseSource
from gep_fed.mechanisms.per_example import batchnorm_to_groupnorm, per_example_gradients
from gep_fed.mechanisms.step import clipped_sums_of_batches
from gep_fed.mechanisms.subspace import AnchorSubspace


def _basic_block_forward(self, x):
    """torchvision's BasicBlock.forward with ``out = out + identity`` instead of ``+=``."""
    out = self.relu(self.bn1(self.conv1(x)))
    out = self.bn2(self.conv2(out))
    identity = x if self.downsample is None else self.downsample(x)
    return self.relu(out + identity)


def resnet18_gn() -> nn.Module:
    """torchvision ResNet-18 (ImageNet stem, 10 classes) with every BatchNorm as GroupNorm.

    Its in-place ReLUs and ``out += identity`` modify outputs of layers that Opacus hooks with
    full backward hooks, which PyTorch refuses ("Output 0 of BackwardHookFunction is a view and
    is being modified inplace", pytorch/pytorch#61519); the same function out of place is used
    for every method.
    """
    from torchvision.models import resnet18
    from torchvision.models.resnet import BasicBlock

    model = batchnorm_to_groupnorm(resnet18(weights=None, num_classes=10))
    for module in model.modules():
        if isinstance(module, nn.ReLU):
            module.inplace = False
        if isinstance(module, BasicBlock):
            module.forward = types.MethodType(_basic_block_forward, module)
    return model


def _resnet18_groups() -> dict[str, list[str]]:
    """One parameter group per convolution or linear layer, its GroupNorm attached (21 groups).

    Fewer, larger groups get k_g ~ k sqrt(p_g) / sum sqrt(p_j), so the bases' size
    sum_g p_g k_g grows with the group sizes: ~9 GiB for one group per stage at k = 500,
    ~2.2 GiB per layer, which is what 24 GiB of memory allows here.
    """
    groups = {"stem": ["conv1.*", "bn1.*"]}
    for stage in range(1, 5):
        for block in range(2):
            head = f"layer{stage}.{block}"
            for i in (1, 2):
                groups[f"{head}.conv{i}"] = [f"{head}.conv{i}.*", f"{head}.bn{i}.*"]
            if stage > 1 and block == 0:
                groups[f"{head}.downsample"] = [f"{head}.downsample.*"]
    groups["fc"] = ["fc.*"]
    return groups


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
    "resnet18": (resnet18_gn, (3, 64, 64), 32, 500, _resnet18_groups()),
}
METHODS = (
    "nonprivate",
    "gp",
    "gp_vmap",
    "opacus",
    "opacus_ghost",
    "gep",
    "gep_materialised",
    "gep_vmap",
    "bgep",
)
# Their memory runs compute the anchor subspace (the Gram route needs the anchors' factors);
# the others use random orthonormal bases of the same sizes.
WITH_ANCHORS = ("gep", "bgep")


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
    setup: str,
    device: torch.device,
    num_anchors: int,
    max_chunk: int,
    anchors: bool = True,
    time_refresh: bool = True,
):
    """One callable per method doing a full step (gradient estimate + optimizer step), the
    anchor time, the parameter count, the methods that failed, and a callable doing GEP's
    embedding product alone (the batch's per-example gradients, made once, times the bases).

    ``anchors=False`` uses a random orthonormal basis of the same sizes (for the memory
    runs of the methods that embed from materialised gradients); ``time_refresh=False``
    computes only the subspace with Gram groups, not also the one without (whose time the
    table gives beside it).
    """
    model, layout, x, y, public, k = build(setup, device, num_anchors)
    cfg = GEPConfig(
        PrivacyContract("gep", 1.0, 0.01),
        num_basis=k,
        max_chunk=max_chunk,
        groups=SETUPS[setup][4],
    )
    anchor_seconds = {}
    if anchors:
        if time_refresh:  # warm-up on a few anchors, so neither timed refresh pays first calls
            compute_anchor_subspace(
                model, public[: 2 * max_chunk], layout, cfg, loss_fn=F.cross_entropy
            )
        for gram in (False, True) if time_refresh else (True,):  # without, then with Gram
            began = time.perf_counter()
            subspace = compute_anchor_subspace(
                model,
                public,
                layout,
                replace(cfg, factored_layers=gram),
                loss_fn=F.cross_entropy,
                generator=torch.Generator().manual_seed(0),
            ).subspace
            _sync(device)
            anchor_seconds["gram" if gram else "materialised"] = time.perf_counter() - began
    else:
        dims = layout.allocate_basis(k, max_rank=num_anchors)
        subspace = AnchorSubspace(
            layout,
            tuple(
                torch.linalg.qr(torch.randn(g.size, d, device=device)).Q
                for g, d in zip(layout.groups, dims, strict=True)
            ),
        )
    materialised = AnchorSubspace(layout, subspace.bases)  # the same bases, no Gram groups
    noise = NoiseSource(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    params = dict(model.named_parameters())

    # The batch in chunks of max_chunk, each differentiated, clipped and summed before the
    # next, as a site's GEPStep does: no more than max_chunk per-example gradients at once.
    chunks = [(x[i : i + max_chunk], y[i : i + max_chunk]) for i in range(0, len(x), max_chunk)]

    def private(mech, engine="layers", basis=subspace):
        def step():
            sums = clipped_sums_of_batches(
                model, F.cross_entropy, chunks, layout, mech, basis, max_chunk, engine=engine
            )
            noisy = mech.add_noise(sums, noise)
            flat = mech.reconstruct(noisy, subspace, len(x))
            for name, value in layout.unflatten(flat).items():
                params[name].grad = value
            opt.step()

        return step

    def nonprivate():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    gp, gep = GP(1.0, noise_multiplier=1.0), GEP(1.0, 0.2, noise_multiplier=1.0)
    steps = {
        "nonprivate": nonprivate,
        "gp": private(gp),
        "gp_vmap": private(gp, "vmap"),
        "gep": private(gep),
        "gep_materialised": private(gep, basis=materialised),
        "gep_vmap": private(gep, "vmap"),
        "bgep": private(BGEP(1.0, noise_multiplier=1.0)),
    }
    steps["opacus"] = _opacus_step(setup, device, x, y)
    failures = {}
    try:
        steps["opacus_ghost"] = _opacus_ghost_step(setup, device, x, y)
    except Exception as err:  # an Opacus without ghost clipping, or a layer it cannot handle
        failures["opacus_ghost"] = f"{type(err).__name__}: {err}"
    steps = {m: steps[m] for m in METHODS if m in steps}
    grads = []  # made on the first call: the memory runs never need them

    def embedding_product():
        if not grads:
            grads.extend(
                per_example_gradients(model, F.cross_entropy, cx, cy, layout, max_chunk)
                for cx, cy in chunks
            )
        for chunk in grads:
            subspace.embed_bounded(chunk)

    gram_weights = subspace.factored_weights
    return steps, anchor_seconds, layout.size, failures, embedding_product, gram_weights


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


def _opacus_ghost_step(setup, device, x, y):
    """Opacus ghost clipping: PrivacyEngine.make_private(grad_sample_mode="ghost"), whose
    criterion wrapper (DPLossFastGradientClipping) runs the two backward passes (per-example
    norms without per-example gradients, then the reweighted batch gradient)."""
    from opacus import PrivacyEngine

    make = SETUPS[setup][0]
    torch.manual_seed(0)
    model = make().to(device)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=len(x), shuffle=False
    )
    model, opt, criterion, _ = PrivacyEngine(accountant="rdp").make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
        criterion=nn.CrossEntropyLoss(),
        data_loader=loader,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        poisson_sampling=False,
        grad_sample_mode="ghost",
    )

    def step():
        opt.zero_grad(set_to_none=True)
        criterion(model(x), y).backward()
        opt.step()

    return step


def time_steps(steps: dict, repeats: int, device, failures: dict | None = None) -> dict:
    """Median seconds per method; a method whose warm-up raises is dropped into ``failures``."""
    for name, fn in list(steps.items()):  # warm-up (torch.func tracing, allocator)
        try:
            fn()
        except Exception as err:
            if failures is None or name != "opacus_ghost":
                raise
            failures[name] = f"{type(err).__name__}: {err}"
            del steps[name]
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


def release_free_heap() -> None:
    """Return freed heap pages to the system (glibc ``malloc_trim``) so that the resident set
    is what is in use: without it, a method whose setup freed a lot (the anchor subspace)
    would run its step in pages already resident and its peak would be undercounted."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: levels include freed pages
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def memory_level(device: torch.device, peak: bool = False) -> float:
    """MiB in use now (or the high-water mark since the last reset): resident set on CPU,
    allocated tensors on CUDA."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        return (
            torch.cuda.max_memory_allocated() if peak else torch.cuda.memory_allocated()
        ) / 2**20
    return _status_kib("VmHWM" if peak else "VmRSS") / 1024


def measure_peak(fn, device: torch.device) -> float:
    """MiB by which one call of ``fn`` raises memory above the level before it."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        release_free_heap()
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS high-water mark
    before = memory_level(device)
    fn()
    return memory_level(device, peak=True) - before


def peak_memory(
    setup: str, method: str, device: str, num_anchors: int, max_chunk: int, threads: int = 0
) -> tuple[float, float]:
    """Peak MiB of the second step in a fresh subprocess, above two levels: the process's level
    just before that step, and the level before the first step (after building the models), which
    also counts what a method keeps between steps (Opacus keeps the per-example gradients of the
    last step, ``p.grad_sample``, until the next ``zero_grad``)."""
    code = (
        "import sys, torch; sys.path.insert(0, 'benchmarks');"
        "import step_time as s;"
        + (f"torch.set_num_threads({threads});" if threads else "")
        + f"dev = torch.device('{device}');"
        f"steps, *_ = s.make_steps('{setup}', dev, {num_anchors}, {max_chunk}, "
        f"{method in WITH_ANCHORS}, False);"
        "fn = steps['" + method + "']; s.release_free_heap(); b0 = s.memory_level(dev); fn();"
        "print(s.measure_peak(fn, dev), s.memory_level(dev, peak=True) - b0)"
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
    step, with_state = map(float, out.stdout.strip().splitlines()[-1].split())
    return step, with_state


def _ratio(a, b) -> str:
    if a is None or not b:
        return "-"
    return f"{a / b:.2f}" if a / b >= 0.1 else f"{a / b:.3f}"


def section(setup, args, result, failures) -> list[str]:
    """The Markdown section of one model: table, anchor time, failures."""
    times, mem = result["seconds"], result["peak_mib"]
    lines = [
        f"## {setup}: {result['params']:,} parameters, input {result['input']}, "
        f"batch {result['batch']}, k = {result['k']} ({result['basis']}), "
        f"{args.num_anchors} anchors",
        "",
        f"{result['device']}, {result['threads']} threads, median of {args.repeats} interleaved "
        f"repeats, max_chunk {args.max_chunk}. Command: `{result['command']}`",
        "",
        "| method | step ms | x non-private | x our GP | x Opacus | step peak MiB | x GP | "
        "x Opacus | peak MiB incl. kept state | x GP | x Opacus |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in METHODS:
        if m not in times:
            lines.append(f"| {m} | failed (below) |" + " - |" * 9)
            continue
        t = times[m]
        cells = [
            f"{1000 * t:.1f}",
            f"{t / times['nonprivate']:.2f}",
            f"{t / times['gp']:.2f}",
            f"{t / times['opacus']:.2f}",
        ]
        for peaks in (mem, result.get("peak_mib_with_state", {})):
            mm = peaks.get(m)
            cells += [
                "-" if mm is None else f"{mm:.0f}",
                _ratio(mm, peaks.get("gp")),
                _ratio(mm, peaks.get("opacus")),
            ]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    anchor_s = result["anchor_seconds_per_refresh"]
    plain_s = result["anchor_seconds_materialised"]
    lines += [
        "",
        f"Anchor subspace per refresh: {anchor_s:.2f} s ({anchor_s / times['gep']:.1f} GEP "
        f"steps); without Gram groups (`factored_layers=False`, what `gep_materialised` "
        f"embeds in): {plain_s:.2f} s.",
    ]
    embed_s, gflop = result["embedding_product_seconds"], result["embedding_product_gflop"]
    extra_ms = 1000 * (times["gep"] - times["gp"])
    lines.append(
        f"\nGEP's embedding product alone (per-example gradients times the bases, "
        f"2 B sum_g p_g k_g = {gflop:.1f} GFLOP): {1000 * embed_s:.1f} ms, "
        f"{gflop / embed_s:.0f} GFLOP/s; GEP's step takes {extra_ms:.0f} ms more than our GP's."
    )
    served = ", ".join(f"{how} x {n}" for how, n in sorted(result["engines"].items()))
    lines.append(f"\nLayer engine, per layer with parameters: {served}.")
    for m, why in failures.items():
        lines.append(f"\n{m} did not run: {why}")
    lines.append("")
    return lines


def main(argv=None) -> int:
    began = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--num-anchors", type=int, default=2000)
    ap.add_argument("--max-chunk", type=int, default=256)
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument(
        "--append", action="store_true", help="append to the results instead of replacing them"
    )
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    command = "python benchmarks/step_time.py " + " ".join(sys.argv[1:] if argv is None else argv)
    results = {}
    lines = []
    if not args.append:
        lines += [
            f"# Step time and memory ({device}, {torch.get_num_threads()} threads, "
            f"median of {args.repeats} interleaved repeats)",
            "",
        ]
    for setup in args.models:
        steps, anchor_s, p, failures, embedding_product, gram_weights = make_steps(
            setup, device, args.num_anchors, args.max_chunk
        )
        times = time_steps(steps, args.repeats, device, failures)
        embed_s = time_steps({"embed": embedding_product}, args.repeats, device)["embed"]
        both = (
            {}
            if args.no_memory
            else {
                m: peak_memory(
                    setup, m, args.device, args.num_anchors, args.max_chunk, args.threads
                )
                for m in times
            }
        )
        mem = {m: v[0] for m, v in both.items()}
        mem_state = {m: v[1] for m, v in both.items()}
        _, shape, batch, k, groups = SETUPS[setup]
        model = SETUPS[setup][0]()
        layout = ParameterLayout.from_model(model, groups)
        engines = {}
        gram_layers = {name.rsplit(".", 1)[0] for name in gram_weights}
        for layer, how in layer_engines(model, torch.randn(batch, *shape)).items():
            if layer in gram_layers:  # GEP and B-GEP embed it by Gram products, GP by the rule
                how = f"{how.split(':')[0]}: Gram (GEP, B-GEP), rule (GP)"
            engines[how] = engines.get(how, 0) + 1
        dims = layout.allocate_basis(k, max_rank=args.num_anchors)
        basis_mib = 4 * sum(g.size * d for g, d in zip(layout.groups, dims, strict=True)) / 2**20
        # a run whose chunks split the batch is kept beside the whole-batch run of the model
        key = setup if args.max_chunk >= batch else f"{setup}-chunk{args.max_chunk}"
        results[key] = {
            "params": p,
            "input": "x".join(map(str, shape)),
            "batch": batch,
            "k": sum(dims),
            "k_requested": k,
            "basis": f"{len(dims)} groups, {basis_mib:,.0f} MiB of bases",
            "k_per_group": dict(zip((g.name for g in layout.groups), dims, strict=True)),
            "num_anchors": args.num_anchors,
            "max_chunk": args.max_chunk,
            "repeats": args.repeats,
            "device": str(device),
            "threads": torch.get_num_threads(),
            "command": command,
            "seconds": times,
            "peak_mib": mem,
            "peak_mib_with_state": mem_state,
            "anchor_seconds_per_refresh": anchor_s["gram"],
            "anchor_seconds_materialised": anchor_s["materialised"],
            "gram_weights": sorted(gram_weights),
            "embedding_product_seconds": embed_s,
            # 2 B sum_g p_g k_g: each example's gradient times its group's basis
            "embedding_product_gflop": 2e-9
            * batch
            * sum(g.size * d for g, d in zip(layout.groups, dims, strict=True)),
            "failures": failures,
            "engines": engines,
        }
        lines += section(setup, args, results[key], failures)
    wall = time.perf_counter() - began
    lines.append(f"Wall time of this run: {wall:.0f} s ({wall / 60:.1f} min).\n")
    report = "\n".join(lines)
    print(report)
    name = f"step_time_{device.type}"
    md = Path(__file__).parent / "results" / f"{name}.md"
    json_path = Path(__file__).parent / "results" / f"{name}.json"
    if args.append and json_path.exists():
        previous = json.loads(json_path.read_text())
        results = {**previous.get("results", {}), **results}
    save(name, {"device": str(device), "threads": torch.get_num_threads(), "results": results})
    if args.append and md.exists():
        md.write_text(md.read_text().rstrip("\n") + "\n\n\n" + report + "\n")
    else:
        md.write_text(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

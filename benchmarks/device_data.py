"""The CIFAR-10 benchmark's data for a machine without ``../shared/data``: the device tool
sends the checkout (64 MiB at most), not the folder beside it, and the three CIFAR-10 batches
alone are 92 MB. ``pack`` stores them losslessly as WebP (about 17 MB a batch) with the
held Tiny-ImageNet anchors; ``unpack`` rebuilds the data folder there and checks every
CIFAR-10 file against the original's MD5 and the anchors against theirs.

Only the anchors of ``benchmarks/standard.py`` travel (the first ``--num-public`` images of
its fixed public order); the other Tiny-ImageNet images are zeros in the rebuilt file, so a
run that reads them (the public warm start) must not use an unpacked folder.

    python benchmarks/device_data.py pack ../shared/data .device-data   # here
    python benchmarks/device_data.py unpack .device-data /tmp/data      # there
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import sys
from pathlib import Path

import numpy as np

BATCHES = (1, 2, 5)
RECORD = 3073  # one label byte, then 1,024 red, green and blue bytes
GRID = 100  # images per row of the tiling (a batch: 100 x 100 images, 3,200 x 3,200 pixels)
CIFAR = Path("cifar10") / "cifar-10-batches-bin"
TINY = Path("tinyimagenet") / "tinyimagenet_val_32x32.npz"


def md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


def tile(images: np.ndarray) -> np.ndarray:
    """(n, 32, 32, 3) images, n a multiple of GRID, as one (n / GRID * 32, GRID * 32, 3) image."""
    rows = len(images) // GRID
    return (
        images.reshape(rows, GRID, 32, 32, 3)
        .transpose(0, 2, 1, 3, 4)
        .reshape(rows * 32, GRID * 32, 3)
    )


def untile(big: np.ndarray) -> np.ndarray:
    rows = big.shape[0] // 32
    return big.reshape(rows, 32, GRID, 32, 3).transpose(0, 2, 1, 3, 4).reshape(-1, 32, 32, 3)


def write_webp(images: np.ndarray, path: Path) -> None:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(tile(images)).save(buf, "WEBP", lossless=True, quality=100, method=4)
    path.write_bytes(buf.getvalue())


def read_webp(path: Path) -> np.ndarray:
    try:
        from PIL import Image

        big = np.asarray(Image.open(path).convert("RGB"))
    except Exception:  # a Pillow built without WebP: OpenCV decodes it too
        import cv2

        big = cv2.imread(str(path), cv2.IMREAD_COLOR)[..., ::-1]
    return untile(np.ascontiguousarray(big))


def anchor_order(count: int, total: int) -> np.ndarray:
    """The anchors ``benchmarks/standard.py`` holds: the first ``count`` of its public order."""
    return np.random.default_rng(0).permutation(total)[:count]


def pack(data_dir: Path, dest: Path, num_public: int) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    manifest = {"num_public": num_public, "batches": {}}
    for b in BATCHES:
        raw = (data_dir / CIFAR / f"data_batch_{b}.bin").read_bytes()
        records = np.frombuffer(raw, np.uint8).reshape(-1, RECORD)
        images = records[:, 1:].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        write_webp(images, dest / f"cifar_batch_{b}.webp")
        np.save(dest / f"cifar_batch_{b}_labels.npy", records[:, 0].copy())
        manifest["batches"][str(b)] = md5(raw)
        print(f"batch {b}: {(dest / f'cifar_batch_{b}.webp').stat().st_size:,} bytes", flush=True)
    with np.load(data_dir / TINY) as tiny:
        x, y = tiny["x"], tiny["y"]
    keep = anchor_order(num_public, len(x))
    held = np.zeros_like(x)
    held[keep] = x[keep]
    write_webp(held, dest / "tinyimagenet_anchors.webp")
    np.save(dest / "tinyimagenet_labels.npy", y)
    manifest["anchors_md5"] = md5(x[keep].tobytes())
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    total = sum(f.stat().st_size for f in dest.iterdir())
    print(f"{dest}: {total / 2**20:.1f} MiB", flush=True)


def unpack(src: Path, data_dir: Path) -> None:
    manifest = json.loads((src / "manifest.json").read_text())
    (data_dir / CIFAR).mkdir(parents=True, exist_ok=True)
    for b, expected in manifest["batches"].items():
        images = read_webp(src / f"cifar_batch_{b}.webp")
        labels = np.load(src / f"cifar_batch_{b}_labels.npy")
        records = np.concatenate(
            [labels[:, None], images.transpose(0, 3, 1, 2).reshape(len(labels), -1)], axis=1
        )
        raw = records.astype(np.uint8).tobytes()
        if md5(raw) != expected:
            raise SystemExit(f"batch {b}: rebuilt file's MD5 {md5(raw)} is not {expected}")
        (data_dir / CIFAR / f"data_batch_{b}.bin").write_bytes(raw)
    held = read_webp(src / "tinyimagenet_anchors.webp")
    keep = anchor_order(manifest["num_public"], len(held))
    if md5(np.ascontiguousarray(held[keep]).tobytes()) != manifest["anchors_md5"]:
        raise SystemExit("Tiny-ImageNet anchors: rebuilt images differ from the originals")
    (data_dir / TINY).parent.mkdir(parents=True, exist_ok=True)
    np.savez(data_dir / TINY, x=held, y=np.load(src / "tinyimagenet_labels.npy"))
    print(
        f"{data_dir}: CIFAR-10 batches {', '.join(manifest['batches'])} (MD5 as the "
        f"originals) and {manifest['num_public']:,} Tiny-ImageNet anchors",
        flush=True,
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=("pack", "unpack"))
    ap.add_argument("source", type=Path, help="pack: the shared data folder; unpack: the pack")
    ap.add_argument("dest", type=Path, help="pack: the pack's folder; unpack: a data folder")
    ap.add_argument("--num-public", type=int, default=2000, help="anchors held (as standard.py)")
    args = ap.parse_args(argv)
    if args.action == "pack":
        pack(args.source, args.dest, args.num_public)
    else:
        unpack(args.source, args.dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Lazy data-set formats: pixel and label round trips, laziness, declared transforms, errors."""

from __future__ import annotations

import gzip
import pickle
import sys
import tracemalloc

import numpy as np
import pytest
import torch
from conftest import shared_file
from PIL import Image

from gep_fed.data.datasets import MNIST_MEAN, MNIST_STD, to_tensor
from gep_fed.data.formats import (
    Cifar10Dataset,
    DataError,
    DicomFolderDataset,
    IdxDataset,
    ImageFolderDataset,
    ImageTransform,
    MedMNISTDataset,
    NpzDataset,
    read_idx,
)


def write_idx(path, array: np.ndarray, compress: bool = False) -> None:
    header = bytes([0, 0, 8, array.ndim]) + b"".join(d.to_bytes(4, "big") for d in array.shape)
    data = header + array.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(data) if compress else data)


def write_cifar(path, images: np.ndarray, labels: np.ndarray) -> None:
    """images (N, 32, 32, 3) uint8 to records of label byte + CHW pixel bytes."""
    planes = images.transpose(0, 3, 1, 2).reshape(len(images), -1)
    path.write_bytes(np.concatenate([labels[:, None].astype(np.uint8), planes], axis=1).tobytes())


def write_pngs(root, layout: dict[str, list[np.ndarray]]) -> None:
    for name, images in layout.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for j, image in enumerate(images):
            Image.fromarray(image).save(root / name / f"{j}.png")


def write_dicom(path, stored: np.ndarray, *, bits=12, signed=False, **attrs) -> None:
    """A minimal valid single-frame grey DICOM file (explicit VR little endian)."""
    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.uid import ExplicitVRLittleEndian, SecondaryCaptureImageStorage, generate_uid

    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = SecondaryCaptureImageStorage
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = Dataset()
    ds.file_meta = meta
    ds.SOPClassUID, ds.SOPInstanceUID = (
        SecondaryCaptureImageStorage,
        meta.MediaStorageSOPInstanceUID,
    )
    ds.Rows, ds.Columns = stored.shape
    ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
    ds.BitsAllocated, ds.BitsStored, ds.HighBit = 16, bits, bits - 1
    ds.PixelRepresentation = int(signed)
    for key, value in attrs.items():
        setattr(ds, key, value)
    ds.PixelData = stored.astype("<i2" if signed else "<u2").tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    ds.save_as(path, enforce_file_format=True)


def pydicom_or_skip():
    return pytest.importorskip(
        "pydicom", minversion="3.0", reason="DICOM tests need pydicom>=3 (gep-fed[test])"
    )


# --- the declared transform ---------------------------------------------------------------


def test_transform_normalises_by_declared_constants_and_converts_channels():
    grey = np.array([[0, 255], [51, 102]], np.uint8)
    x = ImageTransform(mean=0.5, std=0.25)(grey)
    assert x.dtype == torch.float32 and x.shape == (1, 2, 2)
    assert torch.allclose(x, (torch.tensor([[[0, 255], [51, 102]]]) / 255 - 0.5) / 0.25)
    rgb = np.zeros((1, 2, 3), np.uint8)
    rgb[0, 0] = (255, 0, 0)
    rgb[0, 1] = (0, 0, 255)
    per_channel = ImageTransform(mean=(0.5, 0.0, 0.0), std=(0.5, 1.0, 2.0))(rgb)
    assert per_channel[:, 0, 0].tolist() == [1.0, 0.0, 0.0]
    assert per_channel[:, 0, 1].tolist() == [-1.0, 0.0, 0.5]
    as_grey = ImageTransform(channels=1)(rgb)
    assert as_grey.shape == (1, 1, 2)
    assert torch.allclose(as_grey[0, 0], torch.tensor([0.299, 0.114]))
    as_rgb = ImageTransform(channels=3, extra=lambda t: t * 2)(grey)
    assert as_rgb.shape == (3, 2, 2) and torch.equal(as_rgb[0], as_rgb[2])
    assert torch.allclose(as_rgb[1], 2 * torch.tensor([[0, 255], [51, 102]]) / 255)


def test_transform_resize_is_antialiased():
    checkerboard = ((np.indices((64, 64)).sum(axis=0) % 2) * 255).astype(np.uint8)
    small = ImageTransform(size=(8, 4))(checkerboard)
    # Without antialiasing, bilinear sampling of a checkerboard gives 0s and 1s, not grey.
    assert small.shape == (1, 8, 4) and torch.allclose(
        small, torch.full_like(small, 0.5), atol=0.02
    )
    flat = ImageTransform(size=(40, 50), mean=0.2, std=0.5)(np.full((10, 10), 51, np.uint8))
    assert flat.shape == (1, 40, 50) and torch.allclose(flat, torch.zeros_like(flat), atol=1e-6)


@pytest.mark.parametrize(
    "kwargs", [{"channels": 2}, {"std": 0.0}, {"mean": (0.1, 0.2)}, {"size": (0, 4)}]
)
def test_transform_rejects_bad_declarations(kwargs):
    with pytest.raises(ValueError):
        ImageTransform(**kwargs)


def test_transform_rejects_per_channel_constants_for_a_grey_image():
    with pytest.raises(ValueError, match="declare channels=3"):
        ImageTransform(mean=(0.1, 0.2, 0.3))(np.zeros((4, 4), np.uint8))


# --- image folders ------------------------------------------------------------------------


def test_image_folder_round_trips_png_and_jpeg(tmp_path):
    rng = np.random.default_rng(0)
    cats = [rng.integers(0, 256, (6, 5), dtype=np.uint8) for _ in range(2)]
    dogs = [rng.integers(0, 256, (6, 5), dtype=np.uint8)]
    write_pngs(tmp_path, {"cat": cats, "dog": dogs})
    Image.fromarray(np.full((6, 5), 100, np.uint8)).save(tmp_path / "dog" / "flat.JPG", quality=95)
    (tmp_path / "notes").mkdir()  # a folder with no images: ignored when classes are declared

    ds = ImageFolderDataset(tmp_path, classes=["dog", "cat"])
    assert len(ds) == 4 and ds.num_classes == 2 and ds.classes == ["dog", "cat"]
    assert ds.targets().tolist() == [0, 0, 1, 1]
    x, y = ds[2]
    assert y.dtype == torch.int64 and y.ndim == 0 and int(y) == 1
    assert torch.equal((x[0] * 255).round().to(torch.uint8), torch.from_numpy(cats[0]))
    assert torch.equal((ds[0][0][0] * 255).round().to(torch.uint8), torch.from_numpy(dogs[0]))
    jpeg = ds[1][0] * 255
    assert (jpeg - 100).abs().max() <= 2

    rgb = rng.integers(0, 256, (4, 3, 3), dtype=np.uint8)
    write_pngs(tmp_path / "rgb", {"a": [rgb]})
    x, _ = ImageFolderDataset(tmp_path / "rgb")[0]
    assert x.shape == (3, 4, 3)
    assert torch.equal((x * 255).round().to(torch.uint8), torch.from_numpy(rgb).permute(2, 0, 1))


def test_image_folder_scales_16_bit_grey_by_its_bit_depth(tmp_path):
    (tmp_path / "a").mkdir()
    Image.fromarray(np.array([[0, 257 * 10, 65535]], np.uint16)).save(tmp_path / "a" / "0.png")
    x, _ = ImageFolderDataset(tmp_path)[0]
    assert (x[0, 0] * 255).round().tolist() == [0.0, 10.0, 255.0]


def test_image_folder_decodes_only_the_requested_files(tmp_path, monkeypatch):
    write_pngs(
        tmp_path,
        {str(c): [np.full((4, 4), 10 * c + j, np.uint8) for j in range(3)] for c in range(3)},
    )
    opened = []
    original = Image.open

    def counting_open(fp, *args, **kwargs):
        opened.append(fp)
        return original(fp, *args, **kwargs)

    monkeypatch.setattr(Image, "open", counting_open)
    declared = ImageFolderDataset(tmp_path, ImageTransform(size=(4, 4), channels=1))
    assert declared.targets().tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2] and opened == []
    for i in (7, 2, 7):
        assert int(declared[i][0][0, 0, 0] * 255 + 0.5) == 10 * (i // 3) + i % 3
    assert opened == [declared.files[7], declared.files[2], declared.files[7]]

    # With no declared size, the first file's header is read once as the expected size.
    opened.clear()
    native = ImageFolderDataset(tmp_path)
    _ = native[5], native[8]
    assert opened == [native.files[5], native.files[0], native.files[8]]


def test_an_image_above_the_pixel_cap_is_one_bad_example_named_before_its_pixels_decode(
    tmp_path, monkeypatch
):
    """A scan of more values than ``MAX_IMAGE_VALUES`` (its header's size and channels) is
    refused before it is decoded, by ``check()`` and on read, in its own words; the images
    beside it read as before."""
    import gep_fed.data.formats as formats

    write_pngs(tmp_path, {"a": [np.zeros((8, 8), np.uint8), np.zeros((16, 16), np.uint8)]})
    monkeypatch.setattr(formats, "MAX_IMAGE_VALUES", 100)
    decoded = []
    original = formats._pil_array
    monkeypatch.setattr(formats, "_pil_array", lambda image: decoded.append(1) or original(image))
    ds = ImageFolderDataset(tmp_path, ImageTransform(size=(8, 8), channels=1))
    assert ds[0][0].shape == (1, 8, 8) and decoded == [1]
    with pytest.raises(DataError, match=r"16x16 \(HxW\) with 1 channel\(s\), 256 values") as err:
        ds[1]
    assert "cannot decode" not in str(err.value)  # an intact file, refused for its size
    assert decoded == [1]  # the large one's pixels were never decoded
    with pytest.raises(DataError, match="downsample it before it joins the data folder"):
        ds.check()


def test_a_dicom_image_above_the_cap_is_refused_from_its_header_before_its_pixels(
    tmp_path, monkeypatch
):
    pydicom = pydicom_or_skip()
    import gep_fed.data.formats as formats

    write_dicom(tmp_path / "a" / "0.dcm", np.zeros((4, 4)))
    write_dicom(tmp_path / "a" / "1.dcm", np.zeros((12, 12)))
    monkeypatch.setattr(formats, "MAX_IMAGE_VALUES", 100)
    decoded = []
    original = pydicom.dataset.Dataset.pixel_array
    monkeypatch.setattr(
        pydicom.dataset.Dataset,
        "pixel_array",
        property(lambda ds: decoded.append(1) or original.fget(ds)),
    )
    ds = DicomFolderDataset(tmp_path, ImageTransform(size=(4, 4), channels=1))
    assert ds[0][0].shape == (1, 4, 4) and decoded == [1]
    with pytest.raises(DataError, match=r"12x12 \(HxW\) with 1 channel\(s\), 144 values") as err:
        ds[1]
    assert decoded == [1] and "cannot read" not in str(err.value)


def test_a_site_may_lack_a_declared_class_but_not_every_image(tmp_path):
    """Issue 24: a hospital with no cases of a rare class takes part; the declared numbering
    is kept (its peers agree on the labels), and the missing classes are named."""
    write_pngs(tmp_path, {"a": [np.zeros((2, 2), np.uint8)], "c": [np.zeros((2, 2), np.uint8)]})
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "readme.txt").write_text("no images")
    ds = ImageFolderDataset(tmp_path, classes=["a", "b", "c", "d"])
    assert ds.missing_classes == ["b", "d"] and ds.num_classes == 4
    assert ds.targets().tolist() == [0, 2]
    with pytest.raises(DataError, match=r"holds no \.png/\.jpg/\.jpeg files in any class folder"):
        ImageFolderDataset(tmp_path / "b", classes=["b", "d"])
    with pytest.raises(DataError, match="does not exist"):
        ImageFolderDataset(tmp_path / "nowhere")
    (tmp_path / "file.png").write_bytes(b"")
    with pytest.raises(DataError, match=r"file\.png is a file, not a folder of class folders"):
        ImageFolderDataset(tmp_path / "file.png")


def test_a_folder_matching_no_declared_class_is_reported_with_its_image_count(tmp_path):
    """Issue 51: a misspelt class folder ("clas3" for "class3") was silently left out; it is
    now an error naming the folder and its image count. A folder without images is ignored."""
    image = np.zeros((2, 2), np.uint8)
    write_pngs(tmp_path, {"class0": [image], "class1": [image] * 2, "clas3": [image] * 3})
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("no images")
    declared = ["class0", "class1", "class2", "class3"]
    with pytest.raises(DataError, match=r"folder 'clas3' holds 3 image\(s\), but no declared"):
        ImageFolderDataset(tmp_path, classes=declared)
    (tmp_path / "clas3").rename(tmp_path / "class3")
    ds = ImageFolderDataset(tmp_path, classes=declared)
    assert ds.targets().tolist() == [0, 1, 1, 3, 3, 3] and ds.missing_classes == ["class2"]


def test_undeclared_classes_are_the_folders_holding_images_so_an_empty_one_shifts_no_label(
    tmp_path,
):
    """Without declared classes an empty ``archive/`` counted as class 0: every label after
    it moved up by one (a run with --drop-bad-examples trained normal images as pneumonia)."""
    image = np.zeros((2, 2), np.uint8)
    write_pngs(tmp_path, {"normal": [image] * 2, "pneumonia": [image]})
    (tmp_path / "archive").mkdir()
    ds = ImageFolderDataset(tmp_path)
    assert ds.classes == ["normal", "pneumonia"] and ds.targets().tolist() == [0, 0, 1]


@pytest.mark.parametrize("where", ["top", "hidden"])
def test_images_outside_any_class_folder_are_named_not_left_out(tmp_path, where):
    """Images in the data folder itself (or in a hidden folder) have no label: they were
    skipped without a word, and the site check said ready."""
    image = np.zeros((2, 2), np.uint8)
    write_pngs(tmp_path, {"normal": [image], "pneumonia": [image]})
    write_pngs(tmp_path, {"." if where == "top" else ".normal": [image] * 3})
    message = r"3 image\(s\) in the folder itself" if where == "top" else "hidden folder '.normal'"
    with pytest.raises(DataError, match=message + ".*outside any class folder"):
        ImageFolderDataset(tmp_path)
    with pytest.raises(DataError, match="outside any class folder"):
        ImageFolderDataset(tmp_path, classes=["normal", "pneumonia"])


def test_image_files_of_a_format_the_task_does_not_read_are_named_not_left_out(tmp_path):
    """A .tif among PNGs was skipped without a word, and the site check said ready."""
    image = np.zeros((2, 2), np.uint8)
    write_pngs(tmp_path, {"a": [image], "b": [image]})
    (tmp_path / "b" / "scan.tif").write_bytes(b"II*\x00")
    (tmp_path / "b" / "notes.txt").write_text("not an image: ignored")
    with pytest.raises(DataError, match=r"does not read \(\.png/\.jpg/\.jpeg only\): folder 'b' "):
        ImageFolderDataset(tmp_path)
    (tmp_path / "b" / "scan.tif").unlink()
    assert len(ImageFolderDataset(tmp_path)) == 2
    (tmp_path / "a" / "photo.jpe").write_bytes(b"\xff\xd8")  # JPEG's rarer suffixes too
    with pytest.raises(DataError, match=r"folder 'a' holds 1 \(\.jpe\)"):
        ImageFolderDataset(tmp_path)


def test_image_folder_corrupt_images_are_named_on_read_and_by_check(tmp_path):
    rng = np.random.default_rng(1)
    write_pngs(tmp_path, {"a": [rng.integers(0, 256, (16, 16), dtype=np.uint8) for _ in range(3)]})
    good = (tmp_path / "a" / "2.png").read_bytes()
    (tmp_path / "a" / "1.png").write_bytes(good[: len(good) // 2])  # truncated
    (tmp_path / "a" / "3.png").write_bytes(b"not an image at all")
    ds = ImageFolderDataset(tmp_path)
    assert ds[0][0].shape == (1, 16, 16) and ds[2][0].shape == (1, 16, 16)
    with pytest.raises(DataError, match=r"a/1\.png"):
        ds[1]
    with pytest.raises(DataError, match=r"a/3\.png"):
        ds[3]
    with pytest.raises(DataError, match=r"a/1\.png"):
        ds.check()


def test_image_folder_mixed_sizes_need_a_declared_resize(tmp_path):
    write_pngs(tmp_path, {"a": [np.zeros((8, 8), np.uint8)], "b": [np.zeros((10, 12), np.uint8)]})
    ds = ImageFolderDataset(tmp_path)
    message = r"b/0\.png is 10x12 \(HxW\) but the expected size is 8x8 \(that of .*a/0\.png\)"
    with pytest.raises(DataError, match=message):
        ds[1]
    with pytest.raises(DataError, match=message):
        ds.check()
    resized = ImageFolderDataset(tmp_path, ImageTransform(size=(8, 8)))
    resized.check()
    assert resized[1][0].shape == (1, 8, 8)

    write_pngs(
        tmp_path / "colour", {"a": [np.zeros((8, 8), np.uint8), np.zeros((8, 8, 3), np.uint8)]}
    )
    with pytest.raises(DataError, match=r"1\.png has 3 channel\(s\) but the expected number is 1"):
        ImageFolderDataset(tmp_path / "colour")[1]
    assert ImageFolderDataset(tmp_path / "colour", ImageTransform(channels=3))[0][0].shape == (
        3,
        8,
        8,
    )


def test_an_unreadable_first_file_is_one_bad_example_not_the_reference_of_every_other(tmp_path):
    """The others' size was checked against the first file's header: when that file was
    unreadable, every image failed and a site could answer no round."""
    write_pngs(tmp_path, {"a": [np.zeros((8, 8), np.uint8)] * 3, "b": [np.zeros((8, 8), np.uint8)]})
    first = tmp_path / "a" / "0.png"
    first.write_bytes(first.read_bytes()[:20])
    ds = ImageFolderDataset(tmp_path)
    assert [ds[i][0].shape for i in (1, 2, 3)] == [(1, 8, 8)] * 3
    with pytest.raises(DataError, match=r"a/0\.png"):
        ds[0]
    with pytest.raises(DataError, match=r"a/0\.png: not a readable image"):
        ds.check()


# --- numpy archives -----------------------------------------------------------------------


def test_npz_round_trip_maps_uncompressed_and_loads_compressed(tmp_path):
    rng = np.random.default_rng(2)
    images = rng.integers(0, 256, (200, 16, 16, 3), dtype=np.uint8)
    labels = rng.integers(0, 5, 200)
    np.savez(tmp_path / "site.npz", images=images, labels=labels)
    np.savez_compressed(tmp_path / "packed.npz", images=images, labels=labels)
    for name in ("site.npz", "packed.npz"):
        ds = NpzDataset(tmp_path / name, num_classes=5)
        assert len(ds) == 200 and ds.num_classes == 5 and not ds.multi_label
        assert np.array_equal(ds.targets(), labels)
        x, y = ds[123]
        assert x.shape == (3, 16, 16) and int(y) == labels[123]
        assert torch.equal(
            (x * 255).round().to(torch.uint8), torch.from_numpy(images[123]).permute(2, 0, 1)
        )
    # The uncompressed file is mapped: a pickled data set (for DataLoader workers) is small.
    mapped = pickle.dumps(NpzDataset(tmp_path / "site.npz"))
    assert len(mapped) < 20_000 < images.nbytes
    assert torch.equal(pickle.loads(mapped)[7][0], NpzDataset(tmp_path / "packed.npz")[7][0])


def test_npz_multi_label_targets_are_float_0_1(tmp_path):
    labels = np.array([[1, 0, 1], [0, 0, 0]], np.uint8)
    np.savez(tmp_path / "m.npz", images=np.zeros((2, 4, 4), np.uint8), labels=labels)
    ds = NpzDataset(tmp_path / "m.npz")
    assert ds.multi_label and ds.num_classes == 3
    y = ds[0][1]
    assert y.dtype == torch.float32 and y.tolist() == [1.0, 0.0, 1.0]
    assert ds.targets().dtype == np.float32


@pytest.mark.parametrize(
    ("arrays", "kwargs", "message"),
    [
        (
            {"images": np.zeros((3, 4, 4), np.uint8), "labels": np.array([0, 1, 5])},
            {"num_classes": 5},
            "label 5 of example 2 is outside 0..4",
        ),
        (
            {"images": np.zeros((3, 4, 4), np.uint8), "labels": np.array([0, -1, 1])},
            {},
            "label -1 of example 1",
        ),
        (
            {"images": np.zeros((3, 4, 4), np.float32), "labels": np.zeros(3, int)},
            {},
            "expected uint8 images",
        ),
        (
            {"images": np.zeros((3, 4, 4), np.uint8), "labels": np.zeros(2, int)},
            {},
            "3 images but 2 labels",
        ),
        (
            {"images": np.zeros((3, 4, 4), np.uint8), "labels": np.zeros(3)},
            {},
            "integer class labels",
        ),
        (
            {"images": np.zeros((2, 4, 4), np.uint8), "labels": np.array([[0, 2], [1, 0]])},
            {},
            "must all be 0 or 1",
        ),
        ({"x": np.zeros(3)}, {}, r"has no array 'images' \(it has \['x'\]\)"),
    ],
)
def test_npz_malformed_files_name_the_file(tmp_path, arrays, kwargs, message):
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(DataError, match=rf"bad\.npz.*{message}"):
        NpzDataset(path, **kwargs)


def test_npz_missing_and_damaged_files(tmp_path):
    with pytest.raises(DataError, match=r"missing\.npz does not exist"):
        NpzDataset(tmp_path / "missing.npz")
    (tmp_path / "junk.npz").write_bytes(b"PK but not a zip")
    with pytest.raises(DataError, match=r"junk\.npz"):
        NpzDataset(tmp_path / "junk.npz")


def test_medmnist_splits_single_and_multi_label(tmp_path):
    splits = ("train", "val", "test")
    single = {f"{s}_images": np.full((3, 28, 28), i, np.uint8) for i, s in enumerate(splits)}
    single |= {"train_labels": np.array([[0], [3], [1]]), "val_labels": np.array([[1], [0], [2]])}
    single["test_labels"] = np.array([[0], [1], [0]])
    np.savez_compressed(tmp_path / "single.npz", **single)
    test = MedMNISTDataset(tmp_path / "single.npz", "test")
    # The class count comes from all splits, so the test split agrees with training.
    assert test.num_classes == 4 and test.targets().tolist() == [0, 1, 0]
    assert (test[0][0] * 255).round().unique().tolist() == [2.0]
    with pytest.raises(DataError, match=r"single\.npz.*label 3 of example 1 is outside 0..1"):
        MedMNISTDataset(tmp_path / "single.npz", "train", num_classes=2)
    with pytest.raises(DataError, match="split must be one of"):
        MedMNISTDataset(tmp_path / "single.npz", "validation")

    multi = {f"{s}_images": np.zeros((2, 28, 28, 3), np.uint8) for s in splits}
    multi |= {f"{s}_labels": np.eye(14, dtype=np.uint8)[[0, 13]] for s in splits}
    np.savez_compressed(tmp_path / "chestmnist.npz", **multi)
    chest = MedMNISTDataset(tmp_path / "chestmnist.npz", "val")
    assert chest.multi_label and chest.num_classes == 14
    x, y = chest[1]
    assert x.shape == (3, 28, 28) and y.dtype == torch.float32 and y.nonzero().tolist() == [[13]]


# --- IDX and CIFAR-10 binary --------------------------------------------------------------


def test_idx_raw_and_gzipped_round_trip(tmp_path):
    rng = np.random.default_rng(3)
    images, labels = rng.integers(0, 256, (500, 7, 9), dtype=np.uint8), rng.integers(0, 10, 500)
    write_idx(tmp_path / "img", images)
    write_idx(tmp_path / "lab", labels)
    write_idx(tmp_path / "img.gz", images, compress=True)
    write_idx(tmp_path / "lab.gz", labels, compress=True)
    raw = IdxDataset(tmp_path / "img", tmp_path / "lab", num_classes=10)
    packed = IdxDataset(tmp_path / "img.gz", tmp_path / "lab.gz")
    for ds in (raw, packed, pickle.loads(pickle.dumps(raw))):
        assert np.array_equal(ds.targets(), labels)
        x, y = ds[-1]
        assert x.shape == (1, 7, 9) and int(y) == labels[-1]
        assert torch.equal((x[0] * 255).round().to(torch.uint8), torch.from_numpy(images[-1]))
    assert len(pickle.dumps(raw)) < 5_000 + labels.nbytes < images.nbytes
    with pytest.raises(IndexError):
        raw[500]


def test_idx_malformed_files_name_the_file(tmp_path):
    write_idx(tmp_path / "img", np.zeros((4, 3, 3), np.uint8))
    write_idx(tmp_path / "lab", np.zeros(4, np.uint8))
    write_idx(tmp_path / "lab3", np.zeros(3, np.uint8))
    with pytest.raises(DataError, match=r"img / .*lab3: 4 images but 3 labels"):
        IdxDataset(tmp_path / "img", tmp_path / "lab3")
    with pytest.raises(DataError, match=r"lab has shape \[4\]; expected IDX images"):
        IdxDataset(tmp_path / "lab", tmp_path / "lab")
    (tmp_path / "cut").write_bytes((tmp_path / "img").read_bytes()[:-5])
    with pytest.raises(DataError, match=r"cut declares shape \[4, 3, 3\].*truncated"):
        IdxDataset(tmp_path / "cut", tmp_path / "lab")
    (tmp_path / "magic").write_bytes(b"\x00\x00\x0d\x03" + bytes(12))
    with pytest.raises(DataError, match=r"magic has magic number 0x00000d03"):
        IdxDataset(tmp_path / "magic", tmp_path / "lab")
    with pytest.raises(DataError, match=r"absent does not exist"):
        IdxDataset(tmp_path / "img", tmp_path / "absent")
    write_idx(tmp_path / "lab12", np.array([0, 1, 12, 3], np.uint8))
    with pytest.raises(DataError, match=r"lab12: label 12 of example 2 is outside 0..9"):
        IdxDataset(tmp_path / "img", tmp_path / "lab12", num_classes=10)


def test_cifar10_records_round_trip_across_batch_files(tmp_path):
    rng = np.random.default_rng(4)
    images = rng.integers(0, 256, (7, 32, 32, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, 7)
    write_cifar(tmp_path / "b1.bin", images[:4], labels[:4])
    write_cifar(tmp_path / "b2.bin", images[4:], labels[4:])
    ds = Cifar10Dataset([tmp_path / "b1.bin", tmp_path / "b2.bin"])
    assert len(ds) == 7 and ds.num_classes == 10 and np.array_equal(ds.targets(), labels)
    for i in (0, 3, 4, 6):
        x, y = ds[i]
        assert int(y) == labels[i]
        assert torch.equal(
            (x * 255).round().to(torch.uint8), torch.from_numpy(images[i]).permute(2, 0, 1)
        )
    assert len(Cifar10Dataset(tmp_path / "b2.bin")) == 3


def test_cifar10_malformed_files_name_the_file(tmp_path):
    write_cifar(tmp_path / "ok.bin", np.zeros((2, 32, 32, 3), np.uint8), np.array([1, 2]))
    (tmp_path / "short.bin").write_bytes((tmp_path / "ok.bin").read_bytes()[:-1])
    with pytest.raises(DataError, match=r"short\.bin has 6145 bytes, not a whole number of 3073"):
        Cifar10Dataset([tmp_path / "ok.bin", tmp_path / "short.bin"])
    write_cifar(tmp_path / "eleven.bin", np.zeros((2, 32, 32, 3), np.uint8), np.array([3, 11]))
    with pytest.raises(DataError, match=r"eleven\.bin: label 11 of example 1 is outside 0..9"):
        Cifar10Dataset(tmp_path / "eleven.bin")
    with pytest.raises(DataError, match=r"gone\.bin does not exist"):
        Cifar10Dataset(tmp_path / "gone.bin")


def test_large_raw_files_are_mapped_not_loaded(tmp_path):
    """256 MiB (sparse) files: building the data sets and reading items allocates almost nothing."""
    count, side = 4096, 256
    with open(tmp_path / "img", "wb") as fh:
        fh.write(bytes([0, 0, 8, 3]) + b"".join(d.to_bytes(4, "big") for d in (count, side, side)))
        fh.seek(16 + 1234 * side * side)
        fh.write(np.full(side * side, 77, np.uint8).tobytes())
        fh.truncate(16 + count * side * side)
    write_idx(tmp_path / "lab", np.arange(count) % 10)
    records = 87_000
    with open(tmp_path / "c.bin", "wb") as fh:
        fh.seek(50_000 * 3073)
        fh.write(bytes([7]) + bytes([200]) * 3072)
        fh.truncate(records * 3073)

    tracemalloc.start()
    try:
        idx = IdxDataset(tmp_path / "img", tmp_path / "lab")
        cifar = Cifar10Dataset(tmp_path / "c.bin")
        idx_item, cifar_item = idx[1234], cifar[50_000]
        cifar_targets = cifar.targets()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20, f"{peak} bytes allocated for 256 MiB files"
    assert float(idx_item[0].mean()) == pytest.approx(77 / 255) and int(idx_item[1]) == 4
    assert float(cifar_item[0].mean()) == pytest.approx(200 / 255) and int(cifar_item[1]) == 7
    assert np.bincount(cifar_targets).tolist() == [records - 1] + [0] * 6 + [1]


# --- DICOM --------------------------------------------------------------------------------


def test_dicom_round_trip_with_rescale_windows_and_monochrome1(tmp_path):
    pydicom_or_skip()
    write_dicom(tmp_path / "plain" / "0.dcm", np.array([[0, 2048, 4095, 4095]]))
    write_dicom(
        tmp_path / "ct" / "0.dcm",
        np.array([[864, 1064, 1264, 0]]),  # HU -160, 40, 240, -1024
        bits=16,
        signed=True,
        RescaleSlope=1,
        RescaleIntercept=-1024,
        WindowCenter=40,
        WindowWidth=400,
    )
    write_dicom(
        tmp_path / "inverted" / "0.dcm",
        np.array([[0, 10, 20, 0]]),
        PhotometricInterpretation="MONOCHROME1",
        RescaleSlope=2,
        WindowCenter=[21.5, 0],  # the first of several windows is the one used
        WindowWidth=[41, 1],
    )

    def pixels(ds, i=0):
        return (ds[i][0][0, 0] * 255).round().tolist()

    ds = DicomFolderDataset(tmp_path)
    assert ds.classes == ["ct", "inverted", "plain"] and ds.targets().tolist() == [0, 1, 2]
    assert ds[2][1].dtype == torch.int64
    assert pixels(ds, 2) == [0.0, 128.0, 255.0, 255.0]  # 12-bit range: 2048/4095 of 255
    assert pixels(ds, 0) == [0.0, 128.0, 255.0, 0.0]  # the file's window, 40 +- 200 HU
    # Slope 2: values 0, 20, 40 through the window 21.5/41, (x - 21) / 40 + 0.5, then inverted.
    assert pixels(ds, 1) == [255.0, 255.0 - 121.0, 255.0 - 249.0, 255.0]
    # The signed 16-bit range: (stored + 32768) / 65535 of 255, whatever the file's window.
    classes = ["ct", "inverted", "plain"]  # every folder of images: none may go undeclared
    bits = DicomFolderDataset(tmp_path, classes=classes, window="bits")
    assert pixels(bits) == [131.0, 132.0, 132.0, 128.0]
    declared = DicomFolderDataset(tmp_path, classes=classes, window=(240, 401))
    assert pixels(declared) == [0.0, 0.0, 128.0, 0.0]


def test_dicom_reads_only_requested_files(tmp_path, monkeypatch):
    pydicom = pydicom_or_skip()
    for c in range(2):
        for j in range(3):
            write_dicom(tmp_path / f"c{c}" / f"{j}.dcm", np.full((4, 4), 100 * c + j))
    reads = []
    original = pydicom.dcmread

    def counting_read(path, *args, **kwargs):
        reads.append((path, kwargs.get("stop_before_pixels", False)))
        return original(path, *args, **kwargs)

    monkeypatch.setattr(pydicom, "dcmread", counting_read)
    ds = DicomFolderDataset(tmp_path, ImageTransform(size=(2, 2), channels=3))
    assert ds.targets().tolist() == [0, 0, 0, 1, 1, 1] and reads == []
    x, y = ds[4]
    assert x.shape == (3, 2, 2) and int(y) == 1
    assert reads == [(ds.files[4], False)]


def test_dicom_malformed_files_name_the_file(tmp_path):
    pydicom_or_skip()
    write_dicom(tmp_path / "a" / "0.dcm", np.zeros((4, 4)))
    (tmp_path / "a" / "1.dcm").write_bytes(b"not a dicom file" * 20)
    write_dicom(tmp_path / "a" / "2.dcm", np.zeros((5, 4)))
    write_dicom(
        tmp_path / "a" / "3.dcm", np.zeros((2, 4, 4)).reshape(8, 4), NumberOfFrames=2, Rows=4
    )
    ds = DicomFolderDataset(tmp_path)
    assert ds[0][0].shape == (1, 4, 4)
    with pytest.raises(DataError, match=r"a/1\.dcm: cannot read the DICOM pixel data"):
        ds[1]
    with pytest.raises(DataError, match=r"a/1\.dcm: cannot read the DICOM header"):
        ds.check()
    with pytest.raises(DataError, match=r"a/2\.dcm is 5x4 \(HxW\) but the expected size is 4x4"):
        ds[2]
    with pytest.raises(DataError, match=r"a/3\.dcm holds 2 frames; expected one 2-D image"):
        ds[3]  # refused from its header, no frame decoded
    assert DicomFolderDataset(tmp_path, classes=["a", "b"]).missing_classes == ["b"]


def test_dicom_without_pydicom_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pydicom", None)
    with pytest.raises(ImportError, match=r"pip install gep-fed\[medical\]"):
        DicomFolderDataset(tmp_path)


# --- the real shared files ----------------------------------------------------------------


def test_shared_mnist_idx_matches_the_eager_loader():
    images_path = shared_file("mnist/MNIST/raw/t10k-images-idx3-ubyte.gz")
    labels_path = shared_file("mnist/MNIST/raw/t10k-labels-idx1-ubyte.gz")
    ds = IdxDataset(images_path, labels_path, ImageTransform(mean=MNIST_MEAN, std=MNIST_STD))
    counts = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    assert ds.num_classes == 10 and np.bincount(ds.targets()).tolist() == counts
    index = [0, 4321, 9999]
    eager = to_tensor(read_idx(images_path)[index], MNIST_MEAN, MNIST_STD)
    assert torch.allclose(torch.stack([ds[i][0] for i in index]), eager, atol=1e-6)


def test_shared_cifar10_batch_matches_the_readme():
    path = shared_file("cifar10/cifar-10-batches-bin/data_batch_1.bin")
    ds = Cifar10Dataset(path)
    counts = [1005, 974, 1032, 1016, 999, 937, 1030, 1001, 1025, 981]
    assert len(ds) == 10_000 and np.bincount(ds.targets()).tolist() == counts
    raw = np.fromfile(path, np.uint8, count=3 * 3073).reshape(-1, 3073)
    x, y = ds[2]
    assert int(y) == raw[2, 0]
    assert torch.equal((x * 255).round().to(torch.uint8).flatten(), torch.from_numpy(raw[2, 1:]))


def test_shared_pneumoniamnist_splits():
    path = shared_file("medmnist/pneumoniamnist.npz")
    counts = {"train": [1214, 3494], "val": [135, 389], "test": [234, 390]}
    arrays = np.load(path)
    for split, expected in counts.items():
        ds = MedMNISTDataset(path, split, ImageTransform(size=(64, 64), channels=3))
        assert ds.num_classes == 2 and np.bincount(ds.targets()).tolist() == expected
    native = MedMNISTDataset(path, "val")
    assert torch.equal(
        (native[5][0][0] * 255).round().to(torch.uint8), torch.from_numpy(arrays["val_images"][5])
    )
    assert ds[0][0].shape == (3, 64, 64)


def test_suffix_less_dicom_folders_may_hold_a_readme_beside_them(tmp_path):
    """``extensions=("",)`` reads suffix-less DICOM files: a README or a drive's
    ``.fseventsd/`` beside the class folders is no image (the loose-image check refused them)."""
    pydicom_or_skip()
    for c in range(2):
        write_dicom(tmp_path / f"c{c}" / "scan", np.full((4, 4), 100 * c))
    (tmp_path / "README").write_text("scans of 2026")
    (tmp_path / ".fseventsd").mkdir()
    (tmp_path / ".fseventsd" / "0000").write_bytes(b"log")
    ds = DicomFolderDataset(tmp_path, ImageTransform(size=(2, 2)), extensions=("",))
    assert ds.classes == ["c0", "c1"] and ds.targets().tolist() == [0, 1]

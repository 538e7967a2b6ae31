"""Loaders on the real shared files and on malformed files; partitions; tasks."""

import gzip

import numpy as np
import pytest
import torch
from conftest import shared_file

from gep_fed.data import partition
from gep_fed.data.builtin_tasks import DigitsTask
from gep_fed.data.datasets import (
    load_digits,
    load_kmnist,
    load_medmnist,
    load_mnist,
    load_site_file,
    mnist_split,
    sample_photo_patches,
)
from gep_fed.data.formats import DataError, read_idx
from gep_fed.data.partition import partition_indices
from gep_fed.data.task import TaskSettings


def test_mnist_idx_files_load_with_the_documented_class_counts():
    root = shared_file("mnist/MNIST/raw/t10k-images-idx3-ubyte.gz").parents[2]
    ds = load_mnist(root)
    assert ds.images.shape == (10000, 28, 28) and ds.images.dtype == np.uint8
    assert np.bincount(ds.labels).tolist() == [
        980,
        1135,
        1032,
        1010,
        982,
        892,
        958,
        1028,
        974,
        1009,
    ]
    train, test = mnist_split(ds)
    assert (len(train), len(test)) == (8000, 2000)
    perm = np.random.default_rng(0).permutation(10000)
    assert np.array_equal(test.labels, ds.labels[perm[8000:]])


def test_kmnist_and_pneumoniamnist_load():
    kmnist = load_kmnist(shared_file("kmnist/kmnist-test-imgs.npz").parent)
    assert kmnist.images.shape == (10000, 28, 28) and np.bincount(kmnist.labels).min() == 1000
    splits = load_medmnist(shared_file("medmnist/pneumoniamnist.npz"))
    assert {k: np.bincount(v.labels).tolist() for k, v in splits.items()} == {
        "train": [1214, 3494],
        "val": [135, 389],
        "test": [234, 390],
    }


def test_medmnist_loader_accepts_rgb_files(tmp_path):
    path = tmp_path / "rgb.npz"
    arrays = {f"{s}_images": np.zeros((4, 28, 28, 3), np.uint8) for s in ("train", "val", "test")}
    arrays.update({f"{s}_labels": np.zeros((4, 1), np.uint8) for s in ("train", "val", "test")})
    np.savez(path, **arrays)
    assert load_medmnist(path)["train"].images.shape == (4, 28, 28, 3)


def test_truncated_idx_file_is_named_with_what_was_expected(tmp_path):
    good = shared_file("mnist/MNIST/raw/t10k-labels-idx1-ubyte.gz")
    raw = gzip.decompress(good.read_bytes())
    bad = tmp_path / "t10k-labels-idx1-ubyte"
    bad.write_bytes(raw[:5000])
    with pytest.raises(
        DataError, match=r"t10k-labels-idx1-ubyte declares shape \[10000\].*truncated"
    ):
        read_idx(bad)


@pytest.mark.parametrize(
    "payload, problem",
    [
        (b"\x00\x00\x09\x99" + b"\x00" * 20, "magic number"),
        (b"\x1f\x8b\x00garbage", "cannot read"),
        (b"abc", "too short"),
    ],
)
def test_malformed_idx_files_are_refused(tmp_path, payload, problem):
    path = tmp_path / "file.idx"
    path.write_bytes(payload)
    with pytest.raises(DataError, match=problem):
        read_idx(path)


def test_missing_and_malformed_npz_files_are_named(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_medmnist(tmp_path / "nope.npz")
    broken = tmp_path / "broken.npz"
    broken.write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(DataError, match=r"broken\.npz"):
        load_medmnist(broken)
    partial = tmp_path / "partial.npz"
    np.savez(partial, train_images=np.zeros((2, 28, 28), np.uint8))
    with pytest.raises(DataError, match="no array 'train_labels'"):
        load_medmnist(partial)
    with pytest.raises(DataError, match="no MNIST test files"):
        load_mnist(tmp_path)


def test_site_data_file_is_validated(tmp_path):
    good = tmp_path / "site.npz"
    np.savez(good, images=np.zeros((5, 8, 8), np.uint8), labels=np.arange(5))
    assert len(load_site_file(good)) == 5
    wrong = tmp_path / "wrong.npz"
    np.savez(wrong, x=np.zeros(3))
    with pytest.raises(DataError, match="expected 'images' and 'labels'"):
        load_site_file(wrong)
    floats = tmp_path / "floats.npz"
    np.savez(floats, images=np.zeros((5, 8, 8), np.float32), labels=np.arange(5))
    with pytest.raises(DataError, match="uint8"):
        load_site_file(floats)


def test_bundled_default_data_needs_no_download():
    digits = load_digits()
    assert digits.images.shape == (1797, 8, 8) and digits.num_classes == 10
    patches = sample_photo_patches(50, 8, seed=1)
    assert patches.shape == (50, 8, 8) and patches.std() > 5
    task = DigitsTask(TaskSettings(num_public=100))
    assert len(task.train_dataset()) + len(task.eval_dataset()) == 1797
    assert len(task.public_dataset()) == 100 and task.public_dataset()[0][0].shape == (1, 8, 8)


def test_the_bundled_data_read_once_is_each_callers_own_copy():
    """Digits and photograph patches are read once per process; a caller that writes into
    what it got changes neither the next caller's copy nor the patches it is drawn from."""
    first, patches = load_digits(), sample_photo_patches(20, 8, seed=3)
    pristine_images, pristine_patches = first.images.copy(), patches.copy()
    first.images[:] = 0
    first.labels[:] = 0
    patches[:] = 0
    again = load_digits()
    np.testing.assert_array_equal(again.images, pristine_images)
    assert again.labels.max() == 9
    np.testing.assert_array_equal(sample_photo_patches(20, 8, seed=3), pristine_patches)
    assert not np.array_equal(sample_photo_patches(20, 8, seed=4), pristine_patches)


def label_skew(labels, parts):
    """Mean total-variation distance between each site's label mix and the pooled one."""
    pooled = np.bincount(labels, minlength=10) / len(labels)
    return np.mean(
        [0.5 * np.abs(np.bincount(labels[p], minlength=10) / len(p) - pooled).sum() for p in parts]
    )


def test_partitions_are_disjoint_complete_seeded_and_dirichlet_is_skewed():
    labels = load_digits().labels
    iid = partition_indices(labels, 3, "iid", seed=0)
    skewed = partition_indices(labels, 3, "dirichlet", alpha=0.3, seed=0)
    for parts in (iid, skewed):
        together = np.concatenate(parts)
        assert len(together) == len(labels) == len(np.unique(together))
    assert label_skew(labels, skewed) > 3 * label_skew(labels, iid)
    partition._partition.cache_clear()  # seeded: the same split computed again
    again = partition_indices(labels, 3, "dirichlet", alpha=0.3, seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(skewed, again, strict=True))
    more_skew = partition_indices(labels, 3, "dirichlet", alpha=0.05, seed=0)
    assert label_skew(labels, more_skew) > label_skew(labels, skewed)
    with pytest.raises(ValueError, match="partition must be one of"):
        partition_indices(labels, 3, "shards")
    with pytest.raises(ValueError, match=r"Dirichlet split with alpha 0\.001 gave no 20 shares"):
        partition_indices(labels[:300], 20, "dirichlet", alpha=0.001, seed=0)


def test_a_process_splits_the_same_labels_once_and_each_caller_gets_its_own_arrays():
    labels = load_digits().labels
    partition._partition.cache_clear()
    first = partition_indices(labels, 3, "dirichlet", alpha=0.3, seed=0)
    first[0][:] = -1  # a caller's change stays its own
    second = partition_indices(list(labels), 3, "dirichlet", alpha=0.3, seed=0)
    assert partition._partition.cache_info().hits == 1
    assert (second[0] >= 0).all()
    assert len(np.unique(np.concatenate(second))) == len(labels)
    other_seed = partition_indices(labels, 3, "dirichlet", alpha=0.3, seed=1)
    assert partition._partition.cache_info().misses == 2
    assert not all(np.array_equal(a, b) for a, b in zip(second, other_seed, strict=True))
    multilabel = np.stack([labels % 2, labels > 4], axis=1)  # one row of labels per example
    rows = np.concatenate(partition_indices(multilabel, 3, "iid", seed=0))
    assert sorted(rows.tolist()) == list(range(len(labels)))


def test_an_example_with_non_finite_inputs_is_named_by_the_check_and_never_trained():
    """A NaN feature gave a NaN gradient, clip factor 0, counted nowhere: the run and the site
    check said nothing of it. The check now names it; training leaves it out as before."""
    from gep_fed.data.models import MLP
    from gep_fed.data.task import CheckedExamples

    x = torch.zeros(4, 3)
    x[2, 1], x[3, 0] = float("nan"), float("inf")
    data = torch.utils.data.TensorDataset(x, torch.tensor([0, 1, 0, 1]))
    checked = CheckedExamples.of(data, "multiclass", MLP(3, 2, hidden=()))
    assert [checked.problem(i) for i in range(4)] == [
        None,
        None,
        "1 input value(s) not finite (NaN or inf)",
        "1 input value(s) not finite (NaN or inf)",
    ]
    assert [bool(checked[i][2]) for i in range(4)] == [True, True, False, False]


def test_an_example_whose_label_is_not_a_class_is_never_trained_as_the_nearest_one():
    """A float label 2.5 was cast to the placeholder's integer before it was checked: the
    check named it, and training used it as class 2 (a relabelled example)."""
    from gep_fed.data.models import MLP
    from gep_fed.data.task import CheckedExamples

    class Labels(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return torch.zeros(3), [1, 2, 2.5, 2.0][i]

    checked = CheckedExamples.of(Labels(), "multiclass", MLP(3, 3, hidden=()))
    assert [checked.problem(i) is None for i in range(4)] == [True, True, False, True]
    assert [bool(checked[i][2]) for i in range(4)] == [True, True, False, True]
    assert int(checked[3][1]) == 2
    # soft multi-label targets of another float dtype only round: each is kept
    soft = torch.utils.data.TensorDataset(torch.zeros(2, 3), torch.tensor([[0.0, 1.0], [0.1, 0.9]]))
    mixed = [(x, y.double() if i else y) for i, (x, y) in enumerate(soft)]
    kept = CheckedExamples.of(mixed, "multilabel", MLP(3, 2, hidden=()))
    assert [kept.problem(i) for i in range(2)] == [None, None] and bool(kept[1][2])
    # a class index of a float reference rounds to another class in bfloat16: left out
    wide = [(torch.zeros(3), torch.tensor(3.0, dtype=torch.bfloat16)), (torch.zeros(3), 257)]
    classes = CheckedExamples.of(wide, "multiclass", MLP(3, 300, hidden=()))
    assert classes.problem(1) is not None and not bool(classes[1][2])


def test_an_empty_data_set_is_named_as_empty():
    from gep_fed.data.models import MLP
    from gep_fed.data.task import CheckedExamples

    empty = torch.utils.data.TensorDataset(torch.zeros(0, 3), torch.zeros(0).long())
    with pytest.raises(DataError, match="holds no examples"):
        CheckedExamples.of(empty, "multiclass", MLP(3, 2, hidden=()))

"""data/imagefiles.py: an image folder's classes and files, and the split of a folder of
classes alone (`val_fraction`): a seeded share of each class held out."""
from __future__ import annotations

import pytest

from data import images
from data.imagefiles import hold_out
from data.images import ImageFolder
from scripts.make_images import write_images


@pytest.fixture(scope="module")
def flat(tmp_path_factory):
    """<root>/<class>/<image>: 3 classes of 10, 10 and 10 files (no train/ or val/)."""
    root = tmp_path_factory.mktemp("images")
    write_images(root, count=30, size=16, classes=3, val_fraction=0)
    return root / "train"


def test_a_share_of_each_class_is_held_out_by_the_split_seed_alone():
    samples = [(f"{c}/{i}.png", c) for c in range(3) for i in range(10)]
    split = hold_out(samples, ["a", "b", "c"], 0.2, split_seed=0)
    assert sorted(split["train"] + split["val"]) == sorted(samples)  # each file once
    assert [sum(1 for _, c in split["val"] if c == k) for k in range(3)] == [2, 2, 2]
    assert hold_out(samples, ["a", "b", "c"], 0.2, split_seed=0) == split  # every run, rank
    assert hold_out(samples, ["a", "b", "c"], 0.2, split_seed=1)["val"] != split["val"]


@pytest.mark.parametrize("fraction,said", [
    (0.01, "class 'a' has 10 images, of which it holds out 0; each class needs one in "
           "training and one in validation"),
    (0.99, "class 'a' has 10 images, of which it holds out 10"),
])
def test_a_class_left_without_a_side_is_named(fraction, said):
    samples = [(f"{c}/{i}.png", c) for c in range(2) for i in range(10)]
    with pytest.raises(ValueError, match=rf"^data\.dataset\.val_fraction={fraction}: {said}"):
        hold_out(samples, ["a", "b"], fraction, split_seed=0)


def test_a_folder_of_classes_alone_trains_and_validates_on_disjoint_files(flat):
    train = ImageFolder("train", str(flat), size=16, val_fraction=0.2)
    val = ImageFolder("val", str(flat), size=16, val_fraction=0.2)
    assert train.classes == val.classes == ["class_00", "class_01", "class_02"]
    assert (len(train), len(val)) == (24, 6)
    assert not {p for p, _ in train.samples} & {p for p, _ in val.samples}
    assert images.image_classes(str(flat)) == 3  # (data.num_classes, from the folder itself)
    assert train.fingerprint() != val.fingerprint()  # (a cache per split)


def test_a_file_left_out_is_said_once_not_once_per_split(flat, caplog):
    import logging

    (flat / "class_00" / "notes.txt").write_text("the user's")
    try:
        with caplog.at_level(logging.WARNING, logger="stoker"):
            for split in ("train", "val"):
                ImageFolder(split, str(flat), size=16, val_fraction=0.2)
    finally:
        (flat / "class_00" / "notes.txt").unlink()
    assert len([r for r in caplog.records if "left out" in r.getMessage()]) == 1


def test_the_layout_and_the_key_that_do_not_fit_are_one_line(flat):
    with pytest.raises(FileNotFoundError, match=r"^data\.dataset\.root: no folder .*/train/train "
                                                r".*; a folder of <root>/<class>/<image> alone: "
                                                r"set data\.dataset\.val_fraction \(e\.g\. 0\.2\)"):
        ImageFolder("train", str(flat))
    with pytest.raises(ValueError, match=rf"^data\.dataset\.val_fraction=0\.2: .* holds train/ and "
                                         rf"no val/: to split the classes in train/, name them: "
                                         rf"data\.dataset\.root={flat}$"):
        ImageFolder("train", str(flat.parent), val_fraction=0.2)  # (make_images' train/ alone)
    (flat.parent / "val").mkdir()
    try:
        with pytest.raises(ValueError, match=r"^data\.dataset\.val_fraction=0\.2: .* holds "
                                             r"train/, a split of its own; leave "
                                             r"data\.dataset\.val_fraction null"):
            ImageFolder("train", str(flat.parent), val_fraction=0.2)
    finally:
        (flat.parent / "val").rmdir()
    with pytest.raises(ValueError, match=r"^data\.dataset\.val_fraction=1\.5: must be between 0 "
                                         r"and 1"):
        ImageFolder("train", str(flat), val_fraction=1.5)

"""data/images.py: the class map, decoded sizes, draft decoding, unreadable files under each
policy, directly and through loader workers."""
from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from data import images
from data.images import ImageError, ImageFolder, SkipCollate, decode, image_classes
from data.prefetch import DevicePrefetcher
from scripts.make_images import write_images


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    write_images(root, count=24, size=48, classes=3, val_fraction=0.25)
    return root


def broken_copy(folder, tmp_path):
    """The folder with one garbage file and one truncated JPEG added to the train split."""
    import shutil

    root = tmp_path / "broken"
    shutil.copytree(folder, root)
    (root / "train" / "class_00" / "zz_garbage.jpg").write_bytes(b"not an image")
    good = (root / "train" / "class_01" / "00000.jpg").read_bytes()
    (root / "train" / "class_01" / "zz_truncated.jpg").write_bytes(good[:300])
    return root


def test_classes_are_sorted_folders_and_samples_are_uint8_chw(folder):
    train, val = ImageFolder("train", str(folder), size=32), ImageFolder("val", str(folder), 32)
    assert train.classes == val.classes == ["class_00", "class_01", "class_02"]
    assert len(train) == 18 and len(val) == 6
    labels = [label for _, label in train.samples]
    assert labels == sorted(labels) and set(labels) == {0, 1, 2}
    x, y = train[0]
    assert x.dtype == torch.uint8 and x.shape == (3, 32, 32) and y.dtype == torch.int64
    assert torch.equal(x, decode(train.samples[0][0], 32, train.resize))
    assert train.resize == round(32 / 0.875)
    assert images.image_classes(str(folder)) == 3


def test_a_non_square_image_is_resized_by_its_shorter_side_and_centre_cropped(tmp_path):
    from PIL import Image

    pixels = np.zeros((40, 80, 3), dtype=np.uint8)
    pixels[:, 20:60] = 255  # a white centre band as wide as the crop of the resized image
    Image.fromarray(pixels).save(tmp_path / "wide.png")
    out = decode(tmp_path / "wide.png", size=20, resize=20)
    assert out.shape == (3, 20, 20)
    assert out.float().mean() > 240  # only the white middle is left


@pytest.mark.parametrize("mode", ["RGB", "L", "RGBA"])
def test_samples_are_pillows_resize_and_centre_crop_within_one_level(tmp_path, mode):
    from PIL import Image

    channels = {"RGB": 3, "L": 1, "RGBA": 4}[mode]
    pixels = (np.arange(50 * 70 * channels) * 7 % 251).astype(np.uint8)
    Image.fromarray(pixels.reshape(50, 70, channels).squeeze(), mode).save(tmp_path / "a.png")
    for size, resize in [(32, 40), (50, 50), (24, 60), (1, 1)]:
        out = decode(tmp_path / "a.png", size, resize)
        with Image.open(tmp_path / "a.png") as img:  # Pillow's own steps, one at a time
            img = img.convert("RGB")
            scale = resize / 50
            w, h = max(size, round(70 * scale)), max(size, round(50 * scale))
            if (w, h) != img.size:
                img = img.resize((w, h), Image.BILINEAR, reducing_gap=None)
            left, top = (w - size) // 2, (h - size) // 2
            want = np.array(img.crop((left, top, left + size, top + size)))
        assert out.dtype == torch.uint8 and out.shape == (3, size, size)
        # the crop alone is resampled, at the whole resize's scale: the same filter over the
        # same source pixels, its sums rounded a level the other way at most
        got = out.permute(1, 2, 0).numpy().astype(int)
        assert np.abs(got - want).max() <= 1 and (got == want).mean() > 0.5
        assert out.is_contiguous() and out.numpy().flags.writeable  # owned, not Pillow's bytes


def test_a_thin_strip_resamples_only_its_crop_not_the_whole_resized_strip(tmp_path,
                                                                          monkeypatch):
    from PIL import Image

    # resized whole, a 1 x 8000 strip's shorter side to 256 made 256 x 2,048,000 (1.5 GB)
    Image.fromarray(np.full((8000, 1, 3), 90, np.uint8)).save(tmp_path / "strip.png")
    sizes, resize = [], Image.Image.resize

    def recorded(self, size, *args, **kwargs):
        sizes.append(tuple(size))
        return resize(self, size, *args, **kwargs)

    monkeypatch.setattr(Image.Image, "resize", recorded)
    out = decode(tmp_path / "strip.png", size=224, resize=256)
    assert out.shape == (3, 224, 224) and torch.all(out == 90)
    assert sizes == [(224, 224)]


@pytest.mark.parametrize("name", ["g16.png", "g32.tif"])
def test_16_bit_grayscale_keeps_its_top_8_bits_not_a_clipped_white(tmp_path, name):
    """Pillow opens a 16-bit PNG as I;16 (a TIFF of int32 as I); its own conversion to RGB
    clips every value above 255 to white."""
    from PIL import Image

    wide = (np.arange(48 * 48).reshape(48, 48) * 28).astype(np.uint16)  # 0 .. 64484
    Image.fromarray(wide if name.endswith("png") else wide.astype(np.int32)).save(
        tmp_path / name)
    out = decode(tmp_path / name, 48, 48)
    want = torch.from_numpy((wide >> 8).astype(np.uint8))
    assert all(torch.equal(out[c], want) for c in range(3))


def test_an_image_over_pillows_bomb_bound_is_one_warning_naming_it_once(tmp_path, caplog,
                                                                        monkeypatch):
    from PIL import Image

    Image.new("RGB", (20, 20)).save(tmp_path / "wide.png")  # 400 pixels, under twice 300
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 300)
    monkeypatch.setattr(images, "_LARGE_SAID", [])
    monkeypatch.setattr(images, "_LARGE_QUIET", [])  # (its filter set in the block below)
    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always")
        for _ in range(2):
            assert decode(str(tmp_path / "wide.png"), 8, 8).shape == (3, 8, 8)
        Image.new("RGB", (20, 20)).save(tmp_path / "other.png")
        decode(str(tmp_path / "other.png"), 8, 8)  # (another file: said once in all)
    assert not [w for w in raised if issubclass(w.category, Image.DecompressionBombWarning)]
    said = [r.getMessage() for r in caplog.records if "decompression-bomb" in r.getMessage()]
    assert said == [f"data: the image {tmp_path / 'wide.png'} is 20x20 (400 pixels), over "
                    "Pillow's decompression-bomb bound (PIL.Image.MAX_IMAGE_PIXELS=300): "
                    "decoded each time in full size (0 MB); such files are best resized "
                    "once, ahead of the runs"]
    # a JPEG is decoded in draft mode: at a fraction of its size (said in full size before)
    Image.new("RGB", (80, 80)).save(tmp_path / "big.jpg")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 4000)
    monkeypatch.setattr(images, "_LARGE_SAID", [])
    caplog.clear()
    with warnings.catch_warnings():  # (the process's filter went with the block above)
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        decode(str(tmp_path / "big.jpg"), 8, 8)
    said = [r.getMessage() for r in caplog.records if "decompression-bomb" in r.getMessage()]
    assert said and said[0].endswith("decoded each time at 1/8 of its size in JPEG draft mode, "
                                     "10x10 (0 MB); such files are best resized once, ahead "
                                     "of the runs"), said


def test_every_format_pillow_reads_is_found_and_other_files_are_named_once(tmp_path, caplog):
    from PIL import Image

    pixels = (np.arange(20 * 30 * 3) % 251).astype(np.uint8).reshape(20, 30, 3)
    cls = tmp_path / "train" / "a"
    (cls / "deeper").mkdir(parents=True)
    names = ["0.bmp", "1.gif", "2.tif", "3.tiff", "4.webp", "5.PNG", "deeper/6.jpeg"]
    for name in names:
        Image.fromarray(pixels).save(cls / name)
    (cls / "notes.txt").write_text("not an image")
    (cls / ".hidden.png").write_bytes(b"")  # hidden files: neither read nor named
    (tmp_path / "train" / "b").mkdir()
    Image.fromarray(pixels).save(tmp_path / "train" / "b" / "7.png")
    with caplog.at_level("WARNING", logger="stoker"):
        folder = ImageFolder("train", str(tmp_path), size=16)
    assert [p.split("/train/")[1] for p, _ in folder.samples] == [
        *(f"a/{n}" for n in names), "b/7.png"]
    assert all(folder[i][0].shape == (3, 16, 16) for i in range(len(folder)))
    assert [r.getMessage() for r in caplog.records] == [
        f"data: 1 file under {tmp_path / 'train'}/<class>/ not jpg/jpeg/png/bmp/gif/tif/tiff/"
        "webp, left out (e.g. a/notes.txt)"]


def test_jpeg_draft_decoding_matches_a_full_decode_closely(tmp_path):
    from PIL import Image

    write_images(tmp_path, count=1, size=512, classes=1, val_fraction=0.0)
    path = next(tmp_path.rglob("*.jpg"))
    fast = decode(path, 64, 64)  # 512 -> draft at 1/4 (128), then resized to 64
    with Image.open(path) as img:
        full = np.array(img.convert("RGB").resize((64, 64), Image.BILINEAR, reducing_gap=None))
    full = torch.from_numpy(full).permute(2, 0, 1)
    assert fast.shape == full.shape
    assert (fast.float() - full.float()).abs().mean() < 6  # the same picture, not bit-equal


def test_unknown_val_classes_and_empty_or_missing_roots_are_one_line(folder, tmp_path):
    missing = tmp_path / "missing"
    for kwargs in ({}, {"val_fraction": 0.2}):  # the root named, whichever layout was meant
        with pytest.raises(FileNotFoundError, match=f"^data.dataset.root: no folder {missing} "
                                                    r"\(expected <root>/train/<class>/<image> "
                                                    "and .* or <root>/<class>/<image> with "):
            ImageFolder("train", str(missing), **kwargs)
    with pytest.raises(FileNotFoundError, match=f"no folder {missing} "):
        image_classes(str(missing))
    (tmp_path / "empty" / "train").mkdir(parents=True)
    with pytest.raises(ValueError, match="no class subfolders"):
        ImageFolder("train", str(tmp_path / "empty"))
    (tmp_path / "empty" / "train" / "cat").mkdir()
    with pytest.raises(ValueError, match="has 1 class subfolder; a classifier needs two"):
        ImageFolder("train", str(tmp_path / "empty"))
    (tmp_path / "empty" / "train" / "dog").mkdir()
    with pytest.raises(ValueError, match="no .jpg/.jpeg/.png/.bmp/.gif/.tif/.tiff/.webp files"):
        ImageFolder("train", str(tmp_path / "empty"))
    import shutil

    gaps = tmp_path / "gaps"
    shutil.copytree(folder, gaps)
    for f in (gaps / "train" / "class_02").iterdir():
        f.unlink()
    with pytest.raises(ValueError, match=r"class folders without images .*\['class_02'\]"):
        ImageFolder("train", str(gaps))
    assert len(ImageFolder("val", str(gaps))) == 6  # a class without val images is fine
    shutil.rmtree(gaps / "val")
    with pytest.raises(FileNotFoundError, match="no folder .*gaps/val .*beside"):
        ImageFolder("val", str(gaps))
    odd = tmp_path / "odd"
    shutil.copytree(folder, odd)
    (odd / "val" / "class_99").mkdir()
    (odd / "val" / "class_99" / "a.jpg").write_bytes((odd / "val" / "class_00").glob(
        "*.jpg").__next__().read_bytes())
    with pytest.raises(ValueError, match="class folders the train set lacks: \\['class_99'\\]"):
        ImageFolder("val", str(odd))
    with pytest.raises(ValueError, match="on_error"):
        ImageFolder("train", str(folder), on_error="ignore")
    # a class folder that is a link to another class: its images were both classes'
    twins = tmp_path / "twins"
    shutil.copytree(folder, twins)
    for split in ("train", "val"):
        (twins / split / "class_03").symlink_to("class_00")
    with pytest.raises(ValueError, match=r"twins/train/class_03 is the same folder as .*twins/"
                                         r"train/class_00 \(a link\): its images would be two "
                                         r"classes' at once"):
        ImageFolder("train", str(twins))


def test_skip_leaves_unreadable_files_out_of_their_batch_and_counts_them(folder, tmp_path,
                                                                         caplog):
    root = broken_copy(folder, tmp_path)
    ds = ImageFolder("train", str(root), size=16, on_error="skip")
    assert len(ds) == 20
    loader = DataLoader(ds, batch_size=8, num_workers=2, collate_fn=ds.collate_fn)
    with caplog.at_level("WARNING", logger="stoker"):
        seen = sum(len(y) for _, y in loader)
        seen_again = sum(len(y) for _, y in loader)
    assert seen == seen_again == 18
    assert sorted(ds.skipped()) == sorted(str(p) for p in root.rglob("zz_*.jpg"))


def test_skip_warns_once_per_file_in_the_process(folder, tmp_path, caplog):
    root = broken_copy(folder, tmp_path)
    ds = ImageFolder("train", str(root), size=16)
    bad = [i for i, (p, _) in enumerate(ds.samples) if "zz_garbage" in p][0]
    with caplog.at_level("WARNING", logger="stoker"):
        assert ds[bad] is None and ds[bad] is None
    lines = [r.getMessage() for r in caplog.records if "zz_garbage" in r.getMessage()]
    assert len(lines) == 1 and "on_error=skip" in lines[0]
    assert lines[0].startswith("data: skipped an unreadable image ")


def test_a_skipped_file_on_another_rank_is_said_with_its_rank(folder, tmp_path, caplog,
                                                              monkeypatch):
    """Under torchrun rank 1's line (the file fell to its shard in another epoch) read as a
    second rank 0 line."""
    root = broken_copy(folder, tmp_path)
    monkeypatch.setenv("RANK", "1")
    ds = ImageFolder("train", str(root), size=16)
    bad = [i for i, (p, _) in enumerate(ds.samples) if "zz_garbage" in p][0]
    with caplog.at_level("WARNING", logger="stoker"):
        assert ds[bad] is None
    [line] = [r.getMessage() for r in caplog.records if "zz_garbage" in r.getMessage()]
    assert line.startswith("[rank 1] data: skipped an unreadable image ")


def test_a_batch_of_skipped_files_only_is_empty_with_the_right_shapes():
    x, y = SkipCollate((3, 8, 8))([None, None])
    assert x.shape == (0, 3, 8, 8) and x.dtype == torch.uint8 and y.shape == (0,)
    x, y = SkipCollate((3, 8, 8))([None, (torch.zeros(3, 8, 8, dtype=torch.uint8),
                                          torch.tensor(1))])
    assert x.shape == (1, 3, 8, 8) and y.tolist() == [1]


@pytest.mark.parametrize("workers", [0, 2])
def test_fail_names_the_file_in_one_line_even_from_a_worker(folder, tmp_path, workers):
    root = broken_copy(folder, tmp_path)
    ds = ImageFolder("train", str(root), size=16, on_error="fail")
    loader = DataLoader(ds, batch_size=32, num_workers=workers, collate_fn=ds.collate_fn)
    with pytest.raises(ImageError) as info:
        for _ in DevicePrefetcher(loader, torch.device("cpu")):
            pass
    message = str(info.value)
    assert "\n" not in message and "zz_" in message and "on_error=skip" in message


def test_a_file_name_with_a_line_break_stays_one_line_naming_it(folder, tmp_path):
    """`bad<newline>name.jpg`: the line was cut at the break, and named `name.jpg`."""
    import shutil

    root = tmp_path / "nl"
    shutil.copytree(folder, root)
    (root / "train" / "class_01" / "bad\nname.jpg").write_bytes(b"not an image")
    ds = ImageFolder("train", str(root), size=16, on_error="fail")
    at = next(i for i, (path, _) in enumerate(ds.samples) if "bad" in path)
    with pytest.raises(ImageError) as info:
        ds[at]
    message = str(info.value)
    assert "\n" not in message and message.startswith("data: cannot read the image ") \
        and "class_01/bad\\nname.jpg (" in message, message


def test_fingerprint_changes_with_the_files_and_the_settings(folder, tmp_path):
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(folder, root)
    before = ImageFolder("train", str(root), size=16).fingerprint()
    assert ImageFolder("train", str(root), size=16).fingerprint() == before
    assert ImageFolder("train", str(root), size=20).fingerprint() != before
    (root / "train" / "class_00" / "00000.jpg").write_bytes(
        (root / "train" / "class_01" / "00000.jpg").read_bytes())
    assert ImageFolder("train", str(root), size=16).fingerprint() != before


def test_a_broken_link_is_skipped_under_a_disk_cache_as_without_one(folder, tmp_path):
    """The disk cache's key stats every file: a broken link failed it first (`...: No such
    file or directory`, no key named), though on_error=skip skips that file without a cache."""
    import shutil

    from data import cache

    root = tmp_path / "copy"
    shutil.copytree(folder, root)
    (root / "train" / "class_00" / "zz_broken.jpg").symlink_to(root / "nowhere.jpg")
    ds = ImageFolder("train", str(root), size=16, on_error="skip")
    assert "zz_broken.jpg', None, None)" in ds.fingerprint()
    cached = cache.cache_dataset(ds, "disk", tag="cfg", cache_dir=str(tmp_path / "c"))
    assert len(cached) == len(ds) - 1 and [p.rsplit("/", 1)[1] for p in ds.skipped()] \
        == ["zz_broken.jpg"]


def test_the_config_reads_classes_and_shape_from_the_folder(folder, tmp_path):
    from tests.helpers import compose_cfg

    cfg = compose_cfg(tmp_path / "run", "data=image_folder", f"data.dataset.root={folder}",
                      "data.dataset.size=40")
    assert cfg.data.num_classes == 3 and list(cfg.data.input_shape) == [3, 40, 40]
    assert json.loads(json.dumps(list(cfg.data.normalize_mean))) == [0.485, 0.456, 0.406]


def one_by_one(ds, indices):
    """The batch of `indices` as PyTorch's per-sample fetch and default collate make it."""
    from torch.utils.data import default_collate

    return default_collate([s for s in (ds[i] for i in indices) if s is not None])


@pytest.mark.parametrize("workers", [0, 2])
def test_a_batched_fetch_is_the_per_sample_batch_bit_for_bit(folder, tmp_path, workers):
    root = broken_copy(folder, tmp_path)  # skipped files inside batches, kept ones in order
    ds = ImageFolder("train", str(root), size=16)
    order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(0)).tolist()
    loader = DataLoader(ds, batch_size=6, sampler=order, num_workers=workers,
                        collate_fn=ds.collate_fn)
    batches = list(loader)
    assert len(batches) == 4 and sum(len(y) for _, y in batches) == 18
    for k, (x, y) in enumerate(batches):
        want_x, want_y = one_by_one(ds, order[6 * k:6 * k + 6])
        assert x.dtype == torch.uint8 and y.dtype == torch.int64 and x.is_contiguous()
        assert torch.equal(x, want_x) and torch.equal(y, want_y)


def test_a_batched_fetch_of_skipped_files_only_is_empty_and_a_users_collate_gets_samples(
        folder, tmp_path):
    root = broken_copy(folder, tmp_path)
    ds = ImageFolder("train", str(root), size=16)
    bad = [i for i, (p, _) in enumerate(ds.samples) if "zz_" in p]
    x, y = ds.collate_fn(ds.__getitems__(bad))
    assert x.shape == (0, 3, 16, 16) and x.dtype == torch.uint8 and y.shape == (0,)
    seen = []
    collate = SkipCollate((3, 16, 16), lambda samples: seen.append(samples) or len(samples))
    assert collate(ds.__getitems__([0, bad[0], 1])) == 2
    assert [type(s) for s in seen[0]] == [tuple, tuple]
    assert torch.equal(seen[0][1][0], ds[1][0]) and int(seen[0][1][1]) == ds.samples[1][1]


def test_a_subclass_with_its_own_getitem_is_fetched_through_it(folder):
    class Flipped(ImageFolder):
        def __getitem__(self, i):
            x, y = super().__getitem__(i)
            return x.flip(-1), y

    ds = Flipped("train", str(folder), size=16)
    x, _ = next(iter(DataLoader(ds, batch_size=3, collate_fn=ds.collate_fn)))
    assert torch.equal(x[0], ImageFolder("train", str(folder), size=16)[0][0].flip(-1))


def test_linked_folders_that_lead_back_into_the_data_are_left_out_once(folder, tmp_path,
                                                                      caplog):
    """A link to the split (a loop) or to another class's folder listed 2624 files for 64,
    many under the wrong class; a link to images elsewhere is followed."""
    import os
    import shutil

    root = tmp_path / "linked"
    shutil.copytree(folder, root)
    train = root / "train"
    (train / "class_02" / "sub").mkdir()
    shutil.copy(next((train / "class_02").glob("*.jpg")), train / "class_02" / "sub" / "s.jpg")
    before = ImageFolder("train", str(root)).samples
    os.symlink("..", train / "class_00" / "loop")
    os.symlink("../class_01", train / "class_00" / "other")
    os.symlink(".", train / "class_02" / "self")
    os.symlink("sub", train / "class_02" / "zlink")  # a sibling, not yet entered
    os.symlink("../../val/class_00", train / "class_00" / "val_leak")  # validation images
    os.symlink("/nonexistent/share/class_01", train / "class_01" / "nas")  # not mounted
    extra = tmp_path / "elsewhere"
    extra.mkdir()
    shutil.copy(next((train / "class_01").glob("*.jpg")), extra / "far.jpg")
    os.symlink(extra, train / "class_01" / "far")
    with caplog.at_level("WARNING", logger="stoker"):
        after = ImageFolder("train", str(root)).samples
    assert sorted(after) == sorted(before + [(str(train / "class_01" / "far" / "far.jpg"), 1)])
    line = [r.getMessage() for r in caplog.records if "linked folder" in r.getMessage()]
    assert len(line) == 1 and line[0].startswith("data: 5 linked folders under ")
    assert "or the other split" in line[0]
    nowhere = [r.getMessage() for r in caplog.records if "nowhere" in r.getMessage()]
    assert nowhere == [f"data: 1 link under {train}/<class>/ leads nowhere (an unmounted share? "
                       "a moved folder?), left out (e.g. class_01/nas)"]
    assert not [r for r in caplog.records if "not jpg" in r.getMessage()]


def test_a_folder_that_cannot_be_listed_is_one_line_naming_it(folder, monkeypatch):
    """(As root, chmod 000 does not stop a listing: the refusal is made by hand.)"""
    import os

    real = os.scandir
    denied = str(folder / "train" / "class_01")

    def scandir(path="."):
        if str(path) == denied:
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    with pytest.raises(ValueError, match=rf"^data.dataset.root: cannot list {denied} "
                                         r"\(Permission denied\); make it readable"):
        ImageFolder("train", str(folder))


def test_a_pipe_and_a_float_image_are_unreadable_files_not_a_hang_or_zeros(folder, tmp_path):
    import os
    import shutil
    import signal

    from PIL import Image

    root = tmp_path / "odd"
    shutil.copytree(folder, root)
    os.mkfifo(root / "train" / "class_00" / "zz_pipe.jpg")
    Image.fromarray(np.random.rand(40, 40).astype("float32")).save(
        root / "train" / "class_01" / "zz_float.tif")
    ds = ImageFolder("train", str(root), size=16, on_error="skip")
    def hung(*_):
        raise TimeoutError("the pipe was read forever")

    before = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        kept = [ds[i] for i in range(len(ds))]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)
    assert sum(k is None for k in kept) == 2
    assert sorted(ds.skipped()) == sorted(str(p) for p in root.rglob("zz_*"))
    with pytest.raises(ValueError, match="32-bit float image"):
        decode(str(root / "train" / "class_01" / "zz_float.tif"), 16, 18)


def test_loose_files_and_classes_without_validation_images_are_said(folder, tmp_path, caplog):
    import shutil

    root = tmp_path / "gaps"
    shutil.copytree(folder, root)
    shutil.copy(next((root / "train" / "class_00").glob("*.jpg")), root / "train" / "loose.jpg")
    for f in (root / "val" / "class_02").glob("*.jpg"):
        f.unlink()
    with caplog.at_level("WARNING", logger="stoker"):
        train = ImageFolder("train", str(root))
        val = ImageFolder("val", str(root))
    assert all(not p.endswith("loose.jpg") for p, _ in train.samples)
    assert {label for _, label in val.samples} == {0, 1}
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("data: 1 file directly under ") and "in no class folder, left out "
               "(e.g. loose.jpg)" in m for m in said), said
    assert any(m.startswith("data: 1 of the 3 classes has no images under ") and
               m.endswith("(e.g. class_02): the metrics there leave it out") for m in said)

"""Image files: a folder per class, decoded with Pillow in the loader's workers.

    root/train/<class>/<file>.jpg|jpeg|png|bmp|gif|tif|tiff|webp   (subfolders of a class too)
    root/val/<class>/<file>...
    or root/<class>/<file>... with val_fraction: a share of each class held out

Which files those are (classes, listing, links, the split) is data/imagefiles.py's.

`ImageFolder` decodes, resizes the shorter side to `resize` and centre-crops `size` x `size`,
and returns uint8 CHW tensors: a quarter of float32's bytes through the worker queues and the
host-to-device copy; the device prefetcher scales them to [0, 1], normalises
(`data.normalize_mean/std`) and augments (`data.augment`) on the training device. The CPU work
per sample is therefore a pure function of the file, which is what lets its result be cached
(`data.cache`) or packed once (`scripts/prepare_data.py`, `data=memmap`).

A loader asks for a batch's samples at once (`__getitems__`): each file is decoded straight into
its row of one batch tensor, which in a worker is shared memory already (and, under the
training loader, one of a few blocks the worker reuses: data/batchpool.py), so no sample is
allocated, stacked or copied into shared memory on its own.

JPEG files are decoded in draft mode when the target is at most half their size: libjpeg then
scales by 1/2, 1/4 or 1/8 inside the decoder (DCT scaling), several times faster than decoding
the full image and resizing it.

Classes are the sorted subfolder names of the train root, the same list for both splits; a
val folder with a class the train root lacks is an error. An unreadable or corrupt file is
handled by `on_error`: `skip` (a warning line naming the file, once per run; the sample is
left out of its batch, and the run's total is reported at its end) or `fail` (one
line naming the file, the run stops).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import multiprocessing
import os
import re
import stat
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, List, Optional, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

from data.batchpool import batch_buffer, hand_out
from data.imagefiles import SPLIT_DIRS, check_root, find_classes, image_lists
from trainer.config import ConfigError, rank_prefix

ON_ERROR = ("skip", "fail")
log = logging.getLogger("stoker")


@functools.lru_cache(maxsize=None)
def unreadable_errors() -> tuple:
    """The exceptions Pillow raises for a file it cannot read."""
    from PIL import Image

    # Pillow's errors for broken files; a decompression bomb (a corrupt size field, or an image
    # over Image.MAX_IMAGE_PIXELS) is not an OSError
    return (OSError, ValueError, SyntaxError, Image.DecompressionBombError)


class ImageError(ConfigError):
    """A file that cannot be decoded as an image (with on_error=fail): one line naming it."""


# what `decode_into` makes of a file, versioned: caches keyed by a fingerprint holding it are
# rebuilt when it changes (2: 16-bit grayscale scaled to 8 bits, no longer clipped; 3: 32-bit
# float images unreadable, no longer all zeros; 4: only the centre crop is resampled, which
# rounds some pixels one level the other way)
DECODER = 4


def decode(source: Any, size: int, resize: int, name: Optional[str] = None) -> torch.Tensor:
    """An image file (a path or an open binary file) as a uint8 (3, size, size) tensor: its
    shorter side resized to `resize` (bilinear, antialiased), then the centre `size` x `size`.
    `name`: what a warning calls it (an open file's own name, or its path, else)."""
    out = torch.empty((3, size, size), dtype=torch.uint8)
    decode_into(source, out.numpy(), size, resize, name)
    return out


def decode_into(source: Any, out: np.ndarray, size: int, resize: int,
                name: Optional[str] = None) -> None:
    """`decode`, written into `out` (uint8, (3, size, size)); `out` is left as it was when the
    file cannot be read."""
    from PIL import Image

    if isinstance(source, (str, os.PathLike)) and not stat.S_ISREG(os.stat(source).st_mode):
        # a pipe or a device would be read until it ends (a FIFO: forever)
        raise OSError(f"not a regular file: {source}")
    if not _LARGE_QUIET:  # Pillow's own warning names no file: said below. (Set once: a
        # catch_warnings per image reset every module's once-only warnings at each exit)
        warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)
        _LARGE_QUIET.append(True)
    with Image.open(source) as img:
        bound = Image.MAX_IMAGE_PIXELS  # (None: the user turned the check off)
        if bound and img.width * img.height > bound:
            # (a JPEG is decoded in draft mode below: at 1/2, 1/4 or 1/8 of its size)
            scale = 1 if img.format != "JPEG" else next(
                (s for s in (8, 4, 2) if min(img.size) >= s * resize), 1)
            _say_large(name or getattr(source, "name", source), img.width, img.height, bound,
                       scale)
        if img.mode == "F":  # 32-bit float (TIFF): no scale to read it in; RGB would clip it
            raise ValueError("a 32-bit float image (mode F): store it with 8 or 16 bits")
        if img.format == "JPEG" and min(img.size) >= 2 * resize:
            # DCT scaling inside libjpeg: never below the requested size
            img.draft("RGB", (resize * img.size[0] // min(img.size),
                              resize * img.size[1] // min(img.size)))
        if img.mode.startswith("I;16") or img.mode == "I":
            # 16-bit grayscale (PNG, TIFF): Pillow's conversion clips it at 255, which turns
            # all but the darkest pixels white; keep the top 8 of the 16 bits instead
            wide = np.clip(np.asarray(img), 0, 65535).astype(np.uint32)
            img = Image.fromarray((wide >> 8).astype(np.uint8), "L")
        if img.mode != "RGB":  # (converting an RGB image would only copy it)
            img = img.convert("RGB")
        w, h = img.size
        scale = resize / min(w, h)
        nw, nh = max(size, round(w * scale)), max(size, round(h * scale))
        left, top = (nw - size) // 2, (nh - size) // 2
        if (nw, nh) == (w, h):
            pixels = np.asarray(img)[top:top + size, left:left + size]  # (size, size, 3)
        else:
            # only the centre's pixels are resampled: the crop's box in the file's coordinates,
            # at the scale of the whole resize (the filter reads the same source pixels). A
            # resize of the whole image first made a 1 x 8000 strip 256 x 2,048,000 (1.5 GB)
            sx, sy = w / nw, h / nh
            box = (left * sx, top * sy, (left + size) * sx, (top + size) * sy)
            pixels = np.asarray(img.resize((size, size), Image.BILINEAR, box=box,
                                           reducing_gap=None))
    # the channels-first layout in one copy, straight into its place in the batch (Pillow's
    # crop, np.array, a contiguous permute and the collate's stack took four)
    np.copyto(out, pixels.transpose(2, 0, 1))


def image_settings(size: int, resize: Optional[int], on_error: str) -> int:
    """The image settings shared by image folders and image shards, checked; returns the
    shorter side to resize to (null: size / 0.875, the usual 256 for 224)."""
    if on_error not in ON_ERROR:
        raise ValueError(f"data.dataset.on_error={on_error!r}: must be skip or fail")
    for key, value in (("size", size), ("resize", resize)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise ValueError(f"data.dataset.{key}={value}: must be a whole number of pixels")
    if size < 1 or (resize is not None and resize < size):
        raise ValueError(f"data.dataset.size={size}, resize={resize}: need size >= 1 and "
                         "resize >= size (or null)")
    return default_resize(size, resize)


def default_resize(size: int, resize: Optional[int]) -> int:
    """The shorter side an image is resized to before its centre crop of `size`: `resize`,
    or size / 0.875 (the usual 256 for 224)."""
    return resize if resize is not None else round(size / 0.875)


_LARGE_SAID: List[bool] = []  # once per process (each loader worker says its first)
_LARGE_QUIET: List[bool] = []  # Pillow's warning filtered out, once per process


def _say_large(name: Any, w: int, h: int, bound: int, scale: int = 1) -> None:
    """The first image over Pillow's bound, once per process, with what its decode costs
    each time: in full, or (a JPEG's draft mode) at 1/`scale` of its size."""
    if _LARGE_SAID:
        return
    _LARGE_SAID.append(True)
    decoded = ("in full size" if scale == 1 else
               f"at 1/{scale} of its size in JPEG draft mode, {w // scale}x{h // scale}")
    log.warning("data: the image %s is %dx%d (%s pixels), over Pillow's decompression-bomb "
                "bound (PIL.Image.MAX_IMAGE_PIXELS=%s): decoded each time %s (%.0f MB); such "
                "files are best resized once, ahead of the runs", name, w, h, f"{w * h:,}",
                f"{bound:,}", decoded, 3 * (w // scale) * (h // scale) / 1e6)


class Unreadable:
    """The on_error policy for samples Pillow cannot read, and the record of those skipped:
    a flag per sample (the first `flags` samples) in shared memory, which the loader workers
    mark, so that each is warned about once per run and counted in the training process.
    `noun`/`nouns` name them in messages ("image"/"files", "sample"/"samples")."""

    def __init__(self, on_error: str, flags: int, noun: str, nouns: str):
        self.on_error, self.noun, self.nouns = on_error, noun, nouns
        self.flags = multiprocessing.RawArray("b", flags)

    def handle(self, e: BaseException, index: Optional[int], where: str) -> None:
        """Raises ImageError for `fail`; for `skip` warns (the first time) and returns."""
        # a name with a line break in it cut the line at it (and named the wrong file)
        shown = where.replace("\n", "\\n").replace("\r", "\\r")
        text = str(e).replace(where, shown) if where else str(e)
        where = shown
        reason = text.splitlines()[0] if text else type(e).__name__
        reason = re.sub(r" ?<_io\.BytesIO object at 0x[0-9a-f]+>", "", reason)
        if self.on_error == "fail":
            remedy = "remove it, or " if self.noun == "image" else ""
            raise ImageError(f"data: cannot read the {self.noun} {where} ({reason}); {remedy}"
                             f"set data.dataset.on_error=skip to skip and count such "
                             f"{self.nouns}") from None
        if index is not None and index < len(self.flags):
            if self.flags[index]:  # warned already (another worker, another epoch)
                return
            self.flags[index] = 1
        log.warning("%sdata: skipped an unreadable %s %s (%s); data.dataset.on_error=skip",
                    rank_prefix(), self.noun, where, reason)

    def indices(self) -> np.ndarray:
        """The samples skipped so far, in this process and its workers."""
        return np.flatnonzero(np.frombuffer(self.flags, dtype=np.int8))


class DecodedBatch(Sequence):
    """The samples of a batch decoded into one tensor (`ImageFolder.__getitems__`): a
    sequence of (image, label) samples like the list a DataLoader collates, whose images and
    labels are already stacked in `images` and `labels` (the first `count` rows of the
    buffers they were made in: files skipped under on_error=skip are left out). `lease`: the
    buffers' pool lease (data/batchpool.py), for the collate to hand the batch out with."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, count: int, lease: Any):
        self.images, self.labels, self.lease = images[:count], labels[:count], lease

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, k: Any) -> Any:
        if isinstance(k, slice):
            return [self[j] for j in range(*k.indices(len(self)))]
        return self.images[k], self.labels[k]

    def __iter__(self):
        return (self[j] for j in range(len(self)))


class SkipCollate:
    """`collate` (the default one unless given) over the samples that are not None (files
    skipped by on_error=skip); a batch of skipped files only is an empty batch of the right
    shapes (the loop weighs it 0). A `DecodedBatch` is stacked already: with the default
    collate it is the batch as it stands, no copy."""

    def __init__(self, shape: Sequence[int], collate: Optional[Any] = None):
        self.shape = tuple(shape)
        self.collate = collate or default_collate

    def __call__(self, samples: Sequence[Any]) -> Any:
        if isinstance(samples, DecodedBatch):
            if self.collate is default_collate:
                batch = [samples.images, samples.labels]
            else:
                batch = self.collate(list(samples)) if len(samples) else self.empty()
            return hand_out(batch, samples.lease)
        kept = [s for s in samples if s is not None]
        if kept:
            return self.collate(kept)
        return self.empty()

    def empty(self) -> List[torch.Tensor]:
        return [torch.empty((0, *self.shape), dtype=torch.uint8),
                torch.empty((0,), dtype=torch.int64)]


def _stamp(path: str) -> Tuple[Optional[int], Optional[int]]:
    """A file's (size, modification time); (None, None) for one that cannot be read (a broken
    link: skipped or refused when it is decoded, by data.dataset.on_error, as without a
    cache; the disk cache's key failed on it first, in a line naming no key)."""
    try:
        st = os.stat(path)
    except OSError:
        return None, None
    return st.st_size, st.st_mtime_ns


class ImageFolder(Dataset):
    """(uint8 (3, size, size) image, int64 class) pairs from `root/<split>/<class>/<file>`,
    or, with `val_fraction`, from `root/<class>/<file>` with that share of each class held out
    for the val split (seeded by `split_seed`; data/imagefiles.py).

    `size`: the square crop; `resize`: the shorter side before cropping (null: size / 0.875,
    the usual 256 for 224); `on_error`: skip | fail for unreadable files (module doc).
    `classes` (sorted subfolder names of the train root) and `samples` (path, class) are
    attributes; the trainer writes the class list to the run dir.
    """

    uint8_images = True  # (the stall advice does not tell it to ship uint8)

    def __init__(self, split: str = "train", root: str = "images", size: int = 224,
                 resize: Optional[int] = None, on_error: str = "skip",
                 val_fraction: Optional[float] = None, split_seed: int = 0):
        if split not in SPLIT_DIRS:
            raise ValueError(f"split={split!r}: must be one of {tuple(SPLIT_DIRS)}")
        self.resize = image_settings(size, resize, on_error)
        self.root, self.split, self.on_error = Path(root), split, on_error
        self.size = size
        self.classes, self.samples = image_lists(self.root, split, val_fraction, split_seed)
        self.unreadable = Unreadable(on_error, len(self.samples), "image", "files")
        self.collate_fn = SkipCollate((3, size, size))
        self.held_out = None  # drawn from the classes' files: which they are (checkpoints)
        if val_fraction is not None and split == "val":
            names = sorted(os.path.relpath(path, self.root) for path, _ in self.samples)
            self.held_out = hashlib.sha1("\n".join(names).encode()).hexdigest()[:16]

    def __len__(self) -> int:
        return len(self.samples)

    def fingerprint(self) -> str:
        """What identifies the decoded samples: the files (names, sizes, times) and settings;
        a cache keyed by it is rebuilt when any of them changes."""
        files = [(p, *_stamp(p)) for p, _ in self.samples]
        return repr((DECODER, self.classes, self.size, self.resize, files))

    def __getitem__(self, i: int) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        image = torch.empty((3, self.size, self.size), dtype=torch.uint8)
        if not self._read(i, image.numpy()):
            return None
        return image, torch.tensor(self.samples[i][1])

    def _read(self, i: int, out: np.ndarray) -> bool:
        """Decodes sample `i`'s file into `out`; False for a file skipped under
        on_error=skip (on_error=fail raises)."""
        path = self.samples[i][0]
        try:
            decode_into(path, out, self.size, self.resize)
        except unreadable_errors() as e:
            self.unreadable.handle(e, i, path)
            return False
        return True

    def __getitems__(self, indices: List[int]) -> Sequence[Any]:
        """The samples `indices`, each decoded straight into its row of one batch tensor (a
        slot of the loader's batch pool in a worker: data/batchpool.py); the DataLoader's
        batched fetch. A subclass with a `__getitem__` of its own gets its samples from it."""
        if type(self).__getitem__ is not ImageFolder.__getitem__:
            return [self[i] for i in indices]
        n = len(indices)
        (images, labels), lease = batch_buffer(((n, 3, self.size, self.size), torch.uint8),
                                               ((n,), torch.int64))
        rows, count = images.numpy(), 0
        for i in indices:
            if self._read(i, rows[count]):
                labels[count] = self.samples[i][1]
                count += 1
        return DecodedBatch(images, labels, count, lease)

    def skipped(self) -> List[str]:
        """The files skipped so far, in this process and its workers."""
        return [self.samples[i][0] for i in self.unreadable.indices()]


def image_classes(root: str) -> int:
    """The number of classes of an image folder (the config's `data.num_classes`): of its
    train/ folder, or of the folder itself where it has none (`val_fraction`)."""
    check_root(Path(root))
    train = Path(root) / SPLIT_DIRS["train"]
    return len(find_classes(train if train.is_dir() else Path(root)))

"""Which files an image folder's samples are: its classes (the sorted subfolder names), every
image under each class folder (subfolders and links followed once, loops and links into
another class or split left out, each kind said in one warning), and the split:

    root/train/<class>/<file>, root/val/<class>/<file>     (val_fraction null)
    root/<class>/<file>, a share of each class held out     (val_fraction=0.2)

data/images.py decodes them.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

# what Pillow reads in its wheels (GIF: the first frame; TIFF: the first page)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp")
SPLIT_DIRS = {"train": "train", "val": "val"}
log = logging.getLogger("stoker")


def _subfolders(folder: Path) -> List[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def check_root(root: Path) -> None:
    """FileNotFoundError naming `data.dataset.root` itself where there is no such folder (not
    the train/ folder of one layout, where the other was meant)."""
    if not Path(root).is_dir():
        raise FileNotFoundError(
            f"data.dataset.root: no folder {root} (expected <root>/train/<class>/<image> and "
            "<root>/val/<class>/<image>, or <root>/<class>/<image> with "
            "data.dataset.val_fraction)")


def find_classes(folder: Path) -> List[str]:
    """The sorted names of `folder`'s subfolders: class i is the i-th name."""
    if not folder.is_dir():
        raise FileNotFoundError(f"data.dataset.root: no folder {folder} (expected "
                                "<root>/train/<class>/<image> and <root>/val/<class>/<image>)")
    classes = _subfolders(folder)
    if len(classes) < 2:
        raise ValueError(f"data.dataset.root: {folder} has {len(classes) or 'no'} class "
                         f"subfolder{'' if len(classes) == 1 else 's'}; a classifier needs two "
                         f"or more (expected {folder}/<class>/<image>)")
    return classes


def find_images(folder: Path, classes: Sequence[str], require_all: bool = False,
                say: bool = True) -> List[Tuple[str, int]]:
    """(path, class index) of every image under `folder/<class>/`, sorted by class and name
    (subfolders of a class folder included); `require_all`: every class must have one;
    `say`: its warnings of files left out (else silent: another listing says them)."""
    index = {name: i for i, name in enumerate(classes)}
    if not folder.is_dir():
        raise FileNotFoundError(f"data.dataset.root: no folder {folder} (expected "
                                f"{folder}/<class>/<image>, beside {folder.parent}/train)")
    found = _subfolders(folder)
    unknown = [name for name in found if name not in index]
    if unknown:
        raise ValueError(f"data.dataset.root: {folder} has class folders the train set lacks: "
                         f"{unknown[:5]}; every class needs training images")
    samples, left = [], {"others": [], "looped": [], "dangling": []}
    loose = sorted(p.name for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
    homes: dict = {}
    for name in found:  # (the first name of a folder: a link to it comes after, or is refused)
        homes.setdefault(os.path.realpath(folder / name), name)
    if len(homes) < len(found):  # (a class folder linked to another's: the same images were
        # two classes' at once, without a word)
        twin = next(name for name in found if homes[os.path.realpath(folder / name)] != name)
        raise ValueError(f"data.dataset.root: {folder / twin} is the same folder as "
                         f"{folder / homes[os.path.realpath(folder / twin)]} (a link): its "
                         "images would be two classes' at once; remove the link, or copy the "
                         "images it should hold into a folder of its own")
    # the other split's folder: a link into it from here would train on validation images
    fences = {os.path.realpath(folder.parent / d) for d in SPLIT_DIRS.values()} - {
        os.path.realpath(folder)}
    for name in found:
        samples += [(path, index[name])
                    for path in _walk_class(folder / name, homes, fences, name, left)]
    main = say and os.environ.get("RANK", "0") == "0"  # (every rank lists the same files)
    if main:
        _say_left_out(folder, loose, **left)
    if not samples:
        raise ValueError(f"data.dataset.root: no {'/'.join(IMAGE_EXTENSIONS)} files under "
                         f"{folder}/<class>/")
    empty = sorted(set(classes) - {classes[label] for _, label in samples})
    if empty and require_all:
        raise ValueError(f"data.dataset.root: class folders without images under "
                         f"{folder}: {empty[:5]}; every class needs training images")
    if empty and main:  # validation's metrics then say nothing of them
        log.warning("data: %s of the %d classes %s no images under %s (e.g. %s): the metrics "
                    "there leave %s out", len(empty), len(classes),
                    "has" if len(empty) == 1 else "have", folder, ", ".join(empty[:3]),
                    "it" if len(empty) == 1 else "them")
    return samples


def _say_left_out(folder: Path, loose: list, others: list, looped: list,
                  dangling: list) -> None:
    """One warning for each kind of entry a listing of `folder` left out."""
    def some(paths: list, noun: str) -> Tuple[str, str]:
        """"N noun(s)", and up to three of `paths` relative to `folder`."""
        return (f"{len(paths)} {noun}{'' if len(paths) == 1 else 's'}",
                ", ".join(os.path.relpath(p, folder) for p in paths[:3]))

    if others:
        what, e_g = some(others, "file")
        log.warning("data: %s under %s/<class>/ not %s, left out (e.g. %s)", what, folder,
                    "/".join(e[1:] for e in IMAGE_EXTENSIONS), e_g)
    if loose:  # a class is a folder: a file beside them has none
        what, e_g = some([folder / name for name in loose], "file")
        log.warning("data: %s directly under %s, in no class folder, left out (e.g. %s): move "
                    "them into their class's folder", what, folder, e_g)
    if looped:
        what, e_g = some(looped, "linked folder")
        log.warning("data: %s under %s/<class>/ lead%s back into the data (a loop, another "
                    "class's folder or the other split), left out: their images would be "
                    "listed twice, under the wrong class or in both splits (e.g. %s)", what,
                    folder, "s" if len(looped) == 1 else "", e_g)
    if dangling:
        what, e_g = some(dangling, "link")
        log.warning("data: %s under %s/<class>/ lead%s nowhere (an unmounted share? a moved "
                    "folder?), left out (e.g. %s)", what, folder,
                    "s" if len(dangling) == 1 else "", e_g)


def _walk_class(top: Path, homes: dict, fences: set, name: str, left: dict):
    """The path of every image under class folder `top`, linked subfolders followed once:
    one that resolves to a folder already kept, to an ancestor of `top`, into another
    class's folder or into a `fences` folder (the other split) is left out (in
    left["looped"]), as are files that are not images (left["others"]) and links that lead
    nowhere (left["dangling"]). `homes`: each class folder's real path -> its class. A folder
    that cannot be listed is an error naming it, not a class that silently lost its images."""
    others, looped, dangling = left["others"], left["looped"], left["dangling"]
    home = os.path.realpath(top)  # (its key in `homes`)
    seen = {home}

    def refuse(e: OSError) -> None:
        raise ValueError(f"data.dataset.root: cannot list {e.filename} ({e.strerror}); make it "
                         "readable, or move it out of the data") from None

    def leads_back(real: str) -> bool:
        if real in seen or home.startswith(real + os.sep):  # (a loop, or above the class)
            return True
        up = real
        while True:  # into another class's folder or split: one of its parents is one
            if homes.get(up, name) != name or up in fences:
                return True
            parent = os.path.dirname(up)
            if parent == up:
                return False
            up = parent

    for dirpath, dirnames, filenames in os.walk(top, followlinks=True, onerror=refuse):
        kept = []
        for d in sorted(dirnames):
            real = os.path.realpath(os.path.join(dirpath, d))
            if leads_back(real):
                looped.append(os.path.join(dirpath, d))
            else:
                seen.add(real)  # (kept now: a link to a sibling not yet entered is refused)
                kept.append(d)
        dirnames[:] = kept
        for f in sorted(filenames):
            if f.startswith("."):
                continue
            path = os.path.join(dirpath, f)
            if f.lower().endswith(IMAGE_EXTENSIONS):
                yield path
            else:  # (os.walk lists a link to a folder that is gone among the files)
                (dangling if os.path.islink(path) and not os.path.exists(path)
                 else others).append(path)


def check_split_seed(split_seed: Any) -> None:
    """ValueError naming data.dataset.split_seed unless it is a whole number >= 0 (numpy's
    `expected non-negative integer` or `SeedSequence expects int ...` named no key)."""
    if not isinstance(split_seed, int) or isinstance(split_seed, bool) or split_seed < 0:
        raise ValueError(f"data.dataset.split_seed={split_seed}: must be a whole number >= 0 "
                         "(it fixes which samples are held out for validation)")


def image_lists(root: Path, split: str, val_fraction: Optional[float], split_seed: int
                ) -> Tuple[List[str], List[Tuple[str, int]]]:
    """(classes, samples) of `split` of the folder `root`: its train/ and val/ folders, or,
    with `val_fraction`, a folder of classes alone, split by `hold_out`."""
    check_root(root)
    if val_fraction is None:
        if not (root / SPLIT_DIRS["train"]).is_dir() and root.is_dir() and _subfolders(root):
            raise FileNotFoundError(
                f"data.dataset.root: no folder {root / SPLIT_DIRS['train']} (expected "
                "<root>/train/<class>/<image> and <root>/val/<class>/<image>); a folder of "
                "<root>/<class>/<image> alone: set data.dataset.val_fraction (e.g. 0.2) to "
                "hold out a share of each class for validation")
        classes = find_classes(root / SPLIT_DIRS["train"])
        return classes, find_images(root / SPLIT_DIRS[split], classes,
                                    require_all=split == "train")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"data.dataset.val_fraction={val_fraction}: must be between 0 and 1 "
                         "(a share of each class), or null for <root>/train and <root>/val")
    check_split_seed(split_seed)
    if (root / SPLIT_DIRS["train"]).is_dir():
        if not (root / SPLIT_DIRS["val"]).is_dir():  # (make_images --val-fraction 0 writes it)
            raise ValueError(f"data.dataset.val_fraction={val_fraction}: {root} holds train/ "
                             "and no val/: to split the classes in train/, name them: "
                             f"data.dataset.root={root / SPLIT_DIRS['train']}")
        raise ValueError(f"data.dataset.val_fraction={val_fraction}: {root} holds train/, a "
                         "split of its own; leave data.dataset.val_fraction null to use it, or "
                         "name a folder of <root>/<class>/<image>")
    classes = find_classes(root)
    # (each split lists the whole folder: its warnings said once, by the train split's)
    found = find_images(root, classes, require_all=True, say=split == "train")
    return classes, hold_out(found, classes, val_fraction, split_seed)[split]


def hold_out(samples: List[Tuple[str, int]], classes: Sequence[str], val_fraction: float,
             split_seed: int) -> Dict[str, List[Tuple[str, int]]]:
    """{"train": ..., "val": ...}: `val_fraction` of each class's samples (rounded) held out
    for validation, chosen by a permutation of the class's files seeded by `split_seed` alone
    (not the run's seed: every run and rank holds out the same files, and the same files give
    the same split); each class needs a file on both sides, or it is named in one line."""
    rng = np.random.default_rng(split_seed)
    split: Dict[str, List[Tuple[str, int]]] = {"train": [], "val": []}
    by_class: List[List[Tuple[str, int]]] = [[] for _ in classes]
    for sample in samples:  # (one pass: not one per class, over a million files)
        by_class[sample[1]].append(sample)
    for name, mine in zip(classes, by_class):
        n_val = int(round(len(mine) * val_fraction))
        if not 1 <= n_val < len(mine):
            raise ValueError(
                f"data.dataset.val_fraction={val_fraction}: class {name!r} has {len(mine)} "
                f"image{'' if len(mine) == 1 else 's'}, of which it holds out {n_val}; each "
                "class needs one in training and one in validation (add images, or change "
                "data.dataset.val_fraction)")
        held = set(rng.permutation(len(mine))[:n_val].tolist())
        for i, sample in enumerate(mine):
            split["val" if i in held else "train"].append(sample)
    return split

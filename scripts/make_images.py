"""Write a folder of real JPEG files to try `data=image_folder` on (nothing is downloaded).

    python scripts/make_images.py --out data_images                    # 10 classes, 2,000 files
    python train.py data=image_folder data.dataset.root=data_images data.dataset.size=64 model=cnn

Each class is a pattern (stripes at its own angle, in its own colours) drawn with a random
phase, frequency and noise per file, at --size x --size pixels, saved as JPEG (quality 90):
real files that Pillow decodes, learnable by a small CNN. Layout:
`<out>/train/<class>/<n>.jpg` and `<out>/val/<class>/<n>.jpg` (--val-fraction of each class).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import List, Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.staging import Terminated, refusal, sigterm_raises, staged  # noqa: E402


def pattern(label: int, classes: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """One (size, size, 3) uint8 image of class `label`."""
    angle = np.pi * label / classes + rng.normal(0, 0.05)
    freq = rng.uniform(4, 8) * 2 * np.pi / size
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    wave = np.sin(freq * (xx * np.cos(angle) + yy * np.sin(angle)) + rng.uniform(0, 2 * np.pi))
    hue = 2 * np.pi * label / classes
    colour = 0.5 + 0.4 * np.cos(hue + np.array([0.0, 2.1, 4.2], dtype=np.float32))
    image = 0.5 + 0.35 * wave[..., None] * colour + rng.normal(0, 0.08, (size, size, 3))
    return (np.clip(image, 0, 1) * 255).astype(np.uint8)


def write_images(out: Path, count: int = 2000, size: int = 256, classes: int = 10,
                 val_fraction: float = 0.2, seed: int = 0, quality: int = 90) -> List[Path]:
    """Writes `count` JPEG files (spread evenly over `classes`) under `out`; returns them."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    paths = []
    for i in range(count):
        label = i % classes
        nth = i // classes
        per_class = count // classes + (1 if label < count % classes else 0)
        split = "val" if nth >= per_class - int(round(per_class * val_fraction)) else "train"
        folder = out / split / f"class_{label:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{nth:05d}.jpg"
        Image.fromarray(pattern(label, classes, size, rng)).save(path, quality=quality)
        paths.append(path)
    return paths


MAX_SIZE = 8192  # pixels per side: larger patterns do not fit a machine's memory


def main(argv: Optional[List[str]] = None) -> None:
    """The command line: bad flags are one line and exit 2; a failed write one line and 1;
    Ctrl-C or SIGTERM one line and 130 or 143; --out is replaced whole or left as it was."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True,
                   help="folder to write (train/ and val/; train/ alone with --val-fraction 0)")
    p.add_argument("--count", type=int, default=2000, help="files in all")
    p.add_argument("--size", type=int, default=256, help=f"pixels per side (8 to {MAX_SIZE})")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--val-fraction", type=float, default=0.2,
                   help="share of each class in val/ (0: train/ alone, a folder of classes that "
                        "data.dataset.val_fraction splits)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true",
                   help="replace an --out folder this script wrote (once the new one is "
                        "complete)")
    a = p.parse_args(argv)
    if a.count < a.classes or a.classes < 1 or not 8 <= a.size <= MAX_SIZE \
            or not 0 <= a.val_fraction < 1:
        p.error(f"need --count >= --classes >= 1, 8 <= --size <= {MAX_SIZE} and "
                "0 <= --val-fraction < 1")
    sizes = {a.count // a.classes + (1 if label < a.count % a.classes else 0)
             for label in range(a.classes)}  # files per class
    if a.val_fraction > 0 and any(not 1 <= round(n * a.val_fraction) < n for n in sizes):
        p.error(f"--count {a.count} --classes {a.classes} --val-fraction {a.val_fraction}: "
                f"each class needs a file in train/ and in val/ ({min(sizes)} "
                f"file{'' if min(sizes) == 1 else 's'} a class); "
                "raise --count or change --val-fraction (0: train/ alone)")
    refusal = out_refusal(a.out, a.overwrite)
    if refusal:
        p.error(f"--out {a.out}: {refusal}")
    start = time.perf_counter()
    try:
        with sigterm_raises(), staged(a.out.resolve()) as stage:
            paths = write_images(stage, a.count, a.size, a.classes, a.val_fraction, a.seed)
    except OSError as e:  # a read-only or full disk
        sys.exit(f"make_images: --out {a.out}: cannot write it: {e.strerror or e}")
    except KeyboardInterrupt:
        print("make_images: interrupted; --out is as it was", file=sys.stderr)
        sys.exit(130)
    except Terminated:
        print("make_images: stopped by SIGTERM; --out is as it was", file=sys.stderr)
        sys.exit(143)
    print(f"wrote {len(paths)} JPEG files of {a.size}x{a.size} under {a.out} in "
          f"{time.perf_counter() - start:.1f}s")
    if a.val_fraction > 0:
        print(f"use them: python train.py data=image_folder data.dataset.root={a.out} "
              f"data.dataset.size={min(64, a.size)} model=cnn")  # (never an upscale)
    else:  # a folder of classes alone: data=image_folder holds a share of each out itself
        print(f"train/ alone (--val-fraction 0), a folder of classes: use it: python train.py "
              f"data=image_folder data.dataset.root={a.out}/train data.dataset.val_fraction=0.2 "
              f"data.dataset.size={min(64, a.size)} model=cnn")


def out_refusal(out: Path, overwrite: bool) -> Optional[str]:
    """Why `out` must not be written (it is replaced whole), or None (staging.refusal)."""
    return refusal(out.resolve(), overwrite, _foreign, "train/ and val/ of class_NN folders")


def _foreign(folder: Path) -> Optional[str]:
    """The first entry of `folder` that this script does not write, or None."""
    for split in sorted(folder.iterdir()):
        if split.name not in SPLITS or not split.is_dir():
            return split.name
        for c in sorted(split.iterdir()):
            if not (c.is_dir() and c.name.startswith("class_")):
                return f"{split.name}/{c.name}"
    return None


SPLITS = ("train", "val")


if __name__ == "__main__":
    main()

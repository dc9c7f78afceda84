"""Write any configured dataset once as .npy arrays that `data=memmap` reads back.

    python scripts/prepare_data.py --out data_cache/digits                  # the default data
    python scripts/prepare_data.py --out data_cache/heavy data=heavy data.num_workers=2
    python train.py data=memmap data.dataset.root=data_cache/heavy
    python scripts/prepare_data.py --out data_cache/images data=image_folder \
        data.dataset.root=data_images data.dataset.size=64              # decoded once
    python scripts/prepare_data.py --format shards --out shards/images data=image_folder \
        data.dataset.root=data_images                                  # files as tar shards

The dataset is composed from conf/ exactly as train.py would (overrides after the options),
run once through a DataLoader with `data.num_workers` workers, and stored as
`<out>/<split>/x.npy`, `<out>/<split>/y.npy` plus `<out>/meta.json` (input shape, classes,
dtype, source config). Expensive per-sample work (decoding, generation) is paid once.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

import trainer.config  # noqa: E402,F401  (registers the schema)
from data.advice import count_of  # noqa: E402
from data.cache import write_arrays  # noqa: E402
from data.datasets import MemmapDataset  # noqa: E402
from data.shards import ShardStream  # noqa: E402
from data.shardwriter import write_shards  # noqa: E402
from scripts.staging import Terminated, refusal, sigterm_raises, staged  # noqa: E402
from trainer.checks import resolve  # noqa: E402
from trainer.cli import USER_ERRORS, fail, import_from_cwd  # noqa: E402
from trainer.config import ConfigError, cpu_workers  # noqa: E402
from trainer.feeds import build_datasets  # noqa: E402


def main(argv: Optional[List[str]] = None) -> dict:
    """The command line; a wrong setting or an unreadable file is one line and exit 2; a
    Ctrl-C or SIGTERM one line and 130 or 143, --out left as it was."""
    import_from_cwd()  # the user's own modules, as train.py finds them
    try:
        with sigterm_raises():
            return prepare(argv)
    except (*USER_ERRORS, FileNotFoundError) as e:
        fail(e)
    except OSError as e:  # a read-only or full disk, a file in the way
        fail(e, code=1)
    except KeyboardInterrupt:
        fail(RuntimeError("interrupted; --out is as it was"), code=130)
    except Terminated:
        fail(RuntimeError("stopped by SIGTERM; --out is as it was"), code=143)


def prepare(argv: Optional[List[str]] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="folder to write")
    p.add_argument("--format", choices=["npy", "shards"], default="npy",
                   help="npy: decoded arrays for data=memmap; shards: tar shards for data=shards")
    p.add_argument("--shard-samples", type=int, default=1000, help="samples per tar shard")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an --out folder this script wrote (once the new one is "
                        "complete)")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. data=heavy")
    a = p.parse_intermixed_args(argv)  # options before, between or after the overrides
    if a.shard_samples < 1:
        p.error("--shard-samples must be >= 1")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=["run_dir=unused", *a.overrides])
    out = a.out.resolve()  # a link to a folder: the folder it names is replaced, not the link
    refusal = out_refusal(out, cfg, a.overwrite)
    if refusal:
        p.error(f"--out {a.out}: {refusal}")
    resolve(cfg)  # the checks train.py makes (data=custom with no dataset: nothing to write)
    # written beside --out and moved there complete: a failure leaves --out as it was
    with staged(out) as stage:
        try:
            meta = write(cfg, a, stage, a.out)
        except OSError as e:  # named by --out, not by the staging folder the user never gave
            why = e.strerror or str(e).replace(str(stage), str(a.out))
            raise OSError(f"--out {a.out}: cannot write it: {why}") from None
    print("use it: python train.py " + use_args(a.format, a.out, cfg.data, meta))
    return meta


def out_refusal(out: Path, cfg, overwrite: bool) -> Optional[str]:
    """Why `out` must not be written (it is replaced whole), or None (staging.refusal), the
    data it reads counted."""
    reads = []
    for key in ("dataset", "train_dataset", "val_dataset"):
        root = OmegaConf.select(cfg, f"data.{key}.root", default=None)
        if root:
            reads.append((f"data.{key}.root={root}", Path(str(root)).expanduser().resolve()))
    return refusal(out, overwrite, _foreign, "meta.json and its splits", reads)


def _foreign(out: Path) -> Optional[str]:
    """The first entry of `out` this script did not write (meta.json and the splits it
    names), or None."""
    try:
        meta = json.loads((out / "meta.json").read_text())
        ours = ["meta.json", *meta["splits"]] if isinstance(meta.get("source"), dict) else []
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        ours = []
    return next((e.name for e in sorted(out.iterdir()) if e.name not in ours), None)


def write(cfg, a: argparse.Namespace, stage: Path, out: Path) -> dict:
    """Writes the configured datasets into `stage` (named `out` in what it prints)."""
    d = cfg.data
    stage.mkdir(parents=True)
    source = {k: OmegaConf.to_container(d[k], resolve=True)
              for k in ("dataset", "train_dataset", "val_dataset") if d[k] is not None}
    meta = {"source": source, "num_classes": d.num_classes, "splits": {}}
    start = time.perf_counter()
    for split, dataset in zip(("train", "val"), build_datasets(cfg)):
        if dataset is None:  # a train_dataset without a val_dataset
            continue
        if isinstance(dataset, ShardStream):  # (the one stream build_datasets lets through)
            raise ConfigError(f"data: {type(dataset).__name__} is streamed (data=shards is "
                              "packed already); prepare_data.py reads a dataset by index: an "
                              "image folder, digits, synthetic or one of your own")
        workers = cpu_workers(cfg.data, 1)
        classes = getattr(dataset, "classes", None)  # an image folder's class names
        if a.format == "shards":
            index = write_shards(dataset, stage / split, a.shard_samples, workers,
                                 seed=cfg.seed, num_classes=d.num_classes)
            meta["splits"][split] = sum(s["samples"] for s in index["shards"])
            what = f"{index['kind']} samples in {count_of(len(index['shards']), 'shard')}"
        else:
            shape = write_arrays(dataset, stage / split, num_workers=workers)
            meta["input_shape"] = list(shape)
            meta["splits"][split] = len(MemmapDataset(split, str(stage)))  # unreadable: left out
            what = f"samples of {list(shape)}"
            if classes is not None:  # images: normalised by default
                meta.update(normalize_mean=list(d.normalize_mean or []) or None,
                            normalize_std=list(d.normalize_std or []) or None)
        if classes is not None:
            meta["classes"] = list(classes)
        print(f"{split}: {meta['splits'][split]} {what} -> {out / split} "
              f"in {time.perf_counter() - start:.1f}s")
        start = time.perf_counter()
    meta["num_classes"] = d.num_classes  # (a dataset naming its classes gives the count)
    (stage / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def use_args(fmt: str, out: Path, d, meta: Dict[str, Any]) -> str:
    """The overrides that train on what was written: image files in shards are decoded while
    training, so the crop the source named (data.dataset.size, resize) goes with them;
    arrays hold it already."""
    args = ["data=shards" if fmt == "shards" else "data=memmap",
            f"data.dataset.root={shlex.quote(str(out))}"]
    source = d.get("dataset") or d.get("train_dataset") or {}  # (train and val: one crop)
    if fmt == "shards" and meta.get("classes"):
        args += [f"data.dataset.{k}={source[k]}" for k in ("size", "resize")
                 if source.get(k) is not None]
    images = source.get("size") is not None if fmt == "shards" else \
        len(meta.get("input_shape") or ()) == 3  # ([C, H, W]: not a table's features)
    if meta.get("classes") and images:  # images: the reference CNN
        args.append("model=cnn")
    return " ".join(args)


if __name__ == "__main__":
    main()

"""Real image files through every input path: decoding, packing, caching and streaming.

    python scripts/bench_images.py                          # 2,000 JPEGs of 256x256, crop 224
    python scripts/bench_images.py --count 500 --workers 4 --compute-ms 20 --out images.json

Writes --count real JPEG files (scripts/make_images.py: procedural, nothing downloaded), then
measures epochs of the training feed (batch --batch, a fixed --compute-ms wait per step that
stands for the GPU's work, as scripts/bench_loader.py does) for:
  (a) 0 workers       decode + float conversion + normalisation on the CPU, in the main process
  (b) W workers       the same in W worker processes (the classic torchvision pipeline)
  (c) W workers uint8 decode only in the workers; uint8 batches, scaled and normalised by the
                      device prefetcher (data/prefetch.py InputTransform) on the GPU (without
                      one, that is the device's work the fixed wait stands for: not run on
                      the CPU, its CPU cost printed beside)
  (c') plain loader   (c)'s reference: torch's DataLoader over the same folder, nothing else
  (d) memmap          scripts/prepare_data.py's packed uint8 arrays (data=memmap): no decoding
  (e) cache=<mode>    data.cache memory, shm, disk and lru, on the second epoch
  (f) shards          tar shards streamed by W workers (data=shards), decoded as they come
Every feed is the one train.py builds with data.placement=auto: the memmap, memory, shm and
disk data (tensors or memory-mapped arrays within data.device_budget_mb) are batched by
indexing on the training device without workers; the others go through W loader workers.
Two reference rows, measured in the same alternation, decode the whole set with no loader
at all (no batches, no transport between processes):
  decode_1_process     one process decodes every file: the decode cost
  decode_W_processes   W processes decode 1/W of the files each, at the same time: what this
                       machine's cores can decode together
Each configuration runs in a fresh process, --repeats times in alternating order (the files,
packed arrays and shards are made once). Each row gives the median over runs of the median
epoch time (the second epoch for the caches), samples/s and the ratio to the decode bound
max(compute, decode cost / W) (`vs_bound`: the issue's bound, which assumes W processes
decode W times as fast as one) and to the machine's bound max(compute, decode_W_processes)
(`vs_machine`: what W cores actually deliver here). One-off costs (packing, sharding,
filling a cache) are reported beside them. `c_vs_bound_paired` and
`c_vs_machine_bound_paired`: the median over repeats of (c)'s epoch over each bound measured
in the same repeat. The training loader's batch pool (data/batchpool.py) is reported as
`batch_pool`: batches formed in a reused slot, in a slot's first block, and unpooled.
Targets: (c) within 1.15x of the decode bound; (d) at least 5x faster per epoch than (b).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from bench_loader import run_epochs  # noqa: E402
from benchlib import (at_least, check_out, default_out, machine, median,  # noqa: E402
                      number_at_least, publish, run_main, table)
from data import cache  # noqa: E402
from data.datasets import MemmapDataset  # noqa: E402
from data.images import ImageFolder  # noqa: E402
from data.loader import build_loader  # noqa: E402
from data.prefetch import DevicePrefetcher, InputTransform  # noqa: E402
from data.shards import ShardStream  # noqa: E402
from data.shardwriter import write_shards  # noqa: E402
from make_images import write_images  # noqa: E402
from processes import run_child  # noqa: E402
from trainer.config import DataConfig  # noqa: E402
from trainer.feeds import placement  # noqa: E402

COLUMNS = ["config", "epoch_s", "samples_per_s", "vs_bound", "vs_machine", "vs_b",
           "one_off_s", "runs"]
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


class CPUNormalised(torch.utils.data.Dataset):
    """An image folder's samples as float32, scaled and normalised on the CPU (in the worker):
    what a torchvision ToTensor + Normalize pipeline ships."""

    def __init__(self, folder: ImageFolder):
        self.folder = folder
        self.mean = torch.tensor(MEAN).view(3, 1, 1)
        self.std = torch.tensor(STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, i: int):
        x, y = self.folder[i]
        return (x.float().div_(255) - self.mean) / self.std, y


def feed(dataset, workers: int, batch: int, device: torch.device, on_device: bool):
    """The training feed train.py builds at data.placement=auto (tensors or memory-mapped
    arrays within data.device_budget_mb: batched by indexing, no workers; else a DataLoader
    with `workers`); `on_device`: uint8 batches normalised by the prefetcher on the GPU.
    Without a GPU that conversion is the device's work, which the fixed wait per step stands
    for, so it is not run on the CPU here (its CPU cost is reported on its own)."""
    cfg = DataConfig(batch_size=batch, num_workers=workers, persistent_workers=True,
                     prefetch_factor=2, shuffle=True)
    collate = getattr(dataset, "collate_fn", None)
    where, _ = placement(OmegaConf.structured(cfg), dataset, device, collate is not None)
    loader = build_loader(dataset, cfg, train=True, device=device, collate_fn=collate,
                          num_workers=0 if where == "device" else workers, placement=where)
    if not on_device:
        transform = InputTransform()  # float batches: nothing to do
    elif device.type == "cuda":
        transform = InputTransform(MEAN, STD)
    else:
        transform = AsShipped()
    return DevicePrefetcher(loader, device, transform)


class AsShipped:
    """A prefetcher transform that leaves batches as the workers shipped them (uint8)."""

    augment = None

    def __call__(self, batch, key=None):
        return batch


class PlainFeed:
    """(c)'s reference: PyTorch's DataLoader as a hand-written script builds it, with nothing
    of Stoker's around it (sampler, prefetcher, seeding)."""

    def __init__(self, folder: ImageFolder, workers: int, batch: int):
        self.loader = torch.utils.data.DataLoader(
            folder, batch_size=batch, shuffle=True, num_workers=workers,
            persistent_workers=True, collate_fn=folder.collate_fn,
            pin_memory=torch.cuda.is_available())

    def __iter__(self):
        return iter(self.loader)

    def close(self) -> None:  # its persistent workers end now, not when garbage is collected
        iterator = self.loader._iterator
        if iterator is not None:
            iterator._shutdown_workers()


def transform_ms(size: int, batch: int) -> float:
    """Milliseconds the device-side conversion of one uint8 batch takes on the CPU."""
    x = torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8)
    transform = InputTransform(MEAN, STD)
    transform([x, None])
    start = time.perf_counter()
    for _ in range(5):
        transform([x, None])
    return (time.perf_counter() - start) / 5 * 1000


def _decode_share(folder: ImageFolder, share: int, procs: int, ready, times) -> None:
    """A decoding process: files share, share + procs, ... once every process is ready."""
    torch.set_num_threads(1)  # as in a loader worker
    folder[share]  # warm: the first file pays for imports and caches
    ready.wait()
    start = time.perf_counter()  # CLOCK_MONOTONIC: comparable across processes
    for i in range(share, len(folder), procs):
        folder[i]
    times.put((start, time.perf_counter()))


def decode_s(folder: ImageFolder, procs: int) -> float:
    """Wall seconds for `procs` processes to decode the whole folder together (each a disjoint
    1/procs of the files, started at once, no loader): from the first start to the last end."""
    ctx = multiprocessing.get_context("fork")
    ready, times = ctx.Barrier(procs), ctx.Queue()
    workers = [ctx.Process(target=_decode_share, args=(folder, k, procs, ready, times))
               for k in range(procs)]
    for p in workers:
        p.start()
    spans = [times.get(timeout=1800) for _ in workers]
    for p in workers:
        p.join()
    return max(end for _, end in spans) - min(start for start, _ in spans)


def measure(name: str, make, epochs: int, compute_s: float, second: bool = False,
            one_off_s: Optional[float] = None) -> Dict[str, Any]:
    """Epoch times of the feed `make()` returns; the second epoch's for caches."""
    fed = make()
    times = run_epochs(fed, epochs, compute_s)
    pool = getattr(getattr(fed, "loader", None), "pool", None)  # the training loader's
    fed.close()  # the workers end now, not when garbage is collected
    epoch_s = times[1] if second else median(times)
    return {"config": name, "epoch_s": epoch_s, "epochs_s": times, "one_off_s": one_off_s,
            "batch_pool": pool.stats() if pool is not None else None}


CONFIGS = ["a_0_workers", "b_workers", "c_workers_uint8", "c_plain_dataloader", "d_memmap",
           "e_cache_memory", "e_cache_shm", "e_cache_disk", "e_cache_lru", "f_shards",
           "decode_1_process", "decode_W_processes"]


def child(name: str, tmp: Path, spec: Dict[str, Any]) -> Dict[str, Any]:
    """One configuration's measurement, in a fresh process."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    w, b, epochs, compute_s = spec["workers"], spec["batch"], spec["epochs"], spec["compute_s"]
    folder = ImageFolder("train", str(tmp / "images"), size=spec["size"])
    if name.startswith("decode_"):
        seconds = decode_s(folder, 1 if name == "decode_1_process" else w)
        return {"config": name, "epoch_s": seconds, "epochs_s": [seconds], "one_off_s": None}
    if name.startswith("e_cache_"):
        return cached(name.removeprefix("e_cache_"), folder, tmp, w, b, device, epochs,
                      compute_s)
    make = {
        "a_0_workers": lambda: feed(CPUNormalised(folder), 0, b, device, False),
        "b_workers": lambda: feed(CPUNormalised(folder), w, b, device, False),
        "c_workers_uint8": lambda: feed(folder, w, b, device, True),
        "c_plain_dataloader": lambda: PlainFeed(folder, w, b),
        "d_memmap": lambda: feed(MemmapDataset("train", str(tmp / "packed")), w, b, device,
                                 True),
        "f_shards": lambda: feed(ShardStream("train", str(tmp / "shards"), size=spec["size"]),
                                 w, b, device, True)}[name]
    return measure(name, make, epochs, compute_s)


def in_subprocess(name: str, tmp: Path, spec: Dict[str, Any]) -> Dict[str, Any]:
    out = run_child([sys.executable, __file__, "--child", name, "--root", str(tmp),
                     "--spec", json.dumps(spec)], f"the {name} run", timeout=1800)
    return json.loads(out.strip().splitlines()[-1])


def prepare(tmp: Path, spec: Dict[str, Any], count: int, image_size: int) -> Dict[str, float]:
    """The files, the packed arrays and the shards; returns what each one-off step took."""
    start = time.perf_counter()
    write_images(tmp / "images", count, image_size, classes=10, val_fraction=0.0)
    print(f"wrote {count} JPEG files of {image_size}x{image_size} in "
          f"{time.perf_counter() - start:.1f}s")
    folder = ImageFolder("train", str(tmp / "images"), size=spec["size"])
    start = time.perf_counter()
    cache.write_arrays(folder, tmp / "packed" / "train", num_workers=spec["workers"])
    pack_s = time.perf_counter() - start
    start = time.perf_counter()
    write_shards(folder, tmp / "shards" / "train", samples_per_shard=250,
                 num_workers=spec["workers"])
    return {"d_memmap": pack_s, "f_shards": time.perf_counter() - start}


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=at_least(20), default=2000, help="JPEG files to write")
    p.add_argument("--image-size", type=at_least(1), default=256,
                   help="pixels per side of the files")
    p.add_argument("--size", type=at_least(1), default=224,
                   help="the crop the samples are cut to")
    p.add_argument("--batch", type=at_least(1), default=64)
    p.add_argument("--workers", type=at_least(1), default=2)
    p.add_argument("--compute-ms", type=number_at_least(0), default=5.0,
                   help="per step, standing for the GPU")
    p.add_argument("--epochs", type=at_least(2), default=3, help="epochs per configuration (>= 2)")
    p.add_argument("--repeats", type=at_least(1), default=3,
                   help="fresh processes per configuration, in alternating order")
    p.add_argument("--out", type=Path, default=default_out("bench_images"))
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, a.root, json.loads(a.spec))))
        return {}
    check_out(p, a.out)
    spec = {"workers": a.workers, "batch": a.batch, "epochs": a.epochs,
            "compute_s": a.compute_ms / 1000, "size": a.size}
    runs: Dict[str, List[Dict[str, Any]]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory(prefix="stoker-images-") as tmp:
        tmp = Path(tmp)
        one_off = prepare(tmp, spec, a.count, a.image_size)
        for rep in range(a.repeats):
            for name in (CONFIGS if rep % 2 == 0 else CONFIGS[::-1]):
                runs[name].append(in_subprocess(name, tmp, spec))
    result = summarise(a, spec, runs, one_off)
    report(result)
    return publish(a.out, result)


def summarise(a: argparse.Namespace, spec: Dict[str, Any],
              runs: Dict[str, List[Dict[str, Any]]], one_off: Dict[str, float]) -> Dict[str, Any]:
    """The result: a row per configuration (medians over its runs) and (c)'s ratios to the
    bounds, over the medians and paired within each repeat."""
    w, b = a.workers, a.batch
    rows = []
    for name in CONFIGS:
        times = [r["epoch_s"] for r in runs[name]]
        fills = [r["one_off_s"] for r in runs[name] if r.get("one_off_s") is not None]
        label = {"b_workers": f"b_{w}_workers", "c_workers_uint8": f"c_{w}_workers_uint8",
                 "decode_W_processes": f"decode_{w}_processes"}
        rows.append({"config": label.get(name, name),
                     "epoch_s": median(times), "epochs_s": [r["epochs_s"] for r in runs[name]],
                     "runs": len(times), "batch_pool": runs[name][0].get("batch_pool"),
                     "one_off_s": one_off.get(name) or (
                         median(fills) if fills else None)})
    by = {name: row for name, row in zip(CONFIGS, rows)}
    compute = spec["compute_s"] * -(-a.count // b)
    decode_one, decode_w = by["decode_1_process"]["epoch_s"], by["decode_W_processes"]["epoch_s"]
    bound, machine_bound = max(compute, decode_one / w), max(compute, decode_w)
    for r in rows:
        r.update(samples_per_s=a.count / r["epoch_s"], vs_bound=r["epoch_s"] / bound,
                 vs_machine=r["epoch_s"] / machine_bound,
                 vs_b=by["b_workers"]["epoch_s"] / r["epoch_s"])
    on_cpu = None if torch.cuda.is_available() else transform_ms(a.size, b)
    c = by["c_workers_uint8"]
    # (c) over each bound as measured in the same repeat (one alternation round apart at
    # most): the machine's drifts, tens of seconds long, fall on both
    paired = [(run["epoch_s"], max(compute, one["epoch_s"] / w), max(compute, both["epoch_s"]))
              for run, one, both in zip(runs["c_workers_uint8"], runs["decode_1_process"],
                                        runs["decode_W_processes"])]
    return {"machine": machine(), "count": a.count, "image_size": a.image_size,
            "device_transform_cpu_ms_per_batch": on_cpu, "repeats": a.repeats,
            "size": a.size, "batch": b, "workers": w, "compute_ms": a.compute_ms,
            "compute_s_per_epoch": compute, "decode_s_per_epoch": decode_one, "bound_s": bound,
            "decode_parallel_s_per_epoch": decode_w, "decode_scaling": decode_one / decode_w,
            "machine_bound_s": machine_bound,
            "targets": {"c_vs_bound_max": 1.15, "d_vs_b_min": 5.0},
            "c_vs_bound": c["vs_bound"], "c_vs_machine_bound": c["vs_machine"],
            "c_vs_bound_paired": median([e / bnd for e, bnd, _ in paired]),
            "c_vs_machine_bound_paired": median([e / m for e, _, m in paired]),
            "c_vs_plain_dataloader": c["epoch_s"] / by["c_plain_dataloader"]["epoch_s"],
            "d_vs_b": by["d_memmap"]["vs_b"], "results": rows}


def report(r: Dict[str, Any]) -> None:
    """The table and the lines that read it against the bounds."""
    w, decode_one = r["workers"], r["decode_s_per_epoch"]
    decode_w = r["decode_parallel_s_per_epoch"]
    print(table(r["results"], COLUMNS))
    print(f"decode cost {decode_one:.2f} s per epoch in one process; bound max(compute "
          f"{r['compute_s_per_epoch']:.2f} s, decode / {w} workers {decode_one / w:.2f} s) = "
          f"{r['bound_s']:.2f} s")
    print(f"{w} processes decode the set in {decode_w:.2f} s ({decode_one / decode_w:.2f}x one "
          f"process): machine bound max(compute, that) = {r['machine_bound_s']:.2f} s")
    on_cpu = r["device_transform_cpu_ms_per_batch"]
    if on_cpu is not None:
        print(f"no GPU: the device-side uint8 conversion of (c)-(f) is left to the fixed wait "
              f"that stands for the device (on this CPU it takes {on_cpu:.1f} ms a batch)")
    print(f"(c) vs bound {r['c_vs_bound']:.2f} (target <= 1.15), vs the machine's bound "
          f"{r['c_vs_machine_bound']:.2f}; paired within each repeat (median): "
          f"{r['c_vs_bound_paired']:.2f} and {r['c_vs_machine_bound_paired']:.2f}; (d) vs (b) "
          f"{r['d_vs_b']:.1f}x (target >= 5)")


def cached(mode: str, folder: ImageFolder, tmp: Path, w: int, b: int, device: torch.device,
           epochs: int, compute_s: float) -> Dict[str, Any]:
    """data.cache=`mode` over the folder: the time to fill it (memory, shm, disk: made before
    the first epoch; lru: during it) and the second epoch."""
    start = time.perf_counter()
    if mode == "shm":
        cache.SHM_ROOT = tmp / "shm" if not Path("/dev/shm").is_dir() else cache.SHM_ROOT
    # a cache of this process's own: every run fills it anew (the one-off cost measured)
    ds = cache.cache_dataset(folder, mode, tag=f"bench-images-{tmp.name}-{os.getpid()}",
                             num_workers=w, cache_dir=str(tmp / f"disk-{os.getpid()}"),
                             cache_mb=4096)
    fill_s = time.perf_counter() - start
    row = measure(f"e_cache_{mode}", lambda: feed(ds, w, b, device, True), epochs,
                  compute_s, second=True, one_off_s=fill_s if mode != "lru" else None)
    if mode in ("shm", "disk"):
        shutil.rmtree(Path(ds.x.path).parents[1], ignore_errors=True)
    return row


if __name__ == "__main__":
    run_main(main)

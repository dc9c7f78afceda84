"""GPU efficiency: throughput, data-wait, prefetcher copy bandwidth, peak memory and MFU.

    python scripts/bench_gpu.py                      # on a CUDA machine: the full benchmark
    python scripts/bench_gpu.py --smoke              # tiny sizes; runs on CPU too (no claims)
    python scripts/bench_gpu.py --peak-tflops 989    # name the GPU's dense bf16 peak yourself

Training (train.py in a fresh process per run, configurations alternating over repeats):
- the reference CNN on synthetic uint8 images (made once into data.cache=memory, batched by
  loader workers into pinned memory, normalised and made channels_last on the GPU by the
  prefetcher), bf16 and fp16, with the side-stream prefetcher and without it;
- a transformer language model on synthetic tokens (8 layers, 1024 wide, 32 x 1024 tokens a
  step: about 25 TFLOP, so the GPU, not the host's kernel launches, bounds the step), bf16 and
  fp16, with its model FLOPs utilisation: tokens/s x training FLOPs per token / the GPU's peak
  dense bf16/fp16 FLOPs.
Samples/s and data-wait are medians over the logging windows after the first: `data_wait_frac`
the training thread's time getting batches, `device_wait_frac` the GPU's idle time across
those fetches (CUDA events, trainer/devicewait.py: a host ahead of its queued steps waits at
no cost to the GPU). fp16 needs CUDA and is listed as skipped without it.

The CNN's feed alone: the same pipeline feeding one linear layer instead of the CNN (rows
`feed`), with and without the prefetcher: what the pipeline delivers on that machine. A CNN
whose samples/s is close to it is bound by its feed, whatever the prefetcher does.

Copy bandwidth: the same pinned uint8 batches copied host-to-device by the prefetcher (side
stream) and by a plain `tensor.to(device, non_blocking=True)` loop, and from pageable memory
for reference, in GB/s and microseconds per batch (`plain_us`, `prefetcher_us`). Large
batches are bound by the copy; the 64 KB row (a tiny step's batch is 16 KB) by each loop's
host work per batch, which is what a host-bound step pays for the prefetcher. Needs CUDA.

Targets: data-wait under 1% on the CNN with the prefetcher; prefetcher bandwidth at least 90%
of the plain pinned copy.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchlib import (UINT8_CNN, at_least, check_out, default_out, machine,  # noqa: E402
                      measure, median, medians, number_at_least, publish, run_main, table,
                      write_partial)

TRAIN_COLUMNS = ["model", "precision", "prefetch", "samples_per_s", "tokens_per_s",
                 "data_wait_frac", "device_wait_frac", "peak_mem_mb", "mfu", "skipped"]
COPY_COLUMNS = ["batch_mb", "batches", "plain_pinned_gbps", "prefetcher_gbps",
                "prefetcher_vs_plain", "plain_us", "prefetcher_us", "pageable_gbps", "skipped"]
# dense bf16/fp16 tensor-core peaks (TFLOPS), by a substring of the device name
PEAK_TFLOPS = {"H200": 989.0, "H100 SXM": 989.0, "H100 80GB HBM3": 989.0, "H100 NVL": 835.0,
               "H100 PCIe": 756.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "L4": 121.0}
TARGETS = {"data_wait_frac_max": 0.01, "prefetcher_vs_plain_min": 0.90}

# The CNN's data-wait must say whether the pipeline (workers, pinned memory, the side-stream
# copy) hides the data, not whether the CPU can make synthetic samples (~155 us of CPU each):
# on an H100 the 64-128-256 CNN waited 32-47% with 8 workers, the 128-256-512 one 9-14% with
# 12 (2026-11-22/23). So the samples are made once into data.cache=memory, and 12 workers
# batch them from there through the host path (data.placement=host: pinned batches copied
# to the GPU by the prefetcher, or on the compute stream without it).
# The transformer must be bound by the GPU for its MFU to say anything about the GPU: the
# 6-layer, 512-wide one of 32 x 256 tokens (1 TFLOP a step, 2-3 ms of an H100's GEMMs) ran
# about a thousand dispatched operations a step and took 15-19 ms, its tokens/s following the
# host's speed (551k and 429k on two days, MFU 7.0% and 5.5%).
FULL = dict(steps=200, log_every=20, repeats=3, workers=12, samples=16384,
            cnn=dict(batch=256, image=64, channels="[128,256,512]"),
            lm=dict(batch=32, tokens=1024, dim=1024, layers=8, heads=16, vocab=8192,
                    steps=100, log_every=10),
            copy_mb=[0.0625, 4.0, 64.0], copies=50, copy_total_mb=256)
SMOKE = dict(steps=4, log_every=2, repeats=1, workers=0, samples=64,
             cnn=dict(batch=8, image=16, channels="[8,16]"),
             lm=dict(batch=4, tokens=16, dim=32, layers=1, heads=2, vocab=64, steps=4,
                     log_every=2),
             copy_mb=[0.25], copies=3, copy_total_mb=0)


def cnn_overrides(s: Dict[str, Any]) -> List[str]:
    c = s["cnn"]
    return [*UINT8_CNN, f"data.input_shape=[3,{c['image']},{c['image']}]",
            f"model.channels={c['channels']}", "data.channels_last=true",
            f"data.batch_size={c['batch']}", "data.cache=memory", "data.placement=host"]


def feed_overrides(s: Dict[str, Any]) -> List[str]:
    """The CNN's data pipeline, every setting the same, feeding a model that costs next to
    nothing (one linear layer): its samples/s is what the pipeline itself delivers, the
    ceiling the CNN's rate is read against (a CNN close to it waits on its feed)."""
    return [("model=mlp" if o == "model=cnn" else o) for o in cnn_overrides(s)
            if not o.startswith("model.channels=")] + ["model.hidden=[]"]


def lm_overrides(s: Dict[str, Any]) -> List[str]:
    m = s["lm"]
    return ["experiment=tokens_transformer", f"data.input_shape=[{m['tokens']}]",
            f"data.num_classes={m['vocab']}", f"model.dim={m['dim']}",
            f"model.layers={m['layers']}", f"model.heads={m['heads']}",
            f"data.batch_size={m['batch']}"]


def common(s: Dict[str, Any], model: str) -> List[str]:
    """Settings every run shares; the transformer takes fewer, longer steps of its own."""
    steps = s["lm"] if model == "transformer" else s
    return [f"data.dataset.num_samples={s['samples']}", f"data.num_workers={s['workers']}",
            f"trainer.max_steps={steps['steps']}",
            f"trainer.log_every_n_steps={steps['log_every']}",
            "trainer.max_epochs=1000", "trainer.limit_val_batches=1", "sched=constant",
            "trainer.save_checkpoint=false"]


def lm_flops_per_token(s: Dict[str, Any]) -> float:
    from trainer.models import Transformer

    m = s["lm"]
    return Transformer([m["tokens"]], m["vocab"], dim=m["dim"], layers=m["layers"],
                       heads=m["heads"]).flops_per_token()


def peak_flops(name: Optional[str], given: Optional[float]) -> Optional[float]:
    if given:
        return given * 1e12
    for key, tflops in PEAK_TFLOPS.items():
        if name and key in name:
            return tflops * 1e12
    return None


def configurations(s: Dict[str, Any]) -> List[Dict[str, Any]]:
    out = []
    for precision in ("bf16", "fp16"):
        for prefetch in (True, False):
            out.append(dict(model="cnn", precision=precision, prefetch=prefetch,
                            overrides=cnn_overrides(s)))
        out.append(dict(model="transformer", precision=precision, prefetch=True,
                        overrides=lm_overrides(s)))
    for prefetch in (True, False):  # the pipeline's own rate, with and without the side stream
        out.append(dict(model="feed", precision="bf16", prefetch=prefetch,
                        overrides=feed_overrides(s)))
    return out


def train_rows(s: Dict[str, Any], cuda: bool, peak: Optional[float],
               report: Optional[Callable[[List[Dict[str, Any]]], None]] = None
               ) -> List[Dict[str, Any]]:
    """Every configuration's row; `report` gets the rows so far after each repeat (a run
    cut off by a time limit keeps the repeats that finished)."""
    configs = configurations(s)
    runs: List[List[Dict[str, Any]]] = [[] for _ in configs]
    with tempfile.TemporaryDirectory(prefix="stoker-gpu-") as tmp:
        for rep in range(s["repeats"]):
            for i, c in enumerate(configs):
                if c["precision"] == "fp16" and not cuda:
                    continue
                runs[i].append(measure([*c["overrides"], *common(s, c["model"]),
                                        f"trainer.precision={c['precision']}",
                                        f"data.device_prefetch={str(c['prefetch']).lower()}"],
                                       Path(tmp) / f"{i}-{rep}"))
            if report is not None and rep < s["repeats"] - 1:
                report(summarize(s, configs, runs, cuda, peak))
    return summarize(s, configs, runs, cuda, peak)


def summarize(s: Dict[str, Any], configs: List[Dict[str, Any]],
              runs: List[List[Dict[str, Any]]], cuda: bool,
              peak: Optional[float]) -> List[Dict[str, Any]]:
    """One row per configuration: medians over its runs, tokens/s and MFU for the transformer."""
    rows, fpt = [], lm_flops_per_token(s)
    for c, got in zip(configs, runs):
        row: Dict[str, Any] = {k: c[k] for k in ("model", "precision", "prefetch")}
        row.update(runs=len(got), all=got)
        if not got:
            row["skipped"] = "fp16 needs CUDA" if c["precision"] == "fp16" and not cuda \
                else "not run"
            rows.append(row)
            continue
        row.update(medians(got))
        if c["model"] == "transformer":
            row["tokens_per_s"] = row["samples_per_s"] * s["lm"]["tokens"]
            row["flops_per_token"] = fpt
            row["mfu"] = row["tokens_per_s"] * fpt / peak if peak and cuda else None
        rows.append(row)
    return rows


class _CopyOnly:
    """A prefetcher transform that leaves batches as copied (uint8 stays uint8)."""
    augment = None

    def __call__(self, batch, key=None):
        return batch


def copy_seconds(batches, device, prefetcher: bool) -> float:
    """Seconds moving `batches` (CPU tensors) to `device`, timed to the end of the last copy."""
    import torch

    from data.prefetch import DevicePrefetcher

    torch.cuda.synchronize(device)
    start = time.perf_counter()
    if prefetcher:  # the copy alone: no uint8 -> float conversion on the side stream
        for _ in DevicePrefetcher(batches, device, transform=_CopyOnly(), enabled=True):
            pass
    else:
        for (x,) in batches:
            x.to(device, non_blocking=True)
    torch.cuda.synchronize(device)
    return time.perf_counter() - start


def copy_rows(s: Dict[str, Any], cuda: bool, repeats: int) -> List[Dict[str, Any]]:
    if not cuda:
        return [{"batch_mb": mb, "skipped": "needs CUDA"} for mb in s["copy_mb"]]
    import torch

    device = torch.device("cuda", 0)
    rows = []
    for mb in s["copy_mb"]:
        n = int(mb * 2**20)
        count = max(s["copies"], int(s.get("copy_total_mb", 0) / mb))  # small ones: many
        pinned = [(torch.randint(255, (n,), dtype=torch.uint8).pin_memory(),)
                  for _ in range(count)]
        pageable = [(b[0].clone(),) for b in pinned]
        # warm-up, one whole pass each: the copy engines, and the caching allocator's blocks,
        # of which the prefetcher holds up to `count` at once (record_stream keeps each until
        # the compute stream passes it) where the plain loop reuses one
        copy_seconds(pinned, device, False)
        copy_seconds(pinned, device, True)
        copy_seconds(pageable, device, False)
        got: Dict[str, List[float]] = {"plain": [], "prefetcher": [], "pageable": []}
        for _ in range(repeats):  # alternating
            got["plain"].append(copy_seconds(pinned, device, False))
            got["prefetcher"].append(copy_seconds(pinned, device, True))
            got["pageable"].append(copy_seconds(pageable, device, False))
        gbps = {k: n * count / median(v) / 1e9 for k, v in got.items()}
        rows.append({"batch_mb": mb, "batches": count, "plain_pinned_gbps": gbps["plain"],
                     "prefetcher_gbps": gbps["prefetcher"],
                     "prefetcher_vs_plain": gbps["prefetcher"] / gbps["plain"],
                     "plain_us": 1e6 * median(got["plain"]) / count,
                     "prefetcher_us": 1e6 * median(got["prefetcher"]) / count,
                     "pageable_gbps": gbps["pageable"], "all_s": got})
        del pinned, pageable
    return rows


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, for tests (CPU is fine)")
    p.add_argument("--repeats", type=at_least(1), help="override the repeats")
    p.add_argument("--peak-tflops", type=number_at_least(0, strict=True),
                   help="the GPU's dense bf16/fp16 peak")
    p.add_argument("--out", type=Path, default=default_out("bench_gpu"))
    a = p.parse_args(argv)
    check_out(p, a.out)
    import torch

    s = dict(SMOKE if a.smoke else FULL)
    if a.repeats:
        s["repeats"] = a.repeats
    cuda = torch.cuda.is_available()
    if not cuda and not a.smoke:
        p.error("no CUDA device: the full GPU benchmark needs one "
                "(--smoke runs the same code paths at toy sizes on CPU)")
    info = machine()
    peak = peak_flops(info.get("gpu"), a.peak_tflops)
    base = {"machine": info, "device": "cuda" if cuda else "cpu", "smoke": a.smoke,
            "settings": s, "peak_flops": peak, "targets": TARGETS}

    def partial(rows: List[Dict[str, Any]]) -> None:  # the rows so far, if a limit cuts in
        write_partial(a.out, dict(base, training=rows, copy=[]))

    rows = train_rows(s, cuda, peak, report=partial)
    partial(rows)
    copies = copy_rows(s, cuda, s["repeats"])
    print(table(rows, TRAIN_COLUMNS))
    print()
    print(table(copies, COPY_COLUMNS))
    result = dict(base, training=rows, copy=copies)
    return publish(a.out, result)


if __name__ == "__main__":
    run_main(main)

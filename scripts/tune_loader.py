"""Find the loader settings that feed the configured dataset fastest on this machine.

    python scripts/tune_loader.py                          # the default data config
    python scripts/tune_loader.py data=heavy --workers 0 1 2 4 --prefetch 2 4
    python scripts/tune_loader.py data=memmap data.dataset.root=data_cache/heavy

Composes the data config as train.py does (overrides last), then for every
num_workers x prefetch_factor (x pin_memory on CUDA) builds the rank's loader exactly as
training would and measures how many samples per second it delivers, the first batch (worker
start-up) excluded. Prints the table and the best setting as the override line to paste.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

import trainer.config  # noqa: E402,F401  (registers the schema)
from benchlib import (at_least, check_out, default_out, machine, publish,  # noqa: E402
                      run_main, table)
from data.loader import LoaderStalled, build_loader  # noqa: E402
from data.workerdeath import LoaderWorkerDied, worker_died  # noqa: E402
from data.prefetch import DevicePrefetcher  # noqa: E402
from trainer.checks import resolve  # noqa: E402
from trainer.cli import USER_ERRORS, fail, import_from_cwd  # noqa: E402
from trainer.components import build_callable  # noqa: E402
from trainer.config import ConfigError  # noqa: E402
from trainer.feeds import build_datasets, collate_for  # noqa: E402
from trainer.overrides import override_key  # noqa: E402
from trainer.task import batch_size  # noqa: E402

COLUMNS = ["num_workers", "prefetch_factor", "pin_memory", "samples_per_s", "first_batch_s"]


def throughput(dataset, data_cfg, device: torch.device, batches: int) -> Dict[str, float]:
    """Samples/s over up to `batches` batches after the first, and the first batch's wait."""
    collate = collate_for(dataset, build_callable(data_cfg.collate_fn, "data.collate_fn"))
    feed = DevicePrefetcher(build_loader(dataset, data_cfg, train=True, device=device,
                                         collate_fn=collate), device)  # as train.py's
    it = iter(feed)
    start = time.perf_counter()
    first_batch = next(it)
    first = time.perf_counter() - start
    start, samples, timed = time.perf_counter(), 0, 0
    for _, batch in zip(range(batches), it):
        samples += batch_size(batch)  # any batch: (inputs, target), a dict, a dataclass...
        timed += 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    if samples == 0 and batch_size(first_batch) == 0:
        raise ConfigError("data: no sample was read in the batches timed (every file "
                          "unreadable? the warnings above name them)")
    if timed == 0:  # (a rate of 0 samples/s would be recommended as the best)
        raise ConfigError(f"data.batch_size={data_cfg.batch_size}: an epoch of the "
                          f"{len(dataset)} samples is one batch, and the first batch (the "
                          "workers' start) is not timed; use a smaller data.batch_size")
    return {"samples_per_s": samples / elapsed if samples else 0.0, "first_batch_s": first}


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    """The command line; a wrong setting is one line and exit 2."""
    import_from_cwd()  # the user's own modules, as train.py finds them
    try:
        return tune(argv)
    except USER_ERRORS as e:
        fail(e)
    except (LoaderStalled, LoaderWorkerDied) as e:  # the loader's own faults: exit 1
        fail(e, code=1)
    except RuntimeError as e:  # a worker's death, met wherever the timing thread was
        died = worker_died(e)
        if died is None:
            raise
        fail(died, code=1)


def overrides_first(argv: List[str], parser: argparse.ArgumentParser) -> List[str]:
    """`argv` with the config overrides (`key=value`, `+key=...`, `~key`) moved to the front,
    so that a list option (`--workers 0 1 2`) does not take the overrides after it as its
    values, as it did when `scripts/tune_loader.py --workers N M` was pasted from the advice
    and the overrides added after. A value of an option that takes one (`--out a=b.json`)
    stays where it is."""
    one_value = {s for action in parser._actions if action.option_strings
                 and action.nargs is None and action.const is None
                 for s in action.option_strings}
    overrides, rest = [], []
    for i, token in enumerate(argv):
        override = not token.startswith("-") and ("=" in token or token.startswith("~"))
        (overrides if override and (i == 0 or argv[i - 1] not in one_value) else rest).append(
            token)
    return overrides + rest


FEW_BATCHES = 10  # fewer timed batches a setting than this: the result is said to be rough
WORKERS_PER_CPU = 8  # loader workers worth timing per usable CPU (waiting on reads, say)


def tune(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cpus = len(os.sched_getaffinity(0))
    p.add_argument("--workers", type=at_least(0), nargs="+",
                   default=sorted({0, 1, 2, 4, 8, cpus} & set(range(0, 2 * cpus + 1))))
    p.add_argument("--prefetch", type=at_least(1), nargs="+", default=[2, 4])
    p.add_argument("--batches", type=at_least(1), default=20, help="batches timed per setting")
    p.add_argument("--out", type=Path, default=default_out("tune_loader"))
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. data=heavy")
    # options before, between or after the overrides
    a = p.parse_intermixed_args(overrides_first(sys.argv[1:] if argv is None else argv, p))
    check_out(p, a.out)
    most = max(WORKERS_PER_CPU * cpus, 32)
    if max(a.workers) > most:  # each a process with its own copy of the dataset object
        p.error(f"argument --workers: {max(a.workers)}: at most {most} ({WORKERS_PER_CPU} "
                f"per usable CPU, {cpus} here), more only wait for the CPUs")
    swept = {"data.num_workers": "--workers", "data.prefetch_factor": "--prefetch",
             "data.pin_memory": "(both, on CUDA)"}
    for override in a.overrides:
        key = override_key(override)
        if key in swept:
            p.error(f"{override}: tune_loader sweeps {key} itself; give {swept[key]} instead")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=["run_dir=unused", *a.overrides])
    resolve(cfg)  # the checks train.py makes (a batch size of 0, data=custom with no dataset)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dataset = build_datasets(cfg)[0]
    pins = [False, True] if device.type == "cuda" else [False]
    rows = []
    with warnings.catch_warnings():
        # (more workers than CPUs is a setting it times on purpose: those waiting on reads)
        warnings.filterwarnings("ignore", message="This DataLoader will create",
                                category=UserWarning)
        for workers in a.workers:
            for prefetch in (a.prefetch if workers else a.prefetch[:1]):  # (none: no workers)
                for pin in pins:
                    data_cfg = cfg.data.copy()
                    data_cfg.num_workers, data_cfg.prefetch_factor = workers, prefetch
                    data_cfg.pin_memory, data_cfg.persistent_workers = pin, False
                    rows.append({"num_workers": workers,  # (a dash: nothing prefetches)
                                 "prefetch_factor": prefetch if workers else None,
                                 "pin_memory": pin,
                                 **throughput(dataset, data_cfg, device, a.batches)})
    print(table(rows, COLUMNS))
    best = max(rows, key=lambda r: r["samples_per_s"])
    line = (f"data.num_workers={best['num_workers']}"  # (prefetching needs workers)
            + (f" data.prefetch_factor={best['prefetch_factor']}" if best["num_workers"] else "")
            + (f" data.pin_memory={str(best['pin_memory']).lower()}" if len(pins) > 1 else ""))
    print(f"best: {best['samples_per_s']:.0f} samples/s with\n  {line}")
    if a.batches < FEW_BATCHES:  # (a shared machine's bursts decide between close rows)
        print(f"({a.batches} batches a setting: a rough reading; --batches {FEW_BATCHES * 2} or "
              "more for a steadier one)")
    result = {"machine": machine(), "device": str(device), "overrides": a.overrides,
              "batches": a.batches, "results": rows, "best": best, "best_overrides": line}
    return publish(a.out, result)


if __name__ == "__main__":
    run_main(main)

"""Helpers shared by the benchmark scripts: argument types, the --out check, atomic JSON,
tables, the machine description, train.py runs, and the scripts' entry point (child
processes that end with the script: scripts/processes.py).

A script's entry is `run_main(main)`: a Ctrl-C, a SIGTERM, a child's failure or an OS error
(a full disk) is one line on stderr and an exit code (130, 143, the child's, 1), never a
traceback; what --out held before stays as it was.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, NoReturn, Optional, Sequence

from processes import ChildFailed, Stopped, run_child, sigterm_raises

ROOT = Path(__file__).resolve().parents[1]
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C


def at_least(low: int):
    """An argparse type: an integer >= `low` (a count of repeats, steps, workers...), so that
    a 0 or a negative one is a usage error, not a ZeroDivisionError later."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value}: must be >= {low}")
        return value
    return parse


def number_at_least(low: float, strict: bool = False):
    """An argparse type: a finite number >= `low` (> `low` when `strict`): a time or a rate,
    where a negative one (or 0 for a rate) would be measured as if it meant something."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"{value:g}: must be {'>' if strict else '>='} "
                                             f"{low:g}")
        return value
    return parse


def prog() -> str:
    """The script's name as argparse says it in its errors."""
    return os.path.basename(sys.argv[0])


def die(message: str, code: int = 1) -> NoReturn:
    """One line on stderr, `<script>: error: message`, and exit `code`."""
    print(f"{prog()}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def _cannot_write_in(folder: Path) -> Optional[str]:
    """Why no file can be made in the existing `folder` (None when one can): a probe file that
    has no name and is gone when closed, so read-only filesystems, permissions and full
    inode tables all answer for themselves (os.access is always yes for root)."""
    try:
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        return e.strerror or str(e)
    return None


def unwritable(path: Path) -> Optional[str]:
    """Why a file cannot be written at `path` (None when it can), said before a run so that a
    long benchmark does not end in an error it could have named at its start. Folders that do
    not exist yet are fine where the nearest existing one is writable (they are made at the
    end); nothing is left behind."""
    path = Path(path)
    if path.is_dir():
        return "is a directory; give the path of a file"
    folder = path.absolute().parent
    while not os.path.exists(folder):
        folder = folder.parent
    if not folder.is_dir():
        return f"{folder} is a file, not a folder"
    why = _cannot_write_in(folder)
    if why:
        return f"cannot write in {folder} ({why})"
    if path.exists() and not os.access(path, os.W_OK):
        return "is read-only"
    return None


def check_out(parser: argparse.ArgumentParser, path: Optional[Path], flag: str = "--out") -> None:
    """Refuses (usage error, exit 2) an output path that could not be written."""
    why = unwritable(path) if path is not None else None
    if why:
        parser.error(f"{flag} {path}: {why}")


def partial_path(path: Path) -> Path:
    """Where a run's results so far go while it runs: next to `path`, `<name>.partial<.ext>`
    (so bench_gpu_h100.json's is bench_gpu_h100.partial.json); the finished file replaces
    neither until it is complete."""
    path = Path(path)
    return path.with_name(f"{path.stem}.partial{path.suffix}")


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary path in `path`'s folder to write to; on success it is renamed over `path`
    (atomic: `path` is either what it was or the complete new file), on failure removed."""
    path = Path(path).resolve()  # a link: its target is replaced, not the link
    if path.exists() and not path.is_file():  # /dev/null, a FIFO: written to, never replaced
        yield path
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=f".tmp{path.suffix}",
                                   dir=path.parent)
        os.close(fd)
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from None
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp's file is private; a result is not
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(e, OSError) and not e.filename:  # a full disk: name the file
            raise OSError(e.errno, e.strerror or str(e), str(path)) from None
        raise


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _umask()  # read once, at import, before any thread could race on it


_PARTIALS: List[Path] = []  # side files written by this process that still hold its results


def machine() -> Dict[str, Any]:
    """What the numbers were measured on."""
    import torch

    info = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
    return info


def table(rows: List[Dict[str, Any]], columns: Sequence[str]) -> str:
    """A plain-text table; floats get 3 significant decimals, missing cells a dash."""
    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}"
        return str(v)

    cells = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def command() -> str:
    """The command line that is running, as a user would type it from the repository root."""
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(ROOT)
    except ValueError:
        pass
    return " ".join(["python", str(script), *sys.argv[1:]])


def _dump(path: Path, payload: Dict[str, Any]) -> None:
    text = json.dumps({"command": command(), **payload}, indent=2) + "\n"
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json(path: Path, payload: Dict[str, Any]) -> None:
    """Writes `payload` with the command that produced it (unless it names one already),
    atomically (a temp file in the same folder renamed over `path`), then removes the side
    file of results so far (`partial_path`): the finished file stands for the run."""
    path = Path(path)
    _dump(path, payload)
    side = partial_path(path)
    with contextlib.suppress(FileNotFoundError):
        side.unlink()
    if side in _PARTIALS:
        _PARTIALS.remove(side)


def write_partial(path: Path, payload: Dict[str, Any]) -> Path:
    """Writes the results so far of a run whose output is `path`, marked `"partial": true`,
    to the side file `partial_path(path)`, atomically: a run cut off by a time limit or a
    Ctrl-C leaves them there and `path` as it was. Returns the side file."""
    side = partial_path(path)
    _dump(side, dict(payload, partial=True))
    if side not in _PARTIALS:
        _PARTIALS.append(side)
    return side


def default_out(name: str) -> Path:
    """Where a benchmark writes its JSON unless told (--out): outputs/benchmarks/ of the
    directory it runs from (git ignores outputs/ in the project), not the directory itself."""
    return Path("outputs") / "benchmarks" / f"{name}.json"


def publish(path: Path, result: Dict[str, Any]) -> Dict[str, Any]:
    """A benchmark's last step: writes `result` as JSON (write_json), says where, returns it."""
    write_json(path, result)
    print(f"wrote {path}")
    return result


def median(values: List[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def steady(run_dir: Path) -> Dict[str, Optional[float]]:
    """Median samples/s and data-wait share over a run's training windows (metrics.jsonl),
    leaving out the first window, which holds start-up work (worker start, compilation,
    cuDNN autotuning) when there is more than one; on CUDA also the share the GPU stood idle
    for data (`device_wait_frac`, trainer/devicewait.py; None elsewhere)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["split"] == "train"]
    rows = rows[1:] if len(rows) > 1 else rows
    return {"samples_per_s": median([r["samples_per_s"] for r in rows]),
            "data_wait_frac": median([r["data_wait_frac"] for r in rows]),
            "device_wait_frac": median([r["device_wait_frac"] for r in rows
                                        if "device_wait_frac" in r])}


# the reference CNN on compact uint8 images, normalised on the device by the prefetcher
UINT8_CNN = ["data=synthetic", "model=cnn", "data.dataset.dtype=uint8",
             "data.normalize_mean=[0.5,0.5,0.5]", "data.normalize_std=[0.25,0.25,0.25]"]
MEASURED = ("samples_per_s", "data_wait_frac", "device_wait_frac", "peak_mem_mb")


def measure(args: List[str], run_dir: Path) -> Dict[str, Optional[float]]:
    """One train.py run: its steady samples/s and data-wait, and its peak memory."""
    summary = run_train(args, run_dir)
    return {**steady(run_dir), "peak_mem_mb": summary["peak_mem_mb"]}


def medians(runs: List[Dict[str, Any]]) -> Dict[str, Optional[float]]:
    """The median of each MEASURED value over repeats of one configuration."""
    return {key: median([r[key] for r in runs if r.get(key) is not None]) for key in MEASURED}


def run_train(args: List[str], run_dir: Path, nproc: int = 1,
              timeout: float = 600) -> Dict[str, Any]:
    """Runs train.py (under torchrun when nproc > 1) and returns its summary.json.

    Raises ChildFailed when the run fails (run_main says its `stoker: error:` line).
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "STOKER_"))}
    cmd = [sys.executable]
    if nproc > 1:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += [str(ROOT / "train.py"), f"hydra.run.dir={run_dir}", "trainer.progress_bar=false",
            *args]
    run_child(cmd, f"train.py ({' '.join(args)})", timeout=timeout, env=env)
    return json.loads((run_dir / "summary.json").read_text())


def _left() -> str:
    """What an interrupted run leaves: its results so far, if it wrote any."""
    if not _PARTIALS:
        return ""
    return (f"; the results so far are in {', '.join(map(str, _PARTIALS))} "
            "(the output file was not written)")


def run_main(main: Callable[[], Any]) -> None:
    """A script's entry point: runs `main()`, a SIGTERM raising Stopped where the script is.
    A Ctrl-C (exit 130), a SIGTERM (143), a child's failure (its own one-line error, or its
    last lines, and its exit code) and an OS error such as a full disk (exit 1) are said on
    stderr without a traceback; STOKER_TRACEBACK=1 keeps the traceback."""
    _PARTIALS.clear()  # (one run a process; a test runs several)
    try:
        with sigterm_raises():
            main()
    except (KeyboardInterrupt, Stopped, ChildFailed, OSError) as e:
        if os.environ.get("STOKER_TRACEBACK") == "1":
            raise
        raise SystemExit(_say(e)) from None


def _say(e: BaseException) -> int:
    """One line on stderr for what ended the script (run_main); returns the exit code."""
    code, tail = 1, []
    if isinstance(e, KeyboardInterrupt):
        line, code = f"{prog()}: interrupted (Ctrl-C){_left()}", EXIT_INTERRUPTED
    elif isinstance(e, Stopped):
        line, code = f"{prog()}: stopped by {e}{_left()}", e.code
    elif isinstance(e, ChildFailed):
        line, code = e.line(), e.exit_code()
        if line is None:  # not a mistake it could say in a line: its last lines, for a report
            line = f"{prog()}: error: {e.summary()}"
            tail = [f"  {ln}" for ln in e.last_lines(25)]
    else:  # OSError
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        line = f"{prog()}: error: {where}{getattr(e, 'strerror', None) or e}{_left()}"
    print("\n".join([line, *tail]), file=sys.stderr, flush=True)
    return code

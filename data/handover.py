"""A watch on the handover of a batch from a loader worker.

`data.timeout` bounds the DataLoader's wait for a worker's message, not what follows it: a
tensor in shared memory is received by asking the worker's own sharing thread for its file
descriptor (torch's `rebuild_storage_fd`), and that exchange waits for ever on a worker that
is stopped (SIGSTOP, a debugger) or that holds the GIL in stuck C code, with no timeout and
no signal that ends it (the run hung, silent). One daemon thread looks once a second at the
threads reading batches; one found in the same exchange for longer than its loader's timeout
has its loaders' workers killed, so the read fails at once, and `data.loader.readable` says
it as the stall it is.

The same look catches a worker's death whose word was lost. PyTorch says a worker died by
raising from its SIGCHLD handler in the training thread; where the signal comes while that
thread runs code whose errors Python can only print (an at-fork hook, as another loader starts
its workers; a `__del__`), it prints "Exception ignored", forgets the loader's workers (a
signal again finds none ended), and the read waits until data.timeout (300 s) before it looks
at the workers itself. A worker of the loader being read that has ended and is still not said
a poll later has the training thread raise PyTorch's words for it (once): an asynchronous
exception, woken by a SIGCHLD. Where it lands in the wait, PyTorch takes it for a look at the
workers and raises its own "exited unexpectedly"; `data.workerdeath` says how from the exit
status. The printed error ("Exception ignored in: <function _releaseLock>", a traceback) is
left out: the watch says it, in one line, when that loader is read.
"""
from __future__ import annotations

import ctypes
import itertools
import signal
import sys
import threading
import time
import weakref
from typing import Any, Callable, Dict, Optional, Sequence, Set, Tuple

from data.workerdeath import _WORKER_ENDED, _exit_status, iterators_of

POLL_S = 1.0
HANDOVER = ("rebuild_storage_fd", "reductions.py")  # torch.multiprocessing: the exchange
WAITING = ("_get_data", "dataloader.py")  # torch.utils.data: the wait for a worker's message

_lock = threading.Lock()
# token: (thread id, weak references to the holders, timeout)
_watched: Dict[int, Tuple[int, Sequence[Any], float]] = {}
_stalled: set = set()  # tokens whose workers were killed for a stall
_tokens = itertools.count(1)
_watcher: Optional[threading.Thread] = None
_printer: Optional[Callable[[Any], Any]] = None  # the unraisable hook before `_unprinted`


def timeout_of(*holders: Any) -> float:
    """The DataLoader timeout of the first iterator among `holders` or the ones they keep
    (0: none, wait for ever)."""
    for it in iterators_of(holders):
        t = getattr(it, "_timeout", None)
        if isinstance(t, (int, float)):
            return float(t)
    return 0.0


def watch(holders: Sequence[Any], timeout: float) -> int:
    """Watches the calling thread's batch handovers from the workers of `holders` (DataLoader
    iterators, or loaders that keep one), against `timeout` (0: none, deaths alone); a
    token for `stalled` and `unwatch`."""
    global _watcher, _printer
    token = next(_tokens)
    refs = []
    for holder in holders:  # weakly: a loader's iterator must still go (its workers with it)
        try:                # when its reader drops it, watched or not
            refs.append(weakref.ref(holder))
        except TypeError:
            pass
    with _lock:
        _watched[token] = (threading.get_ident(), tuple(refs), timeout)
        if _printer is None:  # (once: a hook set later, by the user, stays)
            _printer, sys.unraisablehook = sys.unraisablehook, _unprinted
        if _watcher is None or not _watcher.is_alive():
            _watcher = threading.Thread(target=_watch, name="stoker-handover-watch",
                                        daemon=True)
            _watcher.start()
    return token


def _unprinted(unraisable: Any) -> None:
    """`sys.unraisablehook`: PyTorch's error for a worker's death, raised where Python can
    only print it, is left for the watch to say; the rest is printed as before."""
    if not (isinstance(unraisable.exc_value, RuntimeError) and
            _WORKER_ENDED.match(str(unraisable.exc_value))):
        _printer(unraisable)  # type: ignore[misc]


def unwatch(token: Optional[int]) -> None:
    with _lock:
        _watched.pop(token, None)
        _stalled.discard(token)


def stalled(token: Optional[int]) -> Optional[float]:
    """The timeout that ran out, where `token`'s workers were killed for a stalled handover."""
    with _lock:
        if token in _stalled and token in _watched:
            return _watched[token][2]
    return None


def _watch() -> None:
    since: Dict[int, Tuple[int, float]] = {}  # thread id: (its handover frame's id, first seen)
    ended: Set[int] = set()  # pids of workers seen ended at the last look
    told: Set[int] = set()  # ... and whose signal was delivered again
    from data.loader import kill_workers

    last = time.monotonic()
    while True:
        time.sleep(POLL_S)
        now, slept = time.monotonic(), time.monotonic() - last
        last = now
        with _lock:
            watched = dict(_watched)
        threads = {ident for ident, _, _ in watched.values()}
        for thread in set(since) - threads:  # (an id seen before must not count later)
            del since[thread]
        if slept > 5 * POLL_S:  # suspended (Ctrl-Z, a scheduler's suspend): its own time
            since.clear()       # counts for no handover
        if not watched:
            ended.clear()
            continue
        ended = _unsaid_deaths(watched, ended, told)
        for thread, frame_id in _frames(threads, *HANDOVER).items():
            if frame_id is None:
                since.pop(thread, None)
                continue
            first = since.setdefault(thread, (frame_id, now))
            if first[0] != frame_id:  # another handover since the last look
                since[thread] = first = (frame_id, now)
            for token, (ident, holders, timeout) in watched.items():
                if ident == thread and 0 < timeout < now - first[1]:
                    with _lock:
                        _stalled.add(token)
                    # (the exchange then fails: its peer is gone)
                    kill_workers(*(h for h in (ref() for ref in holders) if h is not None))
        del watched  # (no reference to a holder kept through the sleep)


def _frames(threads: Set[int], name: str, file: str) -> Dict[int, Optional[int]]:
    """For each of `threads`, the id of the frame of function `name` of a file named `file`
    on its stack (None: none). Ids alone: a frame kept by this thread through its sleep would
    keep its locals, a loader's iterator among them, from going when their reader drops them
    (and with them its workers, which Python's exit then waits for, for ever)."""
    frames = sys._current_frames()
    found = {}
    for thread in threads:
        frame = frames.get(thread)
        while frame is not None and not (frame.f_code.co_name == name and
                                         frame.f_code.co_filename.endswith(file)):
            frame = frame.f_back
        found[thread] = None if frame is None else id(frame)
    return found


def _unsaid_deaths(watched: Dict[int, Tuple[int, Sequence[Any], float]], ended: Set[int],
                   told: Set[int]) -> Set[int]:
    """Has the main thread raise PyTorch's words for a worker's death where it waits for a
    worker's message from a loader whose worker had already ended at the last look (`ended`,
    whose signal PyTorch's handler would have said at once): its word was lost (see the
    module doc). Each pid once (`told`); the pids of the watched loaders' ended workers now."""
    main = threading.main_thread().ident
    if not any(ident == main for ident, _, _ in watched.values()):
        return set()  # (PyTorch's handler raises in the main thread alone)
    now: Set[int] = set()
    for ident, holders, _ in watched.values():
        if ident != main:
            continue
        for it in iterators_of([h for h in (ref() for ref in holders) if h is not None]):
            if not getattr(it, "_worker_pids_set", False):  # (shut down, or said already)
                continue
            for worker in getattr(it, "_workers", None) or ():
                # (ended as PyTorch's handler counts a failure: killed, or a non-zero exit; a
                # worker of an IterableDataset that ran out exits 0 and waits to be reaped)
                if worker.pid is not None and _exit_status(worker.pid) != (None, None):
                    now.add(worker.pid)
    waiting = _frames({main}, *WAITING)[main] is not None
    told.intersection_update(now)  # (a pid used again later is another worker)
    lost = (now & ended) - told
    if lost and waiting:
        told.update(lost)
        _raise_in(main, lost)
    return now


def _raise_in(main: int, pids: Set[int]) -> None:
    """Raises PyTorch's error for workers `pids` ended in thread `main` (the main thread, which
    PyTorch's handler keeps woken by SIGCHLD): at its next bytecode, as the handler begins."""
    if not callable(signal.getsignal(signal.SIGCHLD)):
        return  # (nothing would wake a blocked wait: the error would land later, anywhere)
    words = f"DataLoader worker (pid(s) {', '.join(map(str, sorted(pids)))}) exited unexpectedly"

    class WorkerEnded(RuntimeError):  # (raised by its class alone: no arguments given)
        def __init__(self, *args: Any) -> None:
            super().__init__(*(args or (words,)))

    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(main),
                                               ctypes.py_object(WorkerEnded))
    signal.pthread_kill(main, signal.SIGCHLD)


"""A watch on the handover of a batch from a loader worker.

`data.timeout` bounds the DataLoader's wait for a worker's message, not what follows it: a
tensor in shared memory is received by asking the worker's own sharing thread for its file
descriptor (torch's `rebuild_storage_fd`), and that exchange waits for ever on a worker that
is stopped (SIGSTOP, a debugger) or that holds the GIL in stuck C code, with no timeout and
no signal that ends it (the run hung, silent). One daemon thread looks once a second at the
threads reading batches; one found in the same exchange for longer than its loader's timeout
has its loaders' workers killed, so the read fails at once, and `data.loader.readable` says
it as the stall it is.
"""
from __future__ import annotations

import itertools
import sys
import threading
import time
import weakref
from typing import Any, Dict, Optional, Sequence, Set, Tuple

POLL_S = 1.0
HANDOVER = "rebuild_storage_fd"  # torch.multiprocessing.reductions

_lock = threading.Lock()
# token: (thread id, weak references to the holders, timeout)
_watched: Dict[int, Tuple[int, Sequence[Any], float]] = {}
_stalled: set = set()  # tokens whose workers were killed for a stall
_tokens = itertools.count(1)
_watcher: Optional[threading.Thread] = None


def timeout_of(*holders: Any) -> float:
    """The DataLoader timeout of the first iterator among `holders` or the ones they keep
    (0: none, wait for ever)."""
    for holder in holders:
        for it in (holder, getattr(holder, "_iterator", None), getattr(holder, "_batches", None)):
            t = getattr(it, "_timeout", None)
            if isinstance(t, (int, float)):
                return float(t)
    return 0.0


def watch(holders: Sequence[Any], timeout: float) -> Optional[int]:
    """Watches the calling thread's batch handovers from the workers of `holders` (DataLoader
    iterators, or loaders that keep one); a token for `stalled` and `unwatch`, None where
    there is no timeout to keep."""
    global _watcher
    if timeout <= 0:
        return None
    token = next(_tokens)
    refs = []
    for holder in holders:  # weakly: a loader's iterator must still go (its workers with it)
        try:                # when its reader drops it, watched or not
            refs.append(weakref.ref(holder))
        except TypeError:
            pass
    with _lock:
        _watched[token] = (threading.get_ident(), tuple(refs), timeout)
        if _watcher is None or not _watcher.is_alive():
            _watcher = threading.Thread(target=_watch, name="stoker-handover-watch",
                                        daemon=True)
            _watcher.start()
    return token


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
            continue
        for thread, frame_id in _handovers(threads).items():
            if frame_id is None:
                since.pop(thread, None)
                continue
            first = since.setdefault(thread, (frame_id, now))
            if first[0] != frame_id:  # another handover since the last look
                since[thread] = first = (frame_id, now)
            for token, (ident, holders, timeout) in watched.items():
                if ident == thread and now - first[1] > timeout:
                    with _lock:
                        _stalled.add(token)
                    # (the exchange then fails: its peer is gone)
                    kill_workers(*(h for h in (ref() for ref in holders) if h is not None))
        del watched  # (no reference to a holder kept through the sleep)


def _handovers(threads: Set[int]) -> Dict[int, Optional[int]]:
    """For each of `threads`, the id of the handover frame on its stack (None: none). Ids
    alone: a frame kept by this thread through its sleep would keep its locals, a loader's
    iterator among them, from going when their reader drops them (and with them its workers,
    which Python's exit then waits for, for ever)."""
    frames = sys._current_frames()
    found = {}
    for thread in threads:
        frame = frames.get(thread)
        while frame is not None and frame.f_code.co_name != HANDOVER:
            frame = frame.f_back
        found[thread] = None if frame is None else id(frame)
    return found

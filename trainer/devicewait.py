"""How long the GPU stood idle waiting for data: the device's side of the data-wait figure.

The loop times each `next(batches)` on the host (`data_wait_frac`: the share of step time the
training thread spent getting batches). On CUDA that is not the GPU's time. Kernels are
queued: while the host fetches a batch the GPU may still be running the steps queued before,
so a host ahead of its GPU waits for data at no cost, while a host behind it leaves the GPU
idle for every microsecond of the fetch. `DeviceWait` measures the GPU's side with two CUDA
events on the compute stream per micro-batch, one recorded just before the fetch and one just
after it (after the prefetcher's wait for the batch's copy). On the GPU the first completes
when the work queued before it has run, the second when, besides, the host has queued past
the fetch and the batch's copy is done: the time between them is time the compute stream
had nothing to run but waited for the batch (a fetch the host was still making, or a copy
not yet finished). Its share of the window's wall time is `device_wait_frac`. Where the
compute stream itself works on the data inside the fetch (the copy without the prefetcher,
indexing device-resident data, the on-device transform then), that work counts too: time
the GPU spent on the data instead of the step.

The events are made once (as many as the longest logging window's micro-batches, at most
`MAX_PAIRS`) and recorded again every window; they are read once per window, after the
boundary's synchronize, so a micro-batch costs two event records and no host sync. A window
longer than `MAX_PAIRS` fetches (a large `trainer.log_every_n_steps`) sums the pairs the GPU
has finished as it goes, without waiting for any.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

MAX_PAIRS = 512  # event pairs kept; beyond them the finished ones are summed and reused


class DeviceWait:
    """Sums, per logging window, the compute stream's idle time across each batch fetch."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.current_stream(device)
        self.pairs: List[Tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.used = 0  # pairs recorded in this window and not yet summed
        self.summed_ms = 0.0  # the window's pairs summed early (a window over MAX_PAIRS)

    def begin_epoch(self) -> None:
        """Looks the compute stream up again (once an epoch, not per batch)."""
        self.stream = torch.cuda.current_stream(self.device)

    def before(self) -> None:
        """Just before the loop asks for a batch."""
        if self.used >= MAX_PAIRS:
            self._sum_finished()
        if self.used == len(self.pairs):  # the first window this long: one more pair, kept
            self.pairs.append((torch.cuda.Event(enable_timing=True),
                               torch.cuda.Event(enable_timing=True)))
        self.pairs[self.used][0].record(self.stream)

    def after(self) -> None:
        """Just after the batch was handed over (its copy waited for on the compute stream)."""
        self.pairs[self.used][1].record(self.stream)
        self.used += 1

    def _sum_finished(self) -> None:
        """Adds up the oldest pairs whose events the GPU has reached (no wait) and moves them
        behind the others, free to record again."""
        done = 0
        while done < self.used and self.pairs[done][1].query():
            done += 1
        self.summed_ms += sum(start.elapsed_time(end) for start, end in self.pairs[:done])
        self.pairs[:self.used] = self.pairs[done:self.used] + self.pairs[:done]
        self.used -= done

    def take_s(self) -> float:
        """Seconds the compute stream waited over the fetches since the last call. Every
        event recorded must have completed (the caller synchronized the device)."""
        waited = self.summed_ms + sum(start.elapsed_time(end)
                                      for start, end in self.pairs[:self.used])
        self.used, self.summed_ms = 0, 0.0
        return waited / 1000.0  # elapsed_time is in milliseconds


def for_device(device: torch.device) -> Optional[DeviceWait]:
    """A `DeviceWait` on CUDA; None elsewhere, where a step runs as the host calls it and the
    host's wait is the device's."""
    return DeviceWait(device) if device.type == "cuda" else None

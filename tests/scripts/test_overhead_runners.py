"""scripts/overhead_runners.py: the hand-written runners compute as the trainer does, so that
bench_overhead's ratios measure the loop (that every runner takes the same steps is tested
end to end in tests/scripts/test_bench_overhead.py)."""
from __future__ import annotations

import sys

from tests.helpers import ROOT

sys.path.insert(0, str(ROOT / "scripts"))  # as the scripts run: beside them


def test_the_hand_written_runners_compute_as_the_trainer_does_on_cuda(monkeypatch):
    """On CUDA train.py turns on TF32 and cuDNN autotuning by default; a plain runner that did
    not would make its ratios measure other kernels, not the loop."""
    import overhead_runners
    import torch

    from trainer.speed import backend_flags

    def flags():
        return (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32,
                torch.backends.cudnn.benchmark)

    before = flags()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    try:
        backend_flags(False, False, False)
        overhead_runners._trainers_math()
        plain = flags()
        backend_flags(False, False, False)
        backend_flags(True, True, False)  # the defaults: trainer.tf32, trainer.cudnn_benchmark
        assert plain == flags() == ("high", True, True)
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = before[1:]

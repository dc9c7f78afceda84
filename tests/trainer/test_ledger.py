"""The ledger: window loss sums and the non-finite guard from recorded micro-batches."""
from __future__ import annotations

import math

import pytest
import torch

from trainer.ledger import Ledger, counted, window_factor

CPU = torch.device("cpu")
NAN, INF = float("nan"), float("inf")


def test_window_factor_makes_every_counted_unit_weigh_the_same():
    cpu = torch.device("cpu")
    # micro-batches contributed mean x count / base, base = batch 16 x 3 micro-batches
    assert window_factor(48, 48, world=1, device=cpu) is None  # full window: nothing to do
    assert window_factor(40, 48, world=1, device=cpu) == pytest.approx(48 / 40)  # 16, 16, 8
    # device counts (valid tokens): 3 + 300 tokens, so each token weighs 1 / 303
    factor = window_factor(torch.tensor(3) + torch.tensor(300), 32, world=1, device=cpu)
    assert float(factor) == pytest.approx(32 / 303)
    assert float(window_factor(torch.tensor(0), 32, world=1, device=cpu)) == 32  # all padding


def test_counted_weighs_a_batch_of_padding_zero_even_when_its_mean_is_nan():
    nan = torch.tensor(float("nan"))
    assert float(counted(nan, torch.tensor(0))) == 0.0 and float(counted(nan, 0)) == 0.0
    assert float(counted(torch.tensor(2.0), torch.tensor(3))) == 6.0
    assert torch.isnan(counted(nan, torch.tensor(3)))  # a real NaN still reaches the guard


def record(ledger, steps):
    """`steps`: per optimizer step, its micro-batches as (mean loss, count)."""
    for micro in steps:
        for loss, count in micro:
            ledger.add(torch.tensor(loss), count)
        ledger.end_step()


def test_loss_sum_weighs_each_micro_batch_by_its_count():
    ledger = Ledger(CPU)
    record(ledger, [[(1.0, 4), (2.0, 2)], [(3.0, 4)]])
    assert float(ledger.take_loss_sum()) == 1 * 4 + 2 * 2 + 3 * 4
    assert float(ledger.take_loss_sum()) == 0  # a new window
    record(ledger, [[(2.0, torch.tensor(5)), (NAN, torch.tensor(0))]])  # tokens, all padding
    assert float(ledger.take_loss_sum()) == 10 and int(ledger.bad_run) == 0


@pytest.mark.parametrize("steps,before,after", [
    ([[(1.0, 2)], [(NAN, 2)], [(INF, 2)]], 0, 2),       # the run since the last finite step
    ([[(NAN, 2)], [(NAN, 2)]], 3, 5),                     # no finite step: it goes on
    ([[(NAN, 2)], [(1.0, 2)]], 7, 0),                     # a finite step ends it
    ([[(1.0, 2), (NAN, 2)], [(1.0, 2), (1.0, 2)]], 0, 0),  # accumulation: per step
    ([[(1.0, 2), (NAN, 2)]], 0, 1),
])
def test_bad_run_counts_trailing_non_finite_steps(steps, before, after):
    ledger = Ledger(CPU)
    ledger.bad_run = before
    record(ledger, steps)
    ledger.fold()
    assert int(ledger.bad_run) == after
    ledger.fold()  # nothing recorded since: unchanged
    assert int(ledger.bad_run) == after


def test_the_latest_step_with_an_empty_batch_and_a_nan_loss_is_kept_as_steps_ago():
    """A micro-batch of count 0 weighs 0, NaN or not (padding alone); one whose loss was
    not finite, after a step whose loss was, is remembered by how many steps ago it was (its
    gradients may be NaN). One after a non-finite step is not: the weights were NaN already,
    and every empty batch's loss is NaN then."""
    ledger = Ledger(CPU)
    record(ledger, [[(1.0, 2)], [(1.0, 2), (NAN, 0)], [(1.0, 2)], [(1.0, 2)]])
    ledger.fold()
    assert ledger.empty_nan_ago == 2 and ledger.bad_run == 0
    record(ledger, [[(1.0, 2)], [(NAN, 2)]])
    ledger.fold()
    assert ledger.empty_nan_ago == 4 and ledger.bad_run == 1
    record(ledger, [[(NAN, 0)], [(2.0, 0)]])  # (after a NaN step; a finite count-0 loss is
    ledger.fold()                             # padding alone)
    assert ledger.empty_nan_ago == 6
    record(ledger, [[(1.0, 2)], [(NAN, 2)], [(NAN, 0)], [(NAN, 2)]])  # (the same, in one fold)
    ledger.fold()
    assert ledger.empty_nan_ago == 10 and ledger.bad_run == 1
    record(ledger, [[(1.0, 2)], [(NAN, 0)], [(NAN, 2)]])
    ledger.fold()
    assert ledger.empty_nan_ago == 1 and ledger.bad_run == 1
    fresh = Ledger(CPU)
    record(fresh, [[(NAN, torch.tensor(0))], [(1.0, 2)]])  # (token counts: 0 of them, NaN)
    fresh.fold()
    assert fresh.empty_nan_ago == 1
    clean = Ledger(CPU)
    record(clean, [[(1.0, 2)], [(NAN, 2)]])
    clean.fold()
    assert clean.empty_nan_ago is None


def test_fold_without_a_completed_step_changes_nothing():
    ledger = Ledger(CPU)
    ledger.fold()
    assert int(ledger.bad_run) == 0 and float(ledger.loss_sum) == 0
    assert not math.isnan(float(ledger.take_loss_sum()))


def test_a_fold_inside_a_step_keeps_that_step_for_later():
    ledger = Ledger(CPU)
    record(ledger, [[(1.0, 2)]])
    ledger.add(torch.tensor(NAN), 2)  # the next step's first micro-batch
    ledger.fold()
    assert float(ledger.loss_sum) == 2 and int(ledger.bad_run) == 0
    ledger.add(torch.tensor(1.0), 2)
    ledger.end_step()
    ledger.fold()
    assert int(ledger.bad_run) == 1  # the NaN micro-batch counted in its own step


def test_long_windows_fold_as_they_go():
    from trainer.ledger import FOLD_AFTER

    ledger = Ledger(CPU)
    record(ledger, [[(1.0, 1)]] * (3 * FOLD_AFTER))
    assert len(ledger.losses) < FOLD_AFTER and len(ledger.stacked) == 3  # stacked, not folded
    assert all(type(counts) is list for _, counts in ledger.stacked)  # host ints stay there
    assert float(ledger.take_loss_sum()) == 3 * FOLD_AFTER and not ledger.stacked


def test_a_fold_reads_every_loss_and_count_in_one_copy(monkeypatch):
    """However many chunks a long window was compacted into, host counts and device counts
    mixed, a fold reads them to the host in one copy (each copy is a sync on a GPU)."""
    from trainer.ledger import FOLD_AFTER

    ledger = Ledger(CPU)
    record(ledger, [[(1.0, 1)]] * FOLD_AFTER + [[(2.0, torch.tensor(3))]] * (FOLD_AFTER + 5))
    assert len(ledger.stacked) == 2 and ledger.losses
    copies = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: copies.append(t) or tolist(t))
    assert ledger.take_loss_sum() == FOLD_AFTER + 6 * (FOLD_AFTER + 5)
    assert len(copies) == 1


def test_stacked_micro_batches_fold_like_separate_ones():
    """Compaction keeps each micro-batch's count (host ints and device token counts, padding
    included) and step, so the loss sum and the non-finite run come out the same."""
    from trainer.ledger import FOLD_AFTER

    body = [[(1.0, 2), (2.0, torch.tensor(3))], [(NAN, torch.tensor(0)), (4.0, 1)]]
    body = body * (FOLD_AFTER // 2 + 1)
    tail = body[:FOLD_AFTER // 2] + [[(NAN, 2)], [(1.0, 1), (INF, torch.tensor(5))]]
    long, short = Ledger(CPU), Ledger(CPU)
    for ledger, fold_every_step in ((long, False), (short, True)):
        for step in body:
            record(ledger, [step])
            if fold_every_step:
                ledger.fold()
    assert long.stacked  # the first FOLD_AFTER micro-batches were stacked
    assert long.take_loss_sum() == short.take_loss_sum() == (2 + 6 + 4) * len(body) // 2
    for ledger, fold_every_step in ((long, False), (short, True)):
        for step in tail:
            record(ledger, [step])
            if fold_every_step:
                ledger.fold()
    long.fold()
    assert long.bad_run == short.bad_run == 2
    assert isinstance(long.bad_run, int)  # a host number: the guard costs no device work


@pytest.mark.parametrize("mode,backend,copied", [
    ("default", "inductor", False), ("max-autotune-no-cudagraphs", "inductor", False),
    ("reduce-overhead", "inductor", True), ("max-autotune", "inductor", True),
    ("default", "cudagraphs", True)])
def test_a_loss_a_cuda_graph_replay_overwrites_is_kept_as_a_copy(mode, backend, copied):
    """A model compiled with CUDA graphs returns its loss (task=model_loss) in the graph's
    memory, which the next replay overwrites; the ledger keeps losses until the window's
    end, so it copies them then. Here the overwrite is an in-place write."""
    from trainer.config import CompileConfig
    from trainer.speed import cuda_graphs
    assert cuda_graphs(CompileConfig(enabled=True, mode=mode, backend=backend)) == copied
    assert not cuda_graphs(CompileConfig(enabled=False, mode=mode, backend=backend))
    ledger = Ledger(CPU, copy=copied)
    graph_output = torch.tensor(2.0)
    ledger.add(graph_output, 3)
    ledger.end_step()
    graph_output.fill_(100.0)  # the next replay
    ledger.add(graph_output, 3)
    ledger.end_step()
    assert float(ledger.take_loss_sum()) == (2 * 3 + 100 * 3 if copied else 100 * 3 * 2)


def test_a_later_negative_count_is_the_tasks_line_where_the_counts_are_read(make_cfg):
    """A count() that turned negative past the first batch (checked there) was taken: the
    run ended exit 0 with its gradients turned around (val_loss -0.0000, accuracy falling).
    The ledger reads the counts at its fold (a logging boundary or a save), no sync of its own."""
    from trainer.config import ConfigError
    from trainer.runner import train

    with pytest.raises(ConfigError, match=r"^task classification: CountGoesNegative\.count\("
                                          r"batch\) returned -5 for a training batch after the "
                                          r"first ones; expected the units"):
        train(make_cfg("task._target_=tests.helpers.CountGoesNegative",
                       "trainer.log_every_n_steps=5", "trainer.max_steps=20"))

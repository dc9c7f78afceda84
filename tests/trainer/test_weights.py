"""trainer/weights.py: a checkpoint's model checked before a resume; trainer.init_from: a new
run's model weights from a file (a checkpoint, a state dict in the
layouts other code saves, a .safetensors file), strict or not, and never over a resume."""
from __future__ import annotations

import logging
import os
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.helpers import final_weights, params_of, read_metrics, run_cli, tiny_gpt2
from trainer.checkpoint import CheckpointError
from trainer.weights import check_model_state, init_weights
from trainer.runner import train


def net(hidden: int = 8, classes: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, classes))


def trained(hidden: int = 8, classes: int = 3) -> nn.Module:
    """`net` with other weights than a new one's: what a file to start from holds."""
    model = net(hidden, classes)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    return model


def same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(params_of(a), params_of(b)))


@pytest.mark.parametrize("layout", ["plain", "state_dict", "model_state_dict", "model",
                                    "ddp", "compiled", "dataparallel_compiled", "lightning"])
def test_loads_the_layouts_other_code_saves(tmp_path, layout):
    source = trained()
    weights = source.state_dict()
    if layout in ("state_dict", "model_state_dict", "model"):
        weights = {layout: weights, "epoch": 3, "optimizer": {"state": {}}}
    elif layout == "ddp":  # a hand-written DDP loop's model.state_dict()
        weights = {f"module.{k}": v for k, v in weights.items()}
    elif layout == "compiled":  # torch.compile(model).state_dict()
        weights = torch.compile(source).state_dict()
    elif layout == "dataparallel_compiled":
        weights = torch.compile(nn.DataParallel(source)).state_dict()
    elif layout == "lightning":  # a LightningModule holding the net as self.model
        weights = {"state_dict": {f"model.{k}": v for k, v in weights.items()}, "epoch": 3}
    torch.save(weights, tmp_path / "w.pt")
    model = net()
    line = init_weights(model, str(tmp_path / "w.pt"), strict=True)
    assert same(model, source)
    assert "4 of 4 tensors" in line
    wrapped = {"ddp": "module.", "compiled": "_orig_mod.",
               "dataparallel_compiled": "_orig_mod.module.", "lightning": "model."}.get(layout)
    assert (f"without the keys' '{wrapped}' prefix" in line) == (wrapped is not None)


def test_a_lightning_file_loads_its_model_subtree_and_names_the_keys_left_out(tmp_path):
    """A LightningModule holding the net as self.model and its loss as self.criterion saves
    both: the net's keys fit (strictly), the loss's are left out and named; beside a wider
    teacher of the same names (distillation), the subtree that fits in shape is taken; a
    file where two subtrees fit alike (the net and an EMA copy) is refused, naming both."""
    source = trained()
    nested = {f"model.{k}": v for k, v in source.state_dict().items()}
    torch.save({"state_dict": {**nested, "criterion.pos_weight": torch.ones(3)}},
               tmp_path / "w.pt")
    model = net()
    line = init_weights(model, str(tmp_path / "w.pt"), strict=True)
    assert same(model, source)
    assert "4 of 4 tensors (read from its keys under 'model.'; left out: " \
        "criterion.pos_weight)" in line
    teacher = {f"teacher.{k}": v for k, v in net(hidden=16).state_dict().items()}
    torch.save({"state_dict": {**nested, **teacher}}, tmp_path / "distilled.pt")
    model = net()  # (the teacher's names are the net's, its shapes are not: the net's fit)
    assert "left out: teacher.0.bias" in init_weights(model, str(tmp_path / "distilled.pt"),
                                                      strict=True)
    assert same(model, source)
    ema = {f"ema.{k}": v for k, v in net().state_dict().items()}
    torch.save({"state_dict": {**nested, **ema}}, tmp_path / "two.pt")
    with pytest.raises(CheckpointError, match=r"the keys under 'ema.' and 'model.' each fit "
                                              r"this model, and which one is meant"):
        init_weights(net(), str(tmp_path / "two.pt"), strict=True)


def test_a_safetensors_file_is_told_by_its_bytes_not_its_name(tmp_path):
    pytest.importorskip("safetensors")
    from safetensors.torch import save_file

    source = trained()
    save_file(source.state_dict(), str(tmp_path / "w.pt"))
    model = net()
    assert "4 of 4 tensors" in init_weights(model, str(tmp_path / "w.pt"), strict=True)
    assert same(model, source)


def test_a_missing_file_or_a_dir_names_the_files_beside_or_in_it(tmp_path):
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    torch.save(trained().state_dict(), folder / "last.pt")
    with pytest.raises(CheckpointError) as e:
        init_weights(net(), str(folder / "best.pt"), strict=True)
    assert str(e.value) == (f"trainer.init_from={folder / 'best.pt'}: no such file; {folder} "
                            "holds last.pt (a run keeps best.pt only with "
                            "trainer.checkpoint.monitor)")
    with pytest.raises(CheckpointError, match=rf"a directory, not a file; it holds "
                                              rf"{folder / 'last.pt'} \(give"):
        init_weights(net(), str(tmp_path / "run"), strict=True)


def saved_gpt2(folder):
    """A tiny GPT-2 whose weights differ from a fresh one's, saved by save_pretrained into
    `folder` (its model.safetensors stores the tied lm_head.weight once)."""
    pytest.importorskip("safetensors")
    pytest.importorskip("transformers")
    source = tiny_gpt2()
    with torch.no_grad():
        for p in source.parameters():
            p.mul_(2.0)
    source.save_pretrained(folder)
    return source


def test_safetensors_and_a_hugging_face_file_with_tied_weights(tmp_path):
    source = saved_gpt2(tmp_path)
    model = tiny_gpt2()
    line = init_weights(model, str(tmp_path / "model.safetensors"), strict=True)
    assert same(model, source)
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    assert "lm_head.weight: tied to a loaded one" in line


def test_a_save_pretrained_folder_is_read_through_its_one_weights_file(tmp_path):
    """init_from=<a save_pretrained folder> was refused as a directory that "holds
    model.safetensors": its one weights file is what was meant. Two candidates stay refused."""
    source = saved_gpt2(tmp_path / "pre")
    model = tiny_gpt2()
    line = init_weights(model, str(tmp_path / "pre"), strict=True)
    assert same(model, source)
    assert line.startswith(f"model weights from {tmp_path / 'pre' / 'model.safetensors'}: ")
    torch.save(source.state_dict(), tmp_path / "pre" / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r": a directory, not a file; it holds "):
        init_weights(tiny_gpt2(), str(tmp_path / "pre"), strict=True)


def test_strict_refuses_a_misfit_naming_the_keys_and_leaves_the_model_as_it_was(tmp_path):
    torch.save(trained(hidden=8, classes=5).state_dict(), tmp_path / "w.pt")
    model, fresh = net(), net()
    with pytest.raises(CheckpointError) as e:
        init_weights(model, str(tmp_path / "w.pt"), strict=True)
    assert "does not fit this model" in str(e.value)
    assert ("shape mismatch: 2.bias (5 in the file, 3 in the model), 2.weight (5x8 in the "
            "file, 3x8 in the model)") in str(e.value)
    assert "trainer.init_strict=false" in str(e.value)
    assert same(model, fresh)


def test_weights_of_another_kind_of_number_or_layout_are_a_misfit(tmp_path):
    """Integers for floating weights were cast on load (the weights near 0: a first
    val_loss of ln(classes)) and said as all tensors loaded; a sparse tensor was
    load_state_dict's traceback. Half precision for float32 fits (cast), as before."""
    weights = trained().state_dict()
    cases = {"int": {k: v.to(torch.int64) for k, v in weights.items()},
             "sparse": {**weights, "0.weight": weights["0.weight"].to_sparse()},
             "half": {k: v.half() for k, v in weights.items()}}
    for name, state in cases.items():
        torch.save(state, tmp_path / f"{name}.pt")
    model, fresh = net(), net()
    with pytest.raises(CheckpointError, match=r"type mismatch: 0.bias \(int64 in the file, "
                                              r"float32 in the model\), 0.weight"):
        init_weights(model, str(tmp_path / "int.pt"), strict=True)
    with pytest.raises(CheckpointError, match=r"type mismatch: 0.weight \(sparse_coo float32 "
                                              r"in the file, float32 in the model\)"):
        init_weights(model, str(tmp_path / "sparse.pt"), strict=True)
    assert same(model, fresh)
    said = init_weights(model, str(tmp_path / "sparse.pt"), strict=False)
    assert "left as initialised: 0.weight" in said
    assert init_weights(net(), str(tmp_path / "half.pt"), strict=True).startswith(
        f"model weights from {tmp_path / 'half.pt'}: 4 of 4 tensors")


def test_not_strict_loads_what_fits_and_says_the_rest(tmp_path):
    source = trained(hidden=8, classes=5)  # a new head: 3 classes instead of 5
    weights = {**source.state_dict(), "extra.weight": torch.zeros(2)}
    del weights["0.bias"]
    torch.save(weights, tmp_path / "w.pt")
    model, fresh = net(), net()
    line = init_weights(model, str(tmp_path / "w.pt"), strict=False)
    assert torch.equal(model[0].weight, source[0].weight)
    for name in ("0.bias", "2.weight", "2.bias"):  # as a new model has them
        assert torch.equal(model.state_dict()[name], fresh.state_dict()[name])
    assert "1 of 4 tensors" in line
    assert "left as initialised: 0.bias, 2.bias, 2.weight" in line
    assert "the file's keys the model lacks: extra.weight" in line


def test_not_strict_still_refuses_a_file_none_of_whose_tensors_fits(tmp_path):
    torch.save({"other.weight": torch.zeros(3)}, tmp_path / "w.pt")
    with pytest.raises(CheckpointError, match="none of its 1 tensors fits this model"):
        init_weights(net(), str(tmp_path / "w.pt"), strict=False)


def test_mismatched_model_lists_the_mismatches(tmp_path):
    small, other = nn.Linear(4, 2), nn.Sequential(nn.Linear(4, 3))
    with pytest.raises(CheckpointError) as info:
        check_model_state(other, {"model": small.state_dict()}, tmp_path / "x.pt")
    msg = str(info.value)
    assert "missing: 0.bias, 0.weight" in msg and "unexpected: bias, weight" in msg
    with pytest.raises(CheckpointError, match=r"shape mismatch: bias \(2 in the file, 3 in the "
                                              r"model\), weight \(2x4 in the file, 3x4 in the "
                                              r"model\)"):  # (the file's shape, then the model's)
        check_model_state(nn.Linear(4, 3), {"model": small.state_dict()}, "x.pt")


class Pickled:
    pass


@pytest.mark.parametrize("content, said", [
    ("dir", "a directory, not a file (give a Stoker checkpoint"),
    ("missing", "no such file"),
    ("fifo", "not a regular file (a device, a pipe or a socket; give a Stoker checkpoint"),
    ("text", "not a file torch.save wrote nor a safetensors file"),
    ("dict", "holds no model weights (a dict of epoch, lr)"),
    ("list", "holds no model weights (a list)"),
    ("object", "refuses as code that could run; save the weights alone instead: "
               "torch.save(model.state_dict(), path)"),
    ("legacy_object", "refuses as code that could run; save the weights alone instead"),
    ("flipped", "damaged (checksum mismatch in "),
    ("truncated", "unreadable (BadZipFile"),
    ("safetensors", "a damaged safetensors file"),
    ("index", "the index of a sharded save (init_from reads one file); load such a model with "
              "model._target_=<class>.from_pretrained"),
])
def test_a_file_without_weights_is_one_line_naming_the_key(tmp_path, content, said):
    path = tmp_path / ("model.safetensors.index.json" if content == "index" else "w.pt")
    if content == "dir":
        path.mkdir()
    elif content == "fifo":  # (it said "no such file; <its folder> holds w.pt")
        os.mkfifo(path)
    elif content == "text":
        path.write_text("not weights\n")
    elif content == "index":
        path.write_text('{"metadata": {}, "weight_map": {}}')
    elif content in ("flipped", "truncated"):
        torch.save(trained().state_dict(), path)
        data = bytearray(path.read_bytes())
        if content == "flipped":  # a bit of the largest stored tensor
            with zipfile.ZipFile(path) as archive:
                record = max(archive.infolist(), key=lambda i: i.file_size)
            start = record.header_offset + 30 + len(record.filename) + len(record.extra)
            data[start + record.file_size // 2] ^= 0x10
        path.write_bytes(bytes(data) if content == "flipped" else bytes(data[:len(data) // 2]))
    elif content == "safetensors":
        from safetensors.torch import save_file

        save_file(trained().state_dict(), str(path))
        path.write_bytes(path.read_bytes()[:-8])  # its last tensor cut short
    elif content == "legacy_object":  # torch.save's format before torch 1.6
        torch.save({"w": Pickled()}, path, _use_new_zipfile_serialization=False)
    elif content != "missing":
        torch.save({"dict": {"epoch": 3, "lr": 0.1}, "list": [1, 2],
                    "object": {"w": Pickled()}}[content], path)
    with pytest.raises(CheckpointError) as e:
        init_weights(net(), str(path), strict=True)
    assert str(e.value).startswith("trainer.init_from") and said in str(e.value)
    assert "\n" not in str(e.value)


def test_a_run_starts_from_another_runs_weights_with_a_fresh_optimizer(make_cfg, tmp_path,
                                                                       caplog):
    first = train(make_cfg("trainer.max_epochs=1", run_dir=tmp_path / "first"))
    # lr 0: the weights stay those loaded, so the run's checkpoint shows what it started from
    with caplog.at_level(logging.INFO, logger="stoker"):
        second = train(make_cfg("trainer.max_steps=3", "optim.lr=0.0", "optim.weight_decay=0.0",
                                f"trainer.init_from={first['checkpoint']}",
                                run_dir=tmp_path / "second"))
    a, b = final_weights(first), final_weights(second)
    assert all(torch.equal(a[k], b[k]) for k in a)
    state = torch.load(second["checkpoint"], weights_only=True)
    assert state["step"] == 3 and state["epoch"] == 0  # the step count starts fresh
    steps = {int(s["step"]) for s in state["optimizer"]["state"].values()}
    assert steps == {3}  # AdamW's moments are this run's own
    assert f"model weights from {first['checkpoint']}: 6 of 6 tensors" in caplog.text
    assert read_metrics(tmp_path / "second")


def test_a_resumed_run_keeps_its_own_weights_and_does_not_read_the_file(make_cfg, tmp_path,
                                                                        caplog):
    source = tmp_path / "source.pt"
    torch.save(trained().state_dict(), source)  # does not fit: reading it would fail
    first = train(make_cfg("trainer.max_steps=2"))
    with caplog.at_level(logging.INFO, logger="stoker"):
        resumed = train(make_cfg("trainer.max_steps=4", "trainer.resume=auto",
                                 f"trainer.init_from={source}"))
    assert resumed["steps"] == 4
    line = [r for r in caplog.records if "not read" in r.getMessage()]
    assert len(line) == 1 and line[0].levelno == logging.WARNING  # it started from none
    assert line[0].getMessage() == (
        f"trainer.init_from={source} not read: resuming {tmp_path / 'run' / 'checkpoints'}"
        "/last.pt, whose run started from its own initialisation (no init_from); if that is "
        "not the run meant, name the right one's dir (run_dir)")  # (from Python)
    assert first["checkpoint"] == resumed["checkpoint"]


def test_a_file_that_does_not_fit_stops_the_run_before_it_writes(tmp_path):
    weights = tmp_path / "w.pt"
    torch.save(trained().state_dict(), weights)
    result = run_cli([f"hydra.run.dir={tmp_path / 'run'}", f"trainer.init_from={weights}",
                      "trainer.max_epochs=1"])
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"stoker: error: trainer.init_from={weights} does not fit this "
                           "model; missing: ")
    assert not (tmp_path / "run" / "train.log").exists()
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.gpu
def test_cpu_weights_go_into_a_channels_last_model_on_cuda(tmp_path):
    from trainer.models import SmallCNN as CNN

    torch.manual_seed(1)
    source = CNN(input_shape=[3, 16, 16], num_classes=4)
    torch.save(source.state_dict(), tmp_path / "w.pt")
    torch.manual_seed(2)
    model = CNN(input_shape=[3, 16, 16], num_classes=4).cuda().to(
        memory_format=torch.channels_last)
    init_weights(model, str(tmp_path / "w.pt"), strict=True)
    for (name, mine), theirs in zip(model.state_dict().items(), source.state_dict().values()):
        assert mine.is_cuda and torch.equal(mine.cpu(), theirs), name
        if mine.dim() == 4:  # (copied into the model's own layout)
            assert mine.is_contiguous(memory_format=torch.channels_last), name


def test_a_requeued_job_of_a_run_that_started_from_the_file_says_so_without_a_warning(
        make_cfg, tmp_path, caplog):
    first = train(make_cfg("trainer.max_steps=2", run_dir=tmp_path / "first"))
    source = first["checkpoint"]
    train(make_cfg("trainer.max_steps=2", f"trainer.init_from={source}"))
    spelled = str(source).replace("/first/", "/first/./")  # the same file, named otherwise
    with caplog.at_level(logging.INFO, logger="stoker"):
        train(make_cfg("trainer.max_steps=4", "trainer.resume=auto",
                       f"trainer.init_from={spelled}"))
    said = [r for r in caplog.records if "not read" in r.getMessage()]
    assert [(r.levelno, r.getMessage()) for r in said] == [
        (logging.INFO, f"trainer.init_from={spelled} not read: the resumed run's weights "
                       "continue it")]


def test_every_rank_trains_rank_0s_weights_whatever_each_read(tmp_path):
    """A file rewritten between the ranks' reads (here: a path per rank) still gives one
    model: rank 0's weights are broadcast after the load. The validation, over both ranks'
    shards, then matches a run where both read rank 0's file."""
    from tests.helpers import summary_of, torchrun

    first = trained_checkpoint(tmp_path)
    torch.save({k: torch.ones_like(v) for k, v in torch.load(
        first, weights_only=True)["model"].items()}, tmp_path / "1.pt")
    (tmp_path / "0.pt").write_bytes(first.read_bytes())
    args = ["trainer.max_steps=1", "optim.lr=0.0", "optim.weight_decay=0.0"]
    apart = torchrun(2, [f"hydra.run.dir={tmp_path / 'apart'}", *args,
                         "trainer.init_from=${oc.env:RANK}.pt"], cwd=tmp_path)
    alike = torchrun(2, [f"hydra.run.dir={tmp_path / 'alike'}", *args,
                         "trainer.init_from=0.pt"], cwd=tmp_path)
    assert apart.returncode == alike.returncode == 0, apart.stderr[-2000:] + alike.stderr[-2000:]
    a, b = summary_of(tmp_path / "apart"), summary_of(tmp_path / "alike")
    assert a["val_loss"] == b["val_loss"] and a["val_acc"] == b["val_acc"]


def trained_checkpoint(tmp_path):
    """A trained run's last.pt (one epoch of the default job, in this process)."""
    from tests.helpers import compose_cfg

    return Path(train(compose_cfg(tmp_path / "source", "trainer.max_epochs=1"))["checkpoint"])


def test_a_file_that_cannot_be_opened_is_one_line(tmp_path, monkeypatch):
    from trainer import weights

    torch.save(trained().state_dict(), tmp_path / "w.pt")

    def refused(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(weights, "_kind", refused)  # (root reads any file: as another user)
    with pytest.raises(CheckpointError, match=r"^trainer\.init_from=.*w\.pt: cannot be read "
                                              r"\(Permission denied\)$"):
        init_weights(net(), str(tmp_path / "w.pt"), strict=True)


def test_the_run_records_the_file_it_started_from_by_its_full_path(tmp_path, monkeypatch):
    from tests.helpers import compose_cfg

    source = trained_checkpoint(tmp_path)
    monkeypatch.chdir(source.parent)
    summary = train(compose_cfg(tmp_path / "run", "trainer.max_steps=2",
                                f"trainer.init_from={source.name}"))
    saved = torch.load(summary["checkpoint"], weights_only=True)["config"]["trainer"]
    assert saved["init_from"] == str(source.resolve())


def test_a_long_list_of_misfits_shows_its_first_five_and_how_many_more():
    from trainer.weights import mismatches, said_mismatches

    own = {f"layer{i}.weight": torch.zeros(2) for i in range(7)}
    theirs = {k: torch.zeros(3) for k in own}
    said = said_mismatches(mismatches(own, theirs), own, theirs)
    assert said == ("shape mismatch: " + ", ".join(
        f"layer{i}.weight (3 in the file, 2 in the model)" for i in range(5)) + " (+2 more)")

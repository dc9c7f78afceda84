"""resolve() checks what the schema cannot: ranges, keys that only work together, and what
needs the environment; each problem is one line naming the key."""
from __future__ import annotations

import pytest
import torch

from trainer.checks import _check_graphs_and_accumulation, monitor_mode, resolve
from trainer.config import ConfigError, Precision, Strategy


@pytest.mark.parametrize("override,fragment", [
    ("data.batch_size=0", "data.batch_size=0: must be >= 1"),
    ("data.eval_batch_size=0", "data.eval_batch_size=0"),
    ("data.num_workers=-1", "data.num_workers=-1: must be auto or an integer >= 0"),
    ("data.num_workers=abc", "data.num_workers=abc: must be auto or an integer >= 0"),
    ("data.placement=gpu", "data.placement=gpu: must be auto, host or device"),
    ("data.device_budget_mb=-1", "data.device_budget_mb=-1"),
    ("data.augment.crop_padding=-4", "data.augment.crop_padding=-4"),
    # checked before the checks that read it (a TypeError, or a crop_padding blamed)
    ("data.input_shape=8", "data.input_shape=8: must be null or a non-empty list of sizes"),
    ("data.input_shape=[1,a,8]", "data.input_shape=[1, 'a', 8]: must be null or a non-empty"),
    ("data.input_shape=[1,0,8]", "data.input_shape=[1, 0, 8]: must be null or a non-empty"),
    ("trainer.checkpoint.async_save=maybe", "trainer.checkpoint.async_save=maybe: must be auto"),
    ("data.prefetch_factor=0", "data.prefetch_factor=0"),
    ("trainer.accumulate_grad_batches=0", "trainer.accumulate_grad_batches=0: must be >= 1"),
    ("trainer.grad_clip=0", "trainer.grad_clip=0"),
    ("trainer.max_epochs=0", "trainer.max_epochs=0: must be -1 (no limit: trainer.max_steps "
                             "ends the run) or >= 1"),
    ("trainer.max_epochs=-1", "trainer.max_epochs=-1: needs trainer.max_steps >= 1: with "
                              "neither limit the run would not end"),
    ("trainer.max_steps=0", "trainer.max_steps=0"),
    ("trainer.log_every_n_steps=0", "trainer.log_every_n_steps=0"),
    ("trainer.limit_train_batches=0", "trainer.limit_train_batches=0: must be a number of "
                                      "batches >= 1, a share of the epoch's batches in (0, 1] "
                                      "(0.25: a quarter), or null (all)"),
    ("trainer.limit_train_batches=0.0", "trainer.limit_train_batches=0.0: must be a number of"),
    ("trainer.limit_train_batches=1.5", "trainer.limit_train_batches=1.5: must be a number of"),
    ("trainer.limit_train_batches=nan", "trainer.limit_train_batches=nan: must be a number of"),
    ("trainer.limit_train_batches=true", "trainer.limit_train_batches=true: must be a number"),
    ("trainer.limit_train_batches=all", "trainer.limit_train_batches=all: must be a number of"),
    ("trainer.limit_train_batches=[1]", "trainer.limit_train_batches=[1]: must be a number of"),
    ("trainer.limit_val_batches=-1", "trainer.limit_val_batches=-1: must be a number of "
                                     "batches >= 1, 0 (no validation), a share of the split's "
                                     "batches in (0, 1] (0.1: a tenth), or null (all)"),
    ("trainer.limit_val_batches=-0.5", "trainer.limit_val_batches=-0.5: must be a number of"),
    ("trainer.overfit_batches=-2", "trainer.overfit_batches=-2"),
    ("data.num_classes=1", "data.num_classes=1"),
    ("trainer.checkpoint.keep_last=0", "trainer.checkpoint.keep_last=0"),
    ("trainer.checkpoint.every_n_steps=-1", "trainer.checkpoint.every_n_steps=-1"),
    ("trainer.checkpoint.mode=up", "trainer.checkpoint.mode=up"),
    ("trainer.max_bad_steps=-1", "trainer.max_bad_steps=-1"),
    ("trainer.early_stopping.patience=-1", "trainer.early_stopping.patience=-1: must be >= 0"),
    ("trainer.early_stopping.min_delta=-0.1", "trainer.early_stopping.min_delta=-0.1: must be "
                                              "a finite number >= 0"),
    ("trainer.early_stopping.min_delta=0.1", "trainer.early_stopping.min_delta=0.1: is early "
                                             "stopping's, which is off"),
    ("trainer.early_stopping.patience=3", "trainer.early_stopping.patience=3: watches "
                                          "trainer.checkpoint.monitor, which is not set"),
    ("data.cache=tape", "data.cache=tape: must be none, memory, shm, disk or lru"),
    ("data.cache_mb=0", "data.cache_mb=0.0: must be > 0 MB"),
    ("data.cache_mb=inf", "data.cache_mb=inf: must be > 0 MB"),
    ("data.cache=disk data.cache_dir=", "data.cache_dir='': must name a folder for data.cache"),
    ("data.normalize_mean=0.5", "data.normalize_mean=0.5: must be null or a list of numbers"),
    ("data.multiprocessing_context=thread", "data.multiprocessing_context=thread"),
    ("data.timeout=-1", "data.timeout=-1"),
    # beyond a week the C types the timeouts reach overflow (a traceback before)
    ("data.timeout=inf", "data.timeout=inf: must be from 0 to 604800 seconds (a week; 0: wait"),
    ("data.timeout=1e12", "data.timeout=1000000000000.0: must be from 0 to 604800 seconds"),
    ("trainer.ddp.timeout_s=inf", "trainer.ddp.timeout_s=inf: must be > 0 and at most 604800"),
    # nan reached DDP's int() on every rank (a traceback each); a negative size passed
    ("trainer.ddp.bucket_cap_mb=nan", "trainer.ddp.bucket_cap_mb=nan: must be a size > 0 MB"),
    ("trainer.ddp.bucket_cap_mb=-5", "trainer.ddp.bucket_cap_mb=-5.0: must be a size > 0 MB"),
    ("trainer.ddp.bucket_cap_mb=inf", "trainer.ddp.bucket_cap_mb=inf: must be a size > 0 MB"),
    ("trainer.checkpoint.timeout_s=1e30", "trainer.checkpoint.timeout_s=1e+30: must be > 0 and"),
    ("seed=99999999999999999999", "seed=99999999999999999999: must be an integer that fits 64"),
    ("optim.lr=inf", "optim.lr=inf: must be a finite number"),
    ("trainer.checkpoint.mode=max", "trainer.checkpoint.mode=max: is the direction of "
                                    "trainer.checkpoint.monitor, which is not set"),
    ("trainer.precision=fp16", "trainer.precision=fp16: needs CUDA"),
    ("trainer.accelerator=cuda", "trainer.accelerator=cuda: CUDA is not available"),
    ("trainer.strategy=ddp", "trainer.strategy=ddp: needs a torchrun or SLURM launch"),
    ("trainer.strategy=dp", "trainer.strategy=dp: DataParallel needs CUDA"),
])
def test_semantic_checks_name_the_key(make_cfg, override, fragment):
    with pytest.raises(ConfigError) as info:
        resolve(make_cfg(*override.split(" ")))
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


def test_global_batch_is_per_rank_x_accumulation_x_world(make_cfg):
    cfg = make_cfg("data.batch_size=16", "trainer.accumulate_grad_batches=3")
    spec = resolve(cfg, world_size=4, launched=True)
    assert spec.global_batch == 16 * 3 * 4
    assert spec.strategy == Strategy.ddp
    assert resolve(cfg).strategy == Strategy.single


def test_strategy_conflicts_with_world_size(make_cfg):
    with pytest.raises(ConfigError, match="trainer.strategy=single"):
        resolve(make_cfg("trainer.strategy=single"), world_size=2, launched=True)


def test_enum_values(make_cfg):
    cfg = make_cfg("trainer.precision=bf16")
    assert cfg.trainer.precision == Precision.bf16
    assert resolve(cfg).precision == Precision.bf16


def test_dp_refuses_a_multi_rank_job(make_cfg):
    with pytest.raises(ConfigError, match="trainer.strategy=dp: DataParallel is one process"):
        resolve(make_cfg("trainer.strategy=dp"), world_size=2, launched=True)


def test_sync_batchnorm_needs_cuda(make_cfg):
    with pytest.raises(ConfigError, match="trainer.ddp.sync_batchnorm"):
        resolve(make_cfg("trainer.ddp.sync_batchnorm=true"), world_size=2, launched=True)


def test_static_graph_refuses_accumulation_under_ddp(make_cfg):
    cfg = make_cfg("trainer.ddp.static_graph=true", "trainer.accumulate_grad_batches=2")
    with pytest.raises(ConfigError, match="trainer.ddp.static_graph=true: cannot be combined"):
        resolve(cfg, world_size=2, launched=True)
    resolve(make_cfg("trainer.ddp.static_graph=true"), world_size=2, launched=True)


@pytest.mark.parametrize("override", ["+data.num_worker=8", "+trainer.max_epoch=3",
                                      "+trainer.checkpoint.every_n_step=5", "+sed=1"])
def test_adding_a_misspelt_schema_key_is_refused(make_cfg, override):
    key = override[1:].split("=")[0]
    with pytest.raises(ConfigError, match=rf"^{key}=.*not a key of .*valid keys: "):
        resolve(make_cfg(override))


def test_monitor_must_be_a_logged_key_with_a_fitting_mode(make_cfg):
    logged = {"val_loss": False, "val_acc": True, "val_score": None}
    assert monitor_mode(make_cfg(), logged) is None
    assert monitor_mode(make_cfg("trainer.checkpoint.monitor=val_acc"), logged) == "max"
    assert monitor_mode(make_cfg("trainer.checkpoint.monitor=val_loss"), logged) == "min"
    assert monitor_mode(make_cfg("trainer.checkpoint.monitor=val_score",
                                 "trainer.checkpoint.mode=min"), logged) == "min"
    for overrides, fragment in [
            (["trainer.checkpoint.monitor=loss"],
             "trainer.checkpoint.monitor=loss: must be null or a logged validation key: "
             "val_loss, val_acc, val_score"),
            (["trainer.checkpoint.monitor=val_accc"],
             "a logged validation key: val_loss, val_acc, val_score (did you mean val_acc?)"),
            # another case, the val_ left out (no hint for either before)
            (["trainer.checkpoint.monitor=val_ACC"], "val_score (did you mean val_acc?)"),
            (["trainer.checkpoint.monitor=score"], "val_score (did you mean val_score?)"),
            (["trainer.checkpoint.monitor=val_loss", "trainer.checkpoint.mode=max"],
             "trainer.checkpoint.mode=max: val_loss is better when lower; use min"),
            (["trainer.checkpoint.monitor=val_score"], "does not say which direction")]:
        with pytest.raises(ConfigError) as info:
            monitor_mode(make_cfg(*overrides), logged)
        assert fragment in str(info.value)


def test_fused_sgd_with_momentum_is_refused_under_fp16(make_cfg):
    """torch's fused SGD keeps the uninitialised momentum of a first step the GradScaler
    skipped; without momentum, or with bf16 (no scaler), it stands."""
    with pytest.raises(ConfigError, match=r"^optim\.fused=true: with SGD's momentum under fp16 "
                                          r"keeps the momentum of a first step"):
        resolve(make_cfg("optim=sgd", "optim.fused=true", "trainer.precision=fp16"))
    resolve(make_cfg("optim=sgd", "optim.fused=true", "trainer.precision=bf16"))
    with pytest.raises(ConfigError, match=r"^trainer\.precision=fp16: needs CUDA"):  # not SGD's
        resolve(make_cfg("optim=sgd", "optim.fused=true", "optim.momentum=0",
                         "optim.nesterov=false", "trainer.precision=fp16"))


@pytest.mark.parametrize("name,package", [("tvm", "tvm"), ("openxla", "torch_xla")])
def test_a_compile_backend_whose_package_is_missing_is_refused(make_cfg, name, package):
    """torch lists them, then fails at the first step with an ImportError traceback."""
    import importlib.util

    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed here")
    with pytest.raises(ConfigError, match=rf"^trainer.compile.backend={name}: needs the "
                                          rf"{package} package, which is not installed here"):
        resolve(make_cfg("trainer.compile.enabled=true", f"trainer.compile.backend={name}"))


@pytest.mark.parametrize("args,key,instead", [
    (["trainer.compile.mode=reduce-overhead"], "trainer.compile.mode=reduce-overhead",
     "trainer.compile.mode=max-autotune-no-cudagraphs"),
    (["trainer.compile.mode=max-autotune"], "trainer.compile.mode=max-autotune",
     "trainer.compile.mode=max-autotune-no-cudagraphs"),
    (["trainer.compile.backend=cudagraphs"], "trainer.compile.backend=cudagraphs",
     "trainer.compile.backend=inductor"),  # (the backend replays graphs in any mode)
])
def test_cuda_graphs_and_accumulation_are_refused_together_on_cuda(make_cfg, args, key,
                                                                   instead):
    """The next replay writes over the gradients accumulated so far (pytorch/pytorch#169545);
    on CPU no graph is replayed, and without accumulation nothing is accumulated."""
    cuda = torch.device("cuda", 0)  # (a device object: no GPU needed to make one)
    cfg = make_cfg("trainer.compile.enabled=true", "trainer.accumulate_grad_batches=2", *args)
    with pytest.raises(ConfigError, match=rf"^{key}: replays CUDA graphs, whose next replay "
                                          r"overwrites the gradients accumulated so far, so it "
                                          r"cannot be combined with trainer.accumulate_grad_"
                                          rf"batches=2; use {instead}"):
        _check_graphs_and_accumulation(cfg, cuda)
    _check_graphs_and_accumulation(cfg, torch.device("cpu"))
    for ok in (make_cfg("trainer.compile.enabled=true", *args),
               make_cfg("trainer.compile.enabled=false", "trainer.accumulate_grad_batches=2",
                        *args),
               make_cfg("trainer.compile.enabled=true", "trainer.accumulate_grad_batches=2",
                        *args, instead)):  # what the line says to use is taken
        _check_graphs_and_accumulation(ok, cuda)


def test_keys_that_decide_the_same_thing_or_need_a_validation_set(make_cfg):
    with pytest.raises(ConfigError, match=r"^trainer\.limit_train_batches=2: cannot be combined "
                                          r"with trainer\.overfit_batches=4"):
        resolve(make_cfg("trainer.overfit_batches=4", "trainer.limit_train_batches=2"))
    with pytest.raises(ConfigError, match=r"^trainer\.checkpoint\.monitor=val_acc: nothing is "
                                          r"validated in this run \(no validation set"):
        monitor_mode(make_cfg("trainer.checkpoint.monitor=val_acc"), {})  # no val set: no keys


def test_init_from_is_a_path_and_not_a_second_start_beside_a_resumed_checkpoint(make_cfg):
    with pytest.raises(ConfigError, match=r"^trainer\.init_from=: is empty"):
        resolve(make_cfg("trainer.init_from=''"))
    with pytest.raises(ConfigError, match=r"^trainer\.init_from=w\.pt: cannot be combined with "
                                          r"trainer\.resume=a/last\.pt, which continues"):
        resolve(make_cfg("trainer.init_from=w.pt", "trainer.resume=a/last.pt"))
    resolve(make_cfg("trainer.init_from=w.pt", "trainer.resume=auto"))  # a requeued job's


@pytest.mark.parametrize("overrides,fragment", [
    (["trainer.validate_only=true"], "trainer.validate_only=true: validates the weights of "
                                     "trainer.init_from=PATH (a run's checkpoint such as "
                                     "outputs/my-run/checkpoints/best.pt"),
    (["trainer.validate_only=true", "trainer.init_from=w.pt", "trainer.profile=true"],
     "trainer.validate_only=true: cannot be combined with trainer.profile"),
    (["trainer.validate_only=true", "trainer.init_from=w.pt", "trainer.init_strict=false"],
     "trainer.validate_only=true: validates the file's model as it is, and "
     "trainer.init_strict=false would leave"),
    (["trainer.validate_only=true", "trainer.resume=w.pt"],
     "which is not set; trainer.resume=w.pt continues a training: give that file as "
     "trainer.init_from"),
    (["trainer.validate_only=true", "trainer.init_from=w.pt", "trainer.limit_val_batches=0"],
     "trainer.validate_only=true: has nothing to validate with trainer.limit_val_batches=0"),
    (["trainer.validate_only=true", "trainer.init_from=w.pt", "trainer.fast_dev_run=true"],
     "trainer.validate_only=true: cannot be combined with trainer.fast_dev_run"),
])
def test_validate_only_needs_weights_and_a_validation(make_cfg, overrides, fragment):
    with pytest.raises(ConfigError) as info:
        resolve(make_cfg(*overrides))
    assert str(info.value).startswith("trainer.validate_only=true: ") and fragment in str(
        info.value)


def test_a_debug_modes_single_strategy_under_torchrun_names_the_mode(tmp_path):
    """debug=default under torchrun: `trainer.strategy=single: cannot run in a job of 2 ranks`
    named a key its user never set."""
    from tests.helpers import ROOT, torchrun

    proc = torchrun(2, ["debug=default", f"hydra.run.dir={tmp_path / 'run'}"], ROOT,
                    timeout=120)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("stoker: error:")]
    assert lines == ["stoker: error: trainer.strategy=single: cannot run in a job of 2 ranks; "
                     "use auto or ddp (debug=default sets it, for one process: add "
                     "trainer.strategy=auto to debug this job's ranks with its other "
                     "settings)"], proc.stderr[-2000:]


@pytest.mark.parametrize("size", ["0", "-5", "abc", "32.5"])
def test_an_image_size_that_is_no_size_names_its_own_key(make_cfg, tmp_path, size):
    """It was said as `data.input_shape=[3, 0, 0]`, a key the user never set."""
    from scripts.make_images import write_images

    write_images(tmp_path / "imgs", count=8, size=16, classes=2)
    cfg = make_cfg("data=image_folder", f"data.dataset.root={tmp_path / 'imgs'}",
                   f"data.dataset.size={size}")
    with pytest.raises(ConfigError, match=rf"^data.dataset.size={size}: must be a whole number "
                                          r"of pixels >= 1"):
        resolve(cfg)

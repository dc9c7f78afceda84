"""Speed switches: each reaches PyTorch, changes nothing it should not, and bad values fail."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import ROOT, summary_of, torchrun
from tests.helpers import final_weights as weights
from trainer import speed
from trainer.checks import _check_speed, resolve
from trainer.config import CompileConfig, ConfigError, Strategy
from trainer.models import SmallCNN
from trainer.runner import train


def per_backend_precision():
    """torch's per-backend fp32 precision settings (readable in any state)."""
    b = torch.backends
    return {name: obj.fp32_precision for name, obj in [
        ("all", b), ("cuda.matmul", b.cuda.matmul), ("cudnn", b.cudnn),
        ("cudnn.conv", b.cudnn.conv), ("cudnn.rnn", b.cudnn.rnn), ("mkldnn", b.mkldnn),
        ("mkldnn.matmul", b.mkldnn.matmul), ("mkldnn.conv", b.mkldnn.conv),
        ("mkldnn.rnn", b.mkldnn.rnn)]}


@pytest.fixture
def restore_backend_flags():
    saved = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32,
             torch.backends.cudnn.benchmark, torch.backends.mkldnn.matmul.fp32_precision)
    yield
    torch.set_float32_matmul_precision(saved[0])
    torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = saved[1:3]
    torch.backends.mkldnn.matmul.fp32_precision = saved[3]
    # (the set_ above make the process-wide getters answer again after a per-backend setter)


def tf32_state():
    """What every reader sees, old getters and new; a getter that raises fails the test
    (torch refuses the old getters once a per-backend fp32_precision setter was used). CPU
    matmuls stay fp32 (TF32 on CPUs with AMX-FP16 is not what the key is for)."""
    assert torch.backends.mkldnn.matmul.fp32_precision == "ieee"
    return (torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.fp32_precision)


def test_backend_flags_set_tf32_and_cudnn_autotuning(restore_backend_flags):
    speed.backend_flags(tf32=True, cudnn_benchmark=True, deterministic=False)
    assert tf32_state() == ("high", True, True, "tf32")
    assert torch.backends.cudnn.benchmark
    speed.backend_flags(tf32=False, cudnn_benchmark=True, deterministic=True)
    assert tf32_state() == ("highest", False, False, "ieee")
    assert not torch.backends.cudnn.benchmark  # deterministic wins over autotuning


def test_train_applies_the_flags_from_the_config(make_cfg, restore_backend_flags, tmp_path):
    """Set for the run, and put back as they were at its end (a program training from Python
    ran its own code afterwards with anomaly detection, deterministic algorithms and TF32 on,
    three times slower)."""
    import os

    from trainer.loop import Callback

    seen = []

    class Flags(Callback):
        def after_step(self, loop):
            seen.append((tf32_state(), torch.backends.cudnn.benchmark,
                         torch.is_anomaly_enabled(), torch.are_deterministic_algorithms_enabled(),
                         os.environ.get("CUBLAS_WORKSPACE_CONFIG")))

    def outside():
        return (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32,
                torch.backends.cudnn.benchmark, torch.backends.mkldnn.matmul.fp32_precision,
                torch.is_anomaly_enabled(), torch.are_deterministic_algorithms_enabled(),
                os.environ.get("CUBLAS_WORKSPACE_CONFIG"))

    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    before = outside()
    train(make_cfg("trainer.max_steps=1", "trainer.tf32=false", "trainer.cudnn_benchmark=true",
                   run_dir=tmp_path / "a"), callbacks=[Flags()])
    assert seen.pop() == (("highest", False, False, "ieee"), True, False, False, None)
    assert outside() == before
    train(make_cfg("trainer.max_steps=1", "trainer.tf32=true", "trainer.cudnn_benchmark=false",
                   "trainer.detect_anomaly=true", "trainer.deterministic=true",
                   run_dir=tmp_path / "b"), callbacks=[Flags()])  # (a dir of its own)
    assert seen.pop() == (("high", True, True, "tf32"), False, True, True, ":4096:8")
    assert outside() == before
    with pytest.raises(ConfigError):  # (a run that fails puts them back too)
        train(make_cfg("trainer.max_steps=1", "trainer.tf32=true", "trainer.deterministic=true",
                       "model._target_=tests.helpers.NoSuchModel", run_dir=tmp_path / "c"))
    assert outside() == before


def test_train_puts_back_precision_a_program_set_per_backend(make_cfg, restore_backend_flags,
                                                            tmp_path, caplog):
    """A program that set torch's per-backend fp32 precision (torch then refuses the
    process-wide getter) trains, and gets its settings back as it set them."""
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    torch.backends.cudnn.conv.fp32_precision = "ieee"
    with pytest.raises(RuntimeError):  # (what a read of the old getter did to the run)
        torch.get_float32_matmul_precision()
    before = per_backend_precision()
    train(make_cfg("trainer.max_steps=1", "trainer.tf32=false", run_dir=tmp_path))
    assert per_backend_precision() == before
    assert "backend flags" not in caplog.text


def test_channels_last_converts_the_model_weights():
    model = speed.memory_format(SmallCNN([3, 8, 8], 4), channels_last=True)
    conv = model.stages[0][0].weight
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    plain = speed.memory_format(SmallCNN([3, 8, 8], 4), channels_last=False)
    assert plain.stages[0][0].weight.is_contiguous()


def test_channels_last_trains_like_the_default_layout(make_cfg, tmp_path):
    # SGD: its update is linear in the gradient, so layout rounding stays rounding-sized
    # (Adam's normalised step turns a 1e-9 gradient difference into a visible one)
    common = ["data=synthetic", "model=cnn", "data.dataset.num_samples=256",
              "trainer.max_steps=6", "optim=sgd"]
    plain = train(make_cfg(*common, run_dir=tmp_path / "plain"))
    cl = train(make_cfg(*common, "data.channels_last=true", run_dir=tmp_path / "cl"))
    a, b = weights(plain), weights(cl)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_model_trains_like_eager_and_saves_plain_keys(make_cfg, tmp_path, backend):
    common = ["trainer.max_steps=8"]
    eager = train(make_cfg(*common, run_dir=tmp_path / "eager"))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = train(make_cfg(*common, "trainer.compile.enabled=true",
                              f"trainer.compile.backend={backend}", run_dir=tmp_path / backend))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # it did compile
    a, b = weights(eager), weights(compiled)
    assert a.keys() == b.keys()  # no `_orig_mod.` prefix: checkpoints stay interchangeable
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
    assert compiled["val_acc"] == pytest.approx(eager["val_acc"], abs=0.01)


@pytest.mark.slow
def test_compiled_ddp_matches_eager_ddp(tmp_path):
    """Two ranks, with accumulation (DDP's no_sync inside the compiled module): the same
    weights as eager DDP, so the gradients were all-reduced once per optimizer step."""
    args = ["data.batch_size=8", "trainer.accumulate_grad_batches=2", "trainer.max_steps=6",
            "trainer.compile.backend=aot_eager"]
    for name, on in (("eager", "false"), ("compiled", "true")):
        proc = torchrun(2, [f"hydra.run.dir={tmp_path / name}", *args,
                            f"trainer.compile.enabled={on}"], cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
    a = weights(summary_of(tmp_path / "eager"))
    b = weights(summary_of(tmp_path / "compiled"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optim", ["adamw", "sgd"])
@pytest.mark.parametrize("impl", ["optim.fused=true", "optim.foreach=true", "optim.foreach=false"])
def test_optimizer_implementations_agree(make_cfg, tmp_path, optim, impl):
    common = [f"optim={optim}", "trainer.max_steps=5"]
    ref = weights(train(make_cfg(*common, run_dir=tmp_path / "ref")))
    other = weights(train(make_cfg(*common, impl, run_dir=tmp_path / "other")))
    for k in ref:
        torch.testing.assert_close(ref[k], other[k], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("override,key", [
    ("trainer.compile.mode=fastest", "trainer.compile.mode=fastest: must be one of default"),
    ("trainer.compile.backend=turbo", "trainer.compile.backend=turbo: must be one of"),
    ("optim.foreach=true", "optim.fused=true: cannot be combined with optim.foreach=true"),
])
def test_bad_speed_settings_fail_with_the_key(make_cfg, override, key):
    cfg = make_cfg("trainer.compile.enabled=true", "optim.fused=true", override)
    if "optim" not in override:
        cfg.optim.fused = None
    with pytest.raises(ConfigError, match=key.replace("[", r"\[")):
        resolve(cfg)


def test_compile_is_refused_with_data_parallel(make_cfg):
    cfg = make_cfg("trainer.compile.enabled=true")
    with pytest.raises(ConfigError, match="trainer.compile.enabled=true: is not supported with "
                                          "DataParallel"):
        _check_speed(cfg, Strategy.dp)
    _check_speed(cfg, Strategy.ddp)  # fine


def test_eager_compile_backend_is_refused_with_activation_checkpointing(make_cfg):
    cfg = make_cfg("trainer.compile.enabled=true", "trainer.compile.backend=eager", "model=cnn",
                   "model.activation_checkpointing=true")
    with pytest.raises(ConfigError, match="trainer.compile.backend=eager: cannot run "
                                          "model.activation_checkpointing=true; use aot_eager"):
        _check_speed(cfg, Strategy.single)
    cfg.trainer.compile.backend = "aot_eager"
    _check_speed(cfg, Strategy.single)  # fine


def test_compile_is_off_by_default(make_cfg):
    assert make_cfg().trainer.compile == CompileConfig()


@pytest.mark.gpu
def test_every_switch_together_on_cuda(make_cfg, tmp_path, restore_backend_flags):
    """TF32, cuDNN autotuning, channels_last, fused AdamW, compile and activation checkpointing
    at once, in bf16 with the prefetcher: trains, learns, and the weights are channels_last."""
    summary = train(make_cfg("trainer.accelerator=cuda", "data=synthetic", "model=cnn",
                             "data.dataset.num_samples=1024", "data.dataset.dtype=uint8",
                             "data.channels_last=true", "optim.fused=true",
                             "trainer.compile.enabled=true", "trainer.precision=bf16",
                             "model.activation_checkpointing=true", "trainer.max_epochs=3"))
    assert summary["val_acc"] > 0.5
    assert tf32_state() == ("high", True, True, "tf32")
    conv = weights(summary)["stages.0.0.weight"]
    assert conv.is_contiguous(memory_format=torch.channels_last)

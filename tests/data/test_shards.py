"""data/shards.py: tar shards written once, streamed by rank and worker with every sample
exactly once per epoch, exact validation shards, and exact resume."""
from __future__ import annotations

import json

import pytest
import torch

from data.loader import build_loader
from data.shards import ShardStream
from data.shardwriter import write_shards
from tests.helpers import numbered
from trainer.config import DataConfig


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    for split, n in (("train", 103), ("val", 37)):
        write_shards(numbered(n), root / split, samples_per_shard=10)
    return root


def loader(root, split="train", rank=0, world=1, workers=2, batch=8, drop_last=False,
           shuffle=True, buffer=16):
    cfg = DataConfig(batch_size=batch, num_workers=workers, drop_last=drop_last,
                     shuffle=shuffle, persistent_workers=True)
    stream = ShardStream(split, str(root), shuffle_buffer=buffer)
    return build_loader(stream, cfg, train=split == "train", rank=rank, world_size=world,
                        seed=3, num_workers=workers)


def ids_of(batches):
    return [int(i) for _, y in batches for i in y]


def epoch(ld, e):
    ld.sampler.set_epoch(e)
    return [b for b in ld]


@pytest.mark.parametrize("workers", [0, 2])
def test_two_ranks_by_two_workers_see_every_sample_once_per_epoch(shards, workers):
    # 103 samples on 2 ranks: 52 each, the stream wrapping round for the one pad sample
    for e in (0, 1):
        seen = [ids_of(epoch(loader(shards, rank=r, world=2, workers=workers), e))
                for r in (0, 1)]
        assert len(seen[0]) == len(seen[1]) == 52
        together = seen[0] + seen[1]
        assert sorted(set(together)) == list(range(103))
        assert len(together) - len(set(together)) == 1  # the padding, as DistributedSampler
    first = ids_of(epoch(loader(shards, workers=workers), 0))
    assert first != ids_of(epoch(loader(shards, workers=workers), 1))  # reshuffled per epoch
    assert first == ids_of(epoch(loader(shards, workers=workers), 0))  # and reproducible


def test_drop_last_cuts_to_whole_batches_of_equal_ranks(shards):
    lds = [loader(shards, rank=r, world=2, drop_last=True) for r in (0, 1)]
    seen = [ids_of(epoch(ld, 0)) for ld in lds]
    assert len(seen[0]) == len(seen[1]) == 48 == len(lds[0].sampler) + 0
    assert len(set(seen[0]) | set(seen[1])) == 96


def test_validation_shards_are_exact_without_padding(shards):
    seen = [ids_of(loader(shards, "val", rank=r, world=3)) for r in range(3)]
    assert sorted(seen[0] + seen[1] + seen[2]) == list(range(37))
    assert [len(s) for s in seen] == [12, 12, 13]
    stream = ShardStream("val", str(shards))  # validation keeps the stored order
    stored = [int(stream.decode(s)[1]) for s in stream.samples_in([0, 1, 2, 3], 0, 37)]
    assert seen[0] + seen[1] + seen[2] == stored


def test_the_loader_reports_its_length_and_the_loop_plan(shards):
    ld = loader(shards, rank=1, world=2, batch=8)
    assert len(ld.sampler) == 52 and len(ld) == 7
    assert sum(len(y) for _, y in epoch(ld, 0)) == 52


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("workers", [0, 2, 3])
def test_resume_at_any_batch_continues_exactly(shards, workers):
    full = [y.tolist() for _, y in epoch(loader(shards, rank=1, world=2, workers=workers), 4)]
    for taken in range(len(full) + 1):
        ld = loader(shards, rank=1, world=2, workers=workers)
        ld.sampler.set_epoch(4)
        ld.sampler.set_start(taken * 8 * 2)  # global samples: batches x batch x ranks
        assert [y.tolist() for _, y in ld] == full[taken:], taken
        assert len(ld.sampler) == sum(len(b) for b in full[taken:])


def test_image_shards_decode_like_the_folder_and_a_bad_root_is_one_line(tmp_path):
    from data.images import ImageFolder
    from scripts.make_images import write_images

    write_images(tmp_path / "im", count=20, size=32, classes=2)
    folder = ImageFolder("train", str(tmp_path / "im"), size=16)
    write_shards(folder, tmp_path / "sh" / "train", samples_per_shard=7)
    stream = ShardStream("train", str(tmp_path / "sh"), size=16)
    assert stream.kind == "image" and stream.classes == ["class_00", "class_01"]
    decoded = {}
    for sample in stream.samples_in([0, 1, 2], 0, len(stream)):
        x, y = stream.decode(sample)
        decoded.setdefault(int(y), []).append(x)
    expected = {}
    for i in range(len(folder)):
        x, y = folder[i]
        expected.setdefault(int(y), []).append(x)
    for label, xs in expected.items():
        key = lambda t: t.flatten().tolist()  # noqa: E731
        assert sorted(map(key, xs)) == sorted(map(key, decoded[label]))
    with pytest.raises(FileNotFoundError, match="data.dataset.root=.*cannot read train/index"):
        ShardStream("train", str(tmp_path / "nothing"))


@pytest.mark.slow
def test_ddp_training_on_shards_stops_mid_epoch_and_resumes_bit_exactly(tmp_path):
    import subprocess
    import sys

    from tests.helpers import ROOT, torchrun
    from trainer import checkpoint

    out = tmp_path / "sh"
    prep = subprocess.run([sys.executable, "scripts/prepare_data.py", "--format", "shards",
                           "--shard-samples", "100", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert prep.returncode == 0, prep.stderr[-3000:]
    # 1438 digits on 2 ranks: 719 each, 23 batches of 32; 2 workers per rank
    job = ["data=shards", f"data.dataset.root={out}", "data.normalize_mean=null",
           "data.normalize_std=null", "data.num_workers=2", "data.batch_size=32",
           "sched=constant", "trainer.max_epochs=2", "trainer.log_every_n_steps=5"]
    ref = torchrun(2, [*job, f"hydra.run.dir={tmp_path / 'ref'}"], ROOT, timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert "streamed from 15 tar shards through a DataLoader with 2 workers" in ref.stdout
    run_dir = tmp_path / "cut"
    part = torchrun(2, [*job, f"hydra.run.dir={run_dir}", "trainer.max_steps=30"], ROOT,
                    timeout=300)
    assert part.returncode == 0, part.stderr[-3000:]
    # (its own trainer.max_steps=30 would be carried to the resume: lifted on the command line)
    rest = torchrun(2, [*job, f"hydra.run.dir={run_dir}", "trainer.resume=auto",
                        "trainer.max_steps=-1"], ROOT, timeout=300)
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert "resumed from" in rest.stdout and "step 30" in rest.stdout
    a = checkpoint.load(tmp_path / "ref" / "checkpoints" / "last.pt")
    b = checkpoint.load(run_dir / "checkpoints" / "last.pt")
    assert a["step"] == b["step"] == 46
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    val = [json.loads(line) for line in (tmp_path / "ref" / "metrics.jsonl").read_text(
    ).splitlines() if '"val"' in line]
    assert val and all(0.0 < v["val_acc"] <= 1.0 for v in val)


def test_caching_a_stream_is_refused_in_one_line(shards, tmp_path):
    from tests.helpers import compose_cfg
    from trainer.config import ConfigError
    from trainer.runner import train

    cfg = compose_cfg(tmp_path / "run", "data=shards", f"data.dataset.root={shards}",
                      "data.normalize_mean=null", "data.normalize_std=null",
                      "data.input_shape=[2]", "data.num_classes=103", "data.cache=memory")
    with pytest.raises(ConfigError, match="data.cache=memory: streamed shards"):
        train(cfg)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_an_unreadable_image_sample_is_skipped_once_or_fails_in_one_line(tmp_path, caplog):
    from webdataset import TarWriter

    from data.images import ImageError
    from scripts.make_images import write_images

    write_images(tmp_path / "im", count=4, size=16, classes=2, val_fraction=0.0)
    good = sorted((tmp_path / "im").rglob("*.jpg"))[0].read_bytes()
    (tmp_path / "sh" / "train").mkdir(parents=True)
    with TarWriter(str(tmp_path / "sh" / "train" / "s0.tar")) as sink:
        for pos, (data, cls) in enumerate([(good, b"1"), (b"broken", b"1"), (good, b"1"),
                                           (good, b"abc"), (good, b"--3")]):
            sink.write({"__key__": f"{pos:09d}", "jpg": data, "cls": cls,
                        "path": f"/data/{pos}.jpg".encode()})
    (tmp_path / "sh" / "train" / "index.json").write_text(json.dumps(
        {"kind": "image", "classes": ["a", "b"], "num_classes": 2,
         "shards": [{"url": "s0.tar", "samples": 5}]}))
    stream = ShardStream("train", str(tmp_path / "sh"), size=8, on_error="fail")
    with pytest.raises(ImageError, match=r"cannot read the sample .*s0.tar:000000001 "
                                         r"\(/data/1.jpg\) \(cannot identify image file\)"):
        for sample in stream.samples_in([0], 0, 3):
            stream.decode(sample)
    skip = ShardStream("train", str(tmp_path / "sh"), size=8)
    with caplog.at_level("WARNING", logger="stoker"):
        for _ in range(2):  # two epochs: one warning
            decoded = [skip.decode(s) for s in skip.samples_in([0], 0, 5)]
    assert [d is None for d in decoded] == [False, True, False, True, True]  # ("abc", "--3")
    assert skip.skipped() == ["train sample 000000001", "train sample 000000003",
                              "train sample 000000004"]
    assert sum("/data/1.jpg" in r.getMessage() for r in caplog.records) == 1
    assert any("its .cls member holds 'abc', not a class index" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("index,fragment", [
    ([], r'not a shard index \(expected a JSON object whose "shards" is a list'),
    ({"kind": "image"}, "not a shard index"),
    ({"shards": [{"url": "a.tar"}]}, r'shards\[0\] is \{"url": "a.tar"\}; each shard needs a '
                                     r'"url" \(a string\) and a "samples" count'),
    ({"shards": [{"url": "a.tar", "samples": "twenty"}]}, r"shards\[0\] is"),
    ({"shards": [{"url": "a.tar", "samples": -20}]}, r"shards\[0\] is"),
    ({"shards": [{"url": "a.tar", "samples": 2}], "kind": "video"},
     r'"kind": "video"; must be one of image, npy'),
    ({"shards": [{"url": "a.tar", "samples": 2}, {"url": "b.tar", "samples": 2},
                 {"url": "a.tar", "samples": 2}]},  # (its samples read twice an epoch)
     r'shards\[0\] and shards\[2\] are both "a.tar"; list each shard once$'),
    ({"shards": [{"url": "a.tar", "samples": 2}, {"url": "b.tar", "samples": 0}]},
     r'shards\[1\] \("b.tar"\) says 0 samples; list only shards that hold samples'),
])
def test_an_index_that_is_not_a_shard_index_is_one_line_naming_it(tmp_path, index, fragment):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"^data.dataset.root={tmp_path}: train/index.json: "
                                         rf"{fragment}"):
        ShardStream("train", str(tmp_path))


def test_an_unreachable_remote_shard_asks_about_the_address_not_to_write_the_set_again(
        tmp_path, free_port_url):
    """Nothing came from an http:// shard (a wrong host, a network down): the line said to
    write the set again, as for a damaged file."""
    from data.loader import readable
    from trainer.config import ConfigError

    root = tmp_path / "shards"
    write_shards(numbered(10), root / "train", samples_per_shard=10)
    index = json.loads((root / "train" / "index.json").read_text())
    index["shards"][0]["url"] = f"{free_port_url}/shard-000000.tar"
    (root / "train" / "index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError) as info:
        list(readable(iter(loader(root, workers=0, shuffle=False))))
    assert str(info.value).startswith(f"data: shard {free_port_url}/shard-000000.tar cannot be "
                                      "read (")
    assert str(info.value).endswith("is the address right, and reachable from this machine? "
                                    "(the same command with curl, or the pipe's own, says more)")


@pytest.fixture
def free_port_url():
    """An http:// address on this machine where nothing listens."""
    from tests.helpers import free_port

    return f"http://127.0.0.1:{free_port()}"


@pytest.mark.parametrize("damage", ["cut", "garbage", "missing", "short index", "long shard"])
@pytest.mark.parametrize("workers", [0, 1])
def test_a_damaged_or_missing_shard_is_one_line_naming_it(tmp_path, damage, workers):
    """Read in the training process or in a loader worker: one line naming the shard, not
    tarfile's traceback."""
    import shutil

    from data.loader import readable, shut_down
    from trainer.config import ConfigError

    root = tmp_path / "shards"
    write_shards(numbered(30), root / "train", samples_per_shard=10)
    victim = root / "train" / "shard-000001.tar"
    if damage == "cut":
        victim.write_bytes(victim.read_bytes()[:700])
    elif damage == "garbage":
        victim.write_bytes(b"\x17" * 4096)
    elif damage == "missing":
        victim.unlink()
    else:  # the index promises more samples than the shard holds, or fewer
        index = json.loads((root / "train" / "index.json").read_text())
        index["shards"][1]["samples"] = 50 if damage == "short index" else 7
        (root / "train" / "index.json").write_text(json.dumps(index))
    batches = iter(loader(root, workers=workers, shuffle=False))
    try:
        with pytest.raises(ConfigError) as info:
            list(readable(batches))
    finally:  # (as the trainer ends a loader: left to the garbage collector, its worker's
        shut_down(batches)  # shutdown waited 10-20 s on it)
    message = str(info.value)
    assert "\n" not in message and "shard-000001.tar" in message, message
    assert message.startswith("data: shard "), message
    if damage == "long shard":  # said as what it is, not as a shard that cannot be read
        assert "holds more samples than the 7 its index says" in message
        assert "cannot be read" not in message, message
    shutil.rmtree(root)


def test_an_npy_sample_whose_member_is_damaged_or_missing_is_one_line_naming_it(shards):
    """A garbage x.npy was a worker's traceback about pickled data; a missing y.npy a bare
    KeyError: neither named the shard or the sample."""
    import io

    import numpy as np

    from trainer.config import ConfigError

    stream = ShardStream("train", str(shards))
    array = io.BytesIO()
    np.save(array, np.zeros(2, np.float32))
    good = {"__url__": "train/shard-000000.tar", "__key__": "000000007"}
    x, y = stream.decode({**good, "x.npy": array.getvalue(), "y.npy": array.getvalue()})
    assert x.shape == y.shape == (2,)
    with pytest.raises(ConfigError, match=r"^data: shard train/shard-000000.tar: sample "
                                          r"000000007 cannot be read \(its x.npy member is not "
                                          r"a .npy array \(no NumPy header\)\); write the set "
                                          r"again \(scripts/prepare_data.py --format shards\)$"):
        stream.decode({**good, "x.npy": b"garbage!", "y.npy": array.getvalue()})
    with pytest.raises(ConfigError, match=r"sample 000000007 cannot be read \(no y.npy member "
                                          r"\(it has x.npy\)\)"):
        stream.decode({**good, "x.npy": array.getvalue()})


def test_a_pass_still_held_at_exit_has_its_workers_ended(shards, tmp_path):
    """Workers let a first SIGTERM pass (data/loader.py:worker_signals), so a pass whose
    iterator an error's traceback still held at exit (a sweep job's crash in a shard worker)
    kept Python's exit waiting on its workers for ever: its loader ends them first."""
    import sys

    from tests.helpers import ROOT, bounded

    script = tmp_path / "held.py"
    script.write_text(f"""
import sys
from data.loader import build_loader
from data.shards import ShardStream
from trainer.config import DataConfig

cfg = DataConfig(batch_size=4, num_workers=1)
loader = build_loader(ShardStream("train", {str(shards)!r}), cfg, train=True, rank=0,
                      world_size=1, seed=0)
held = iter(loader)  # (as a traceback holds it)
next(held)
print("a batch", flush=True)
sys.exit(3)
""")
    proc = bounded([sys.executable, str(script)], ROOT, {"PYTHONPATH": str(ROOT)}, 60)
    assert (proc.returncode, proc.stdout) == (3, "a batch\n"), proc.stderr[-2000:]


@pytest.mark.parametrize("key,value,said", [
    ("shuffle_buffer", 1.5, "data.dataset.shuffle_buffer=1.5: must be a whole number >= 1"),
    ("size", 32.5, "data.dataset.size=32.5: must be a whole number of pixels"),
    ("resize", 40.0, "data.dataset.resize=40.0: must be a whole number of pixels")])
def test_a_shard_option_that_is_no_whole_number_is_one_line(shards, key, value, said):
    """It passed the checks, and a loader worker met it in a traceback after the run began."""
    with pytest.raises(ValueError) as e:
        ShardStream("train", str(shards), **{key: value})
    assert str(e.value) == said

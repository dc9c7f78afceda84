"""README.md's examples of code of one's own (the Hugging Face models' data and factory, a
task with dict batches and a two-head model), written to files and run with the README's own commands, as a
new user copies them: an example that no longer runs fails here, not in a user's hands."""
from __future__ import annotations

import re
import shlex

import pytest

from tests.helpers import QUIET, ROOT, run_cli, summary_of

pytestmark = pytest.mark.slow

# where each block goes, told by what it holds (the README names the files in its prose)
FILES = {"class PaddedTokens": "mypkg/data.py", "class DigitAndParity": "mypkg/tasks.py",
         "class DictDigits": "mypkg/digits.py", "def vit(": "mypkg/vision.py",
         "transformers.GPT2LMHeadModel": "myconf/model/gpt2_tiny.yaml",
         "mypkg.data.PaddedTokens": "myconf/data/padded_tokens.yaml",
         "mypkg.tasks.DigitAndParity": "myconf/task/digit_parity.yaml"}


def _section() -> str:
    text = (ROOT / "README.md").read_text()
    return text[text.index("### A Hugging Face causal language model"):
                text.index("### Mistakes are one line")]


def _write_examples(folder) -> list:
    """The section's files under `folder`, and its `python train.py` commands' arguments."""
    (folder / "mypkg").mkdir()
    (folder / "mypkg" / "__init__.py").write_text("")
    written, commands = set(), []
    for lang, body in re.findall(r"```(\w+)\n(.*?)```", _section(), re.S):
        if lang == "bash":
            for line in body.replace("\\\n", " ").splitlines():
                if line.startswith("python train.py"):
                    commands.append(shlex.split(line.replace("$PWD", str(folder)),
                                                comments=True)[2:])
            continue
        parts = re.split(r"^# (\w+/\w+\.yaml)\n", body, flags=re.M)
        named = [("myconf/" + p, b) for p, b in zip(parts[1::2], parts[2::2])] or [
            (path, body) for mark, path in FILES.items() if mark in body][:1]
        assert named, f"a {lang} block the test does not know where to put:\n{body[:200]}"
        for path, text in named:
            (folder / path).parent.mkdir(parents=True, exist_ok=True)
            (folder / path).write_text(text)
            written.add(path)
    assert written == {*FILES.values(), "myconf/data/dict_digits.yaml",
                       "myconf/model/two_heads.yaml"}
    return commands


def test_the_readmes_own_code_examples_train_as_written(tmp_path):
    pytest.importorskip("transformers")  # (the Hugging Face model's example needs it)
    commands = _write_examples(tmp_path)
    assert len(commands) == 3, commands  # the Hugging Face models', the task's
    for n, args in enumerate(commands):
        run_dir = tmp_path / f"run{n}"
        proc = run_cli([*args, *QUIET, "trainer.max_steps=6", f"hydra.run.dir={run_dir}"],
                       cwd=tmp_path)
        assert proc.returncode == 0, f"{args}\n{proc.stderr[-3000:]}"
        assert summary_of(run_dir)["steps"] == 6
    assert "val_acc" in summary_of(tmp_path / "run1")  # the vision model's
    assert "val_f1" in summary_of(tmp_path / "run2")  # the task's metrics


def test_the_short_way_trains_the_readmes_own_dataset_and_model(tmp_path, monkeypatch):
    """README's "Your own model and data, the short way": its file and command as written."""
    import torch

    from trainer.inference import load_model

    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Your own model and data, the short way"):
                   text.index("## Training\n")]
    (code,), (command,) = (re.findall(rf"```{lang}\n(.*?)```", section, re.S)
                           for lang in ("python", "bash"))
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "wine.py").write_text(code)
    args = shlex.split(command.replace("\\\n", " "))
    assert args[:2] == ["python", "train.py"]
    proc = run_cli([*args[2:], *QUIET], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "outputs" / "wine"
    summary = summary_of(run_dir)
    assert summary["epochs"] == 30 and summary["val_acc"] > 0.9, summary
    monkeypatch.syspath_prepend(str(tmp_path))  # (mypkg, as the run imported it)
    model = load_model(run_dir / "checkpoints" / "last.pt")
    assert model(torch.zeros(2, 13)).shape == (2, 3)

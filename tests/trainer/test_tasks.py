"""The built-in tasks (trainer/tasks.py): how batches reach the model, losses and their counts,
metrics, one-line errors."""
from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import PaddedTokens, pad_collate, tag_collate, tiny_bert_tagger, tiny_gpt2
from trainer.config import ConfigError
from trainer.metrics import Accuracy
from trainer.runner import train
from trainer.task import TaskError
from trainer.tasks import Classification, LanguageModel, ModelLoss, Regression


def test_classification_reads_tuples_dicts_and_model_outputs():
    task = Classification(num_classes=3)
    logits, y = torch.randn(4, 3), torch.tensor([0, 1, 2, 1])
    ref = F.cross_entropy(logits, y)
    model = torch.nn.Identity()
    assert torch.allclose(task.loss(task.forward(model, (logits, y)), (logits, y)), ref)
    batch = {"x": logits, "labels": y}
    out = task.forward(lambda x: {"logits": x}, batch)  # dict in -> keywords, dict out
    assert torch.allclose(task.loss(out, batch), ref)
    assert task.count(batch) == 4 and isinstance(task.count(batch), int)  # no host sync


@pytest.mark.parametrize("batch,output,fragment", [
    ({"x": torch.zeros(2)}, torch.zeros(2, 3),
     "a batch it cannot unpack: got dict{x: tensor(2,) float32}; expected (inputs, target) or "
     "a dict with the target key 'labels'"),
    ((torch.zeros(2, 3), torch.zeros(2)), torch.zeros(2, 3), "targets that are not integer"),
    ((torch.zeros(2, 3), torch.zeros(3, dtype=torch.int64)), torch.zeros(2, 3),
     "logits (2, 3) and targets of another shape"),
    ((torch.zeros(2, 3), torch.zeros(2, dtype=torch.int64)), torch.zeros(2, 5),
     "logits with 5 classes but data.num_classes=3: got tensor(2, 5) float32; expected the "
     "model's output size to match data.num_classes (a model's own argument, such as "
     "model.num_classes=3; a Hugging Face model's is its config's num_labels: "
     "model.config.num_labels=3, with a leading + where the config does not set it)"),
    # a squeezed output: the targets were blamed ("expected targets of shape ()")
    ((torch.zeros(2, 3), torch.zeros(2, dtype=torch.int64)), torch.zeros(2),
     "logits (2,) of the targets' own shape: the model gives no score per class: got "
     "tensor(2,) float32; expected logits of shape (2, 3) (a model that squeezes its output? "
     "task=regression for one real value)"),
    # one-hot targets: they are of another shape than class indices, the logits are right
    ((torch.zeros(2, 3), torch.eye(3, dtype=torch.int64)[:2]), torch.zeros(2, 3),
     "logits (2, 3) and targets of another shape: got tensor(2, 3) int64; expected targets "
     "of shape (2,) (class indices; for multi-label 0/1 targets, one per class, a task of "
     "your own with binary_cross_entropy_with_logits: README \"A task and a metric of your "
     "own\")"),
    ((torch.zeros(2, 3), torch.zeros(2, dtype=torch.int64)), "text",
     "a model output it cannot read: got str"),
    # a tagger's logits in F.cross_entropy's layout, (batch, classes, steps): the targets
    # were blamed ("expected targets of shape (2, 3)")
    ((None, torch.zeros(2, 7, dtype=torch.int64)), torch.zeros(2, 3, 7),
     "logits (2, 3, 7) with the classes in dimension 1, as F.cross_entropy takes them: got "
     "tensor(2, 7) int64; expected the classes last, logits of shape (2, 7, 3), as the task "
     "reads them: return output.movedim(1, -1) from the model"),
])
def test_classification_errors_are_one_line_naming_the_task(batch, output, fragment):
    task = Classification(num_classes=3)
    with pytest.raises(TaskError) as info:
        task.loss(output, batch)
    assert str(info.value).startswith("task classification: ")
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_a_misspelt_input_or_target_key_names_the_batch_entry_it_misspells():
    batch = {"features": torch.zeros(2, 3), "target": torch.zeros(2, dtype=torch.int64)}
    with pytest.raises(TaskError, match=r"a dict batch without the input key 'feature' "
                                        r"\(task.input_key\): got dict\{features: .*; did you "
                                        r"mean task.input_key=features\?$"):
        Classification(input_key="feature", target_key="target").split(batch)
    with pytest.raises(TaskError, match=r"a batch it cannot unpack: .*; did you mean "
                                        r"task.target_key=target\?$"):
        Classification(input_key="features", target_key="targt").split(batch)
    with pytest.raises(TaskError, match=r"\(task.input_key\): got dict\{[^}]*\}$"):
        Classification(input_key="pixels", target_key="target").split(batch)  # (none near)


def test_targets_beyond_the_logits_are_caught_on_the_first_batch():
    with pytest.raises(TaskError, match="a target outside 0..2"):
        Classification().loss(torch.zeros(2, 3), (None, torch.tensor([0, 7])))


def test_padding_targets_without_task_ignore_index_are_said_as_padding():
    """-100 padding without task.ignore_index asked whether the model's num_classes was
    right; it names task.ignore_index=-100, and only where every value out of range is it."""
    padded = torch.tensor([[0, 1, -100], [1, -100, -100]])
    with pytest.raises(TaskError, match=r"\(is the model's num_classes right\?\); are the "
                       r"targets of -100 padding to leave out\? set task.ignore_index=-100$"):
        Classification().loss(torch.zeros(2, 3, 2), (None, padded))
    for other in ([[0, 5, -100], [1, 1, 1]], [[0, -1, -100], [1, 1, 1]],
                  [[0, -2, -2], [1, 1, 1]]):  # (only -100 is taken for padding)
        with pytest.raises(TaskError, match=r"\(is the model's num_classes right\?\)$"):
            Classification().loss(torch.zeros(2, 3, 2), (None, torch.tensor(other)))
    # labels of -1 and 1 (a sign) were asked whether -1 was padding
    with pytest.raises(TaskError, match=r"num_classes right\?\); the targets are -1 and 1: "
                       r"classes 0 and 1 are \(y \+ 1\) // 2$"):
        Classification().loss(torch.zeros(4, 2), (None, torch.tensor([1, -1, -1, 1])))
    task = Classification(ignore_index=-100)
    assert task.loss(torch.zeros(2, 3, 2), (None, padded)).isfinite()


@pytest.mark.parametrize("bad", [57, -1])
def test_a_later_batchs_target_out_of_range_is_one_line_too(bad):
    """Values are checked on the first batch only (one host sync a run); a later one out of
    range (one wrong row of a label file) was a 188-line traceback. (On CUDA it is a
    device-side assert, which no process survives.)"""
    task = Classification()
    task.loss(torch.zeros(2, 3), (None, torch.tensor([0, 2])))
    with pytest.raises(TaskError, match=r"^task classification: a target outside 0..2 \(the "
                                        r"logits have 3 classes; Target -?\d+ is out of bounds"):
        task.loss(torch.zeros(2, 3), (None, torch.tensor([0, bad])))


def test_ignore_index_is_left_out_of_loss_count_and_accuracy():
    logits = torch.randn(2, 5, 7)
    target = torch.randint(7, (2, 5))
    target[0, 3:] = -100
    task = LanguageModel()
    loss, count = task.loss(logits, (None, target)), task.count((None, target))
    valid = target != -100
    assert int(count) == int(valid.sum()) == 8
    assert torch.allclose(loss, F.cross_entropy(logits[valid], target[valid]))
    acc = Accuracy(ignore_index=-100)
    acc.update(logits, target)
    expected = (logits.argmax(-1) == target)[valid].float().mean()
    assert torch.allclose(acc.compute(), expected)  # not halved by the padding


def test_language_model_shifts_labels_like_hugging_face():
    model = tiny_gpt2()
    batch = pad_collate([PaddedTokens("val", num_samples=3)[i] for i in range(3)])
    own = model(**batch).loss
    task = ModelLoss(count="tokens")
    task.setup(model)  # auto: GPT-2 is a causal LM, its labels are scored one position on
    assert task.shift_labels is True and "causal language model" in task.note
    lm = LanguageModel(shift_labels=True, input_key="input_ids")
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    assert torch.allclose(lm.loss(out, batch), own, rtol=1e-5)
    assert int(task.count(batch)) == int(lm.count(batch)) == int(
        (batch["labels"][:, 1:] != -100).sum())
    assert torch.allclose(task.loss(model(**batch), batch), own)


def test_model_loss_scores_an_encoders_token_labels_where_they_stand():
    """shift_labels=auto: a token classifier's labels are not shifted: the count and the
    metrics see every label against its own position's logits."""
    model = tiny_bert_tagger()
    batch = tag_collate([PaddedTokens("val", num_samples=4)[i] for i in range(4)])
    task = ModelLoss(count="tokens", metrics={"acc": Accuracy(ignore_index=-100)})
    task.setup(model)
    assert task.shift_labels is False and "not a Hugging Face causal" in task.note
    out = model(**batch)
    valid = batch["labels"] != -100
    assert int(task.count(batch)) == int(valid.sum())
    task.update_metrics(out, batch)
    own = (out.logits.argmax(-1) == batch["labels"])[valid].float().mean()
    assert float(task.metrics["acc"].compute()) == pytest.approx(float(own))


def test_a_hugging_face_token_classifier_trains_with_its_own_loss_and_exact_metrics(
        make_cfg, caplog):
    """BERT tagging tokens with task=model_loss task.count=tokens (shift_labels=auto): the
    logged token accuracy is the model's own, recomputed from the saved weights."""
    cfg = make_cfg("data=custom", "+data.train_dataset._target_=tests.helpers.PaddedTokens",
                   "+data.val_dataset._target_=tests.helpers.PaddedTokens",
                   "+data.val_dataset.split=val", "+data.val_dataset.num_samples=20",
                   "+data.collate_fn._target_=tests.helpers.tag_collate", "data.batch_size=8",
                   "model=custom", "model._target_=tests.helpers.tiny_bert_tagger",
                   "task=model_loss", "task.count=tokens", "+task.metrics.acc._target_="
                   "trainer.metrics.Accuracy", "+task.metrics.acc.ignore_index=-100",
                   "trainer.max_epochs=3", "optim.lr=0.01")
    with caplog.at_level(logging.INFO, logger="stoker"):
        s = train(cfg)
    assert "labels scored where they stand (BertForTokenClassification" in caplog.text
    model = tiny_bert_tagger()
    model.load_state_dict(torch.load(s["checkpoint"], weights_only=True)["model"])
    model.eval()
    batch = tag_collate([PaddedTokens("val", num_samples=20)[i] for i in range(20)])
    with torch.no_grad():
        logits = model(**batch).logits
    valid = batch["labels"] != -100
    own = float((logits.argmax(-1) == batch["labels"])[valid].float().mean())
    assert s["val_acc"] == pytest.approx(own, abs=1e-6) and own > 0.9  # parity is learnable


def test_model_loss_shift_labels_refuses_bad_values_and_an_undecided_auto():
    with pytest.raises(ConfigError, match="task.shift_labels=maybe: must be auto, true or false"):
        ModelLoss(shift_labels="maybe")
    batch = {"input_ids": torch.ones(1, 3, dtype=torch.int64),
             "labels": torch.ones(1, 3, dtype=torch.int64)}
    with pytest.raises(ConfigError, match="decided from the model: call the task's setup"):
        ModelLoss(count="tokens").count(batch)
    assert int(ModelLoss(count="tokens", shift_labels=False).count(batch)) == 3


def test_model_loss_warns_when_unshifted_labels_are_the_inputs(caplog):
    ids = torch.randint(48, (2, 6))
    task = ModelLoss(count="tokens", shift_labels=False)
    task.count({"input_ids": ids, "labels": ids})
    assert "the labels equal the input_ids" in caplog.text
    caplog.clear()
    task = ModelLoss(count="tokens", shift_labels=False)
    task.count({"input_ids": ids, "labels": ids % 2})
    assert "input_ids" not in caplog.text


def test_language_model_warns_when_targets_are_the_unshifted_inputs(caplog):
    ids = torch.randint(48, (2, 6))
    batch = {"input_ids": ids, "labels": ids}
    task = LanguageModel(input_key="input_ids")
    task.loss(task.forward(lambda t: torch.randn(2, 6, 48), batch), batch)
    assert "set task.shift_labels=true" in caplog.text
    caplog.clear()
    shifted = LanguageModel(input_key="input_ids", shift_labels=True)
    shifted.loss(shifted.forward(lambda t: torch.randn(2, 6, 48), batch), batch)
    assert "shift_labels" not in caplog.text


def test_regression_loss_and_shapes():
    task = Regression()
    pred, y = torch.randn(5, 1), torch.randn(5, dtype=torch.float64)
    assert torch.allclose(task.loss(pred, (None, y)), F.mse_loss(pred.squeeze(1), y.float()))
    with pytest.raises(TaskError, match="targets that are not real numbers"):
        task.loss(pred, (None, torch.zeros(5, dtype=torch.int64)))


def test_regression_outputs_laid_out_otherwise_than_the_targets_are_one_line():
    """(B, 2, 4) outputs against (B, 4, 2) targets were paired flattened: the run trained and
    scored every value against another's target, silently."""
    task, y = Regression(), torch.randn(3, 4, 2)
    with pytest.raises(TaskError, match=r"^task regression: outputs \(3, 2, 4\) laid out "
                       r"otherwise than the targets: got .*permute the model's output"):
        task.loss(torch.randn(3, 2, 4), (None, y))
    for same in (torch.randn(3, 8), torch.randn(3, 4, 2, 1), torch.randn(3, 1, 4, 2)):
        task.loss(same, (None, y))  # a flat row per sample, or size-1 dimensions aside
    task.loss(torch.randn(3, 12), (None, torch.randn(3, 3, 4)))
    task.loss(torch.randn(5), (None, torch.randn(5, 1)))
    # a sequence model's flattened steps: (B*T, 1) or (B*T,) against (B, T), (B, T, 2)
    # against (B*T, 2) merge neighbouring dimensions, as a reshape pairs them
    task.loss(torch.randn(20, 1), (None, torch.randn(4, 5)))
    task.loss(torch.randn(4, 5, 2), (None, torch.randn(20, 2)))
    with pytest.raises(TaskError, match="laid out otherwise"):
        task.loss(torch.randn(8, 4), (None, torch.randn(4, 8)))  # (transposed)


def test_a_regression_loss_of_ones_own_takes_the_pair_the_task_matches():
    """The README's Huber task: `self.pair` gives the (batch, 1) output and (batch,) targets
    matched, where F.huber_loss(output, target) would broadcast them to (batch, batch)."""
    class Huber(Regression):
        def loss(self, output, batch):
            pred, target = self.pair(output, batch)
            return F.huber_loss(pred, target)

    out, y = torch.randn(5, 1), torch.randn(5)
    assert torch.equal(Huber().loss(out, (None, y)), F.huber_loss(out.squeeze(1), y))
    with warnings.catch_warnings():  # (torch's own warning of the broadcast shown here)
        warnings.simplefilter("ignore", UserWarning)
        broadcast = F.huber_loss(out, y.expand(5, 5))
    assert not torch.equal(broadcast, F.huber_loss(out.squeeze(1), y))


def test_regression_keeps_targets_in_fp32_under_autocast_outputs():
    pred, y = torch.randn(4, 1).bfloat16(), torch.tensor([1.0001, 2.0002, 3.0003, 4.0004])
    p, t = Regression().metric_inputs(pred, (None, y))
    assert t.dtype == p.dtype == torch.float32 and torch.equal(t.squeeze(1), y)


def test_classification_takes_int32_targets():
    logits, y = torch.randn(3, 4), torch.tensor([0, 3, 1], dtype=torch.int32)
    assert torch.allclose(Classification().loss(logits, (None, y)),
                          F.cross_entropy(logits, y.long()))


def test_a_metric_that_does_not_reduce_to_one_number_is_one_line():
    from torchmetrics.classification import MulticlassF1Score

    task = Classification(metrics={"f1": MulticlassF1Score(num_classes=3, average=None)})
    task.update_metrics(torch.randn(6, 3), (None, torch.tensor([0, 1, 2, 0, 1, 2])))
    with pytest.raises(TaskError, match=r"^task.metrics.f1: MulticlassF1Score computed "
                                        r"tensor\(3,\) float32, not one number; configure "
                                        r"it to reduce to one \(task.metrics.f1.average=macro\), "
                                        r"or log one per class: wrap it in "
                                        r"torchmetrics.wrappers.ClasswiseWrapper$"):
        task.compute_metric("f1", task.metrics["f1"])
    # a regression's per-output values: its own argument (it was told to set `average`)
    from torchmetrics import MeanAbsoluteError, R2Score

    for metric, said in ((R2Score(multioutput="raw_values"),
                          "(task.metrics.m.multioutput=uniform_average)"),
                         (MeanAbsoluteError(num_outputs=3),
                          "(task.metrics.m.num_outputs=1: one value over every output)")):
        task = Regression(metrics={"m": metric})
        task.update_metrics(torch.randn(6, 3), (None, torch.randn(6, 3)))
        with pytest.raises(TaskError) as e:
            task.compute_metric("m", task.metrics["m"])
        assert str(e.value).endswith(f"not one number; configure it to reduce to one {said}")
    # one that no argument reduces (a confusion matrix) was told to configure it so
    from torchmetrics.classification import MulticlassConfusionMatrix

    task = Classification(metrics={"cm": MulticlassConfusionMatrix(num_classes=3)})
    task.update_metrics(torch.randn(6, 3), (None, torch.tensor([0, 1, 2, 0, 1, 2])))
    with pytest.raises(TaskError, match=r"^task.metrics.cm: MulticlassConfusionMatrix computed "
                                        r"tensor\(3, 3\) int64, not one number; a run logs "
                                        r"metrics of one number \(a matrix, per-class values: "
                                        r"compute it over the saved model's outputs"):
        task.compute_metric("cm", task.metrics["cm"])


def test_a_model_returning_only_its_loss_trains_and_validates(make_cfg):
    s = train(make_cfg("model._target_=tests.helpers.SelfLossMLP", "task=model_loss",
                       "trainer.max_epochs=2"))
    assert s["val_loss"] < 1.0 and "val_acc" not in s


def test_model_loss_needs_a_scalar_loss():
    with pytest.raises(TaskError, match="task model_loss: no scalar loss in the model output: "
                                        "got dict{logits: tensor"):
        ModelLoss().loss({"logits": torch.zeros(2, 3)}, {})
    # a loss the model made a number (.item()): told to return the tensor, as a task's is
    with pytest.raises(TaskError, match=r"; the model's loss is a number: return the tensor "
                                        r"itself \(\.item\(\) or float\(\) of it is a number "
                                        r"backward cannot start from\)$"):
        ModelLoss().loss({"loss": 0.5, "logits": torch.zeros(2, 3)}, {})


@pytest.mark.parametrize("count", ["samples", "tokens"])
def test_model_loss_under_data_parallel_is_the_whole_batchs_mean(count):
    """DataParallel on several GPUs gathers each GPU's 0-d loss into a vector, one per chunk
    of the batch (torch.chunk along dim 0; 7 samples on 4 GPUs: 2, 2, 2, 1): the task
    weighs them back into the mean over the whole batch, a chunk of padding only (its mean
    NaN) weighing nothing. The gather is made by hand here, with no GPU."""
    torch.manual_seed(0)
    logits, labels = torch.randn(7, 5, 3), torch.randint(0, 3, (7, 5))
    labels[6] = -100  # the last chunk: padding only
    labels[0, :2] = -100

    def mean_loss(lg, lb):
        if count == "tokens":
            return F.cross_entropy(lg.flatten(0, 1), lb.flatten(), ignore_index=-100)
        return F.cross_entropy(lg[:, 0], lb[:, 0].clamp(min=0))

    task = ModelLoss(count=count, shift_labels=False)
    task._replicas = 4  # what forward() reads from a DataParallel model on 4 GPUs
    gathered = torch.stack([mean_loss(lg, lb) for lg, lb in zip(logits.chunk(4), labels.chunk(4))])
    whole = mean_loss(logits[:6] if count == "tokens" else logits, labels[:6] if count == "tokens"
                      else labels)
    batch = {"labels": labels}
    assert torch.isnan(gathered[-1]) == (count == "tokens")
    assert torch.allclose(task.loss({"loss": gathered}, batch), whole)
    with pytest.raises(TaskError, match="no scalar loss"):  # not a gather of this batch
        task.loss({"loss": gathered[:2]}, batch)
    task._replicas = 1  # a vector without DataParallel: an unreduced loss, refused
    with pytest.raises(TaskError, match="no scalar loss"):
        task.loss({"loss": gathered}, batch)


def test_a_config_naming_the_tasks_former_module_still_builds():
    """`_target_: trainer.task.Classification`, written before the built-in tasks moved here."""
    from hydra.utils import get_class

    import trainer.task
    import trainer.tasks

    for name in ("Classification", "LanguageModel", "Regression", "ModelLoss"):
        assert get_class(f"trainer.task.{name}") is getattr(trainer.tasks, name)
    with pytest.raises(AttributeError, match="has no attribute 'Classifier'"):
        trainer.task.Classifier


def test_multi_hot_targets_for_classification_point_to_a_task_of_ones_own():
    """Multi-label 0/1 float targets were pointed to task=regression alone."""
    from trainer.tasks import Classification

    with pytest.raises(TaskError) as e:
        Classification().loss(torch.zeros(4, 3), (torch.zeros(4, 8), torch.ones(4, 3)))
    assert "targets that are not integer class indices" in str(e.value) and str(e.value).endswith(
        "(task=regression for real values; for multi-label 0/1 targets, one per class, a task "
        "of your own with binary_cross_entropy_with_logits: README \"A task and a metric of "
        "your own\")")


def test_model_loss_takes_the_loss_of_a_hugging_face_tuple_output():
    """A Hugging Face model called with return_dict=False and its labels returns (loss,
    logits, ...): the loss was refused as 'no scalar loss in the model output' while the line
    showed it; the metrics read the logits."""
    model = tiny_bert_tagger()
    batch = tag_collate([PaddedTokens("val", num_samples=4)[i] for i in range(4)])
    task = ModelLoss(count="tokens", metrics={"acc": Accuracy(ignore_index=-100)})
    task.setup(model)
    out = model(**batch, return_dict=False)
    assert isinstance(out, tuple)
    assert torch.equal(task.loss(out, batch), model(**batch).loss)
    task.update_metrics(out, batch)  # (the logits: the first tensor of a dimension or more)
    valid = batch["labels"] != -100
    own = (out[1].argmax(-1) == batch["labels"])[valid].float().mean()
    assert float(task.metrics["acc"].compute()) == pytest.approx(float(own))
    with pytest.raises(TaskError, match="a 0-d tensor, or a tuple whose first item is one"):
        task.loss((out[1],), batch)


@pytest.mark.parametrize("task, said", [
    # a per-token classification of targets that are its inputs scored 1.0 in silence
    (Classification(), "task classification: the targets equal the inputs, position by "
     "position: the model learns to copy its input (an accuracy near 1 that means nothing); "
     "for next-token prediction, task=language_model task.shift_labels=true"),
    (LanguageModel(), "task language_model: the targets equal the inputs; if they are Hugging "
     "Face-style labels, set task.shift_labels=true (position t is scored against token t + 1)"),
])
def test_targets_equal_to_the_inputs_of_a_per_position_task_are_a_warning_once(task, said,
                                                                               caplog):
    tokens = torch.randint(1, 8, (2, 5))
    tokens[1, 3:] = -100  # (padding, left out of the comparison)
    embed = torch.nn.Embedding(8, 8)
    model = lambda x: embed(x.clamp(min=0))  # noqa: E731  (logits (2, 5, 8))
    batch = (tokens, tokens.clone())
    if isinstance(task, Classification) and not isinstance(task, LanguageModel):
        task.ignore_index = -100
    with caplog.at_level(logging.WARNING, logger="stoker"):
        for _ in range(2):
            task.loss(task.forward(model, batch), batch)
    assert [r.getMessage() for r in caplog.records] == [said]


@pytest.mark.parametrize("make, batch", [
    (Classification, (torch.arange(10).view(2, 5) % 8,  # other targets
                      (torch.arange(10).view(2, 5) + 1) % 8)),
    (lambda: LanguageModel(shift_labels=True), (torch.arange(10).view(2, 5) % 8,
                                                torch.arange(10).view(2, 5) % 8)),
])
def test_targets_that_are_not_the_inputs_or_are_shifted_are_no_warning(make, batch, caplog):
    embed = torch.nn.Embedding(8, 8)
    task = make()
    with caplog.at_level(logging.WARNING, logger="stoker"):
        task.loss(task.forward(embed, batch), batch)
    assert not caplog.records


def test_one_label_per_sample_equal_to_its_one_input_is_no_warning(caplog):
    """(batch, classes) logits: a label per sample, not per position."""
    task, x = Classification(), torch.tensor([1, 2])
    with caplog.at_level(logging.WARNING, logger="stoker"):
        task.loss(task.forward(torch.nn.Embedding(4, 4), (x, x)), (x, x))
    assert not caplog.records

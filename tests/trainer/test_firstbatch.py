"""The run's first batch, looked at once (trainer/firstbatch.py): a batch the model cannot
take, parameters DDP found unused, and a batch of more items than the task reads, each said in
one line."""
from __future__ import annotations

import logging
import re

import pytest
import torch
import torch.nn.functional as F

from trainer.config import ConfigError
from trainer.firstbatch import check_count, check_loss, forward_error, reads_two_items
from trainer.runner import train
from trainer.task import TaskError
from trainer.tasks import Classification, ModelLoss


def test_forward_error_names_a_first_batch_the_model_cannot_take_and_nothing_later():
    model = torch.nn.Linear(4, 2)
    batch = (torch.zeros(3, 5), torch.zeros(3, dtype=torch.int64))
    shape = RuntimeError("mat1 and mat2 shapes cannot be multiplied (3x5 and 4x2)\nmore")
    error = forward_error(shape, batch, model, first=True, input_shape=[5], find_unused=False)
    assert isinstance(error, ConfigError) and "\n" not in str(error)
    assert str(error).startswith("model: Linear cannot take the first batch (tuple(tensor(3, "
                                 "5) float32"), str(error)
    assert str(error).endswith("check data.input_shape=[5] and the model's arguments")
    # no data.input_shape sized the model (a Hugging Face config of one's own): not named
    error = forward_error(shape, batch, model, first=True, input_shape=None, find_unused=False)
    assert str(error).endswith("; do the batch's sizes fit the model's arguments? (a sequence "
                               "longer than its position embeddings, another feature count "
                               "than its first layer's)"), str(error)
    # float64 inputs (numpy's default) for float32 weights: the dtype, not the shape, is named
    doubles = (torch.zeros(3, 4, dtype=torch.float64), batch[1])
    dtype = RuntimeError("mat1 and mat2 must have the same dtype, but got Double and Float")
    error = forward_error(dtype, doubles, model, first=True, input_shape=None, find_unused=False)
    assert "the batch holds float64 inputs and the model's parameters are float32" in str(error)
    # float token ids for an embedding: integers are what it takes
    embed = torch.nn.Embedding(8, 2)
    try:
        embed(torch.zeros(3, 4))
    except RuntimeError as e:
        error = forward_error(e, (torch.zeros(3, 4), batch[1]), embed, first=True,
                              input_shape=None, find_unused=False)
    assert str(error).startswith("model: Embedding cannot take the first batch (tuple(tensor(3, "
                                 "4) float32"), str(error)
    assert str(error).endswith("token ids must be integers: make the dataset return int64 "
                               "tensors (torch.as_tensor(ids, dtype=torch.long))")
    # a later batch's error is the error itself: the first one fitted
    assert forward_error(shape, batch, model, first=False, input_shape=[5],
                         find_unused=False) is shape
    unused = RuntimeError("Expected to have finished reduction in the prior iteration ... "
                          "find_unused_parameters=True ...")
    error = forward_error(unused, batch, model, first=False, input_shape=None, find_unused=False)
    assert str(error).startswith("trainer.ddp.find_unused_parameters=false: some of the model")
    assert forward_error(unused, batch, model, first=False, input_shape=None,
                         find_unused=True) is unused


TRIPLES = ["data=custom", "+data.dataset._target_=tests.helpers.TripleDigits",
           "data.input_shape=[1,8,8]", "data.num_classes=10", "trainer.max_steps=2",
           "trainer.save_checkpoint=false", "trainer.progress_bar=false"]


@pytest.mark.skipif(not hasattr(Exception, "add_note"), reason="notes need Python 3.11")
def test_a_tasks_own_forward_failing_on_the_first_batch_says_what_it_was_given():
    """A task of one's own written for dict batches, run on the default (inputs, target) data:
    its `batch["image"]` raised before the model, with a traceback and no word of the batch."""
    from trainer.firstbatch import checked_forward

    from trainer.task import Task

    class DictTask(Task):
        def forward(self, model, batch):
            return model(batch["image"])

        def loss(self, output, batch):
            return F.cross_entropy(output, batch["label"])

    batch = (torch.zeros(3, 4), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(TypeError) as e:
        checked_forward(DictTask(), torch.nn.Linear(4, 2), batch, True, None, False)
    assert e.value.__notes__ == [
        "stoker: task DictTask: its forward failed on the first batch, given tuple(tensor(3, 4) "
        "float32, tensor(3,) int64): does the task's forward take the batches the data "
        "(data=...) yields?"]
    with pytest.raises(TypeError) as later:  # a later batch: its traceback alone
        checked_forward(DictTask(), torch.nn.Linear(4, 2), batch, False, None, False)
    assert not getattr(later.value, "__notes__", None)

    class Raising(torch.nn.Module):
        def forward(self, x):
            raise TypeError("inside the model")

    with pytest.raises(TypeError, match="inside the model") as inside:  # the model's note only
        checked_forward(Classification(), Raising(), batch, True, None, False)
    assert len(inside.value.__notes__) == 1 and "the model's first forward" in \
        inside.value.__notes__[0]


def test_a_batch_of_more_than_inputs_and_target_is_said_once_where_the_rest_is_unused(
        make_cfg, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="stoker"):
        train(make_cfg(*TRIPLES, run_dir=tmp_path / "a"))
    said = [r.getMessage() for r in caplog.records if "items" in r.getMessage()]
    assert said == ["task classification: the batches hold 3 items; the first two are taken "
                    "as (inputs, target) and the rest (1 more) is not used (a dict batch names its "
                    "entries, task=model_loss passes them all to the model, and a task of your "
                    "own reads what it needs: README \"Bring your own\")"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="stoker"):  # (inputs, target): nothing said
        train(make_cfg(*TRIPLES[2:], run_dir=tmp_path / "b"))
    assert not [r for r in caplog.records if "items" in r.getMessage()]


def test_only_a_task_reading_two_items_warns_of_the_rest():
    class Weighted(Classification):
        def loss(self, output, batch):
            x, y, w = batch
            return (F.cross_entropy(output, y, reduction="none") * w).mean()

    assert reads_two_items(Classification())
    assert not reads_two_items(Weighted())  # its loss reads the weights
    assert not reads_two_items(ModelLoss())  # the model gets the whole batch


def test_a_count_is_an_int_of_one_or_more_or_a_one_element_tensor():
    task, batch = Classification(), (torch.zeros(4, 3), torch.zeros(4, dtype=torch.long))
    for fine in (4, 1, torch.tensor(7), torch.tensor([7])):
        check_count(task, fine, batch)
    check_count(task, 0, (torch.zeros(0, 3), torch.zeros(0, dtype=torch.long)))  # no samples
    for wrong, shown in ((0, "0"), (True, "True"), (4.0, "4.0"), (torch.ones(2), "tensor(2,)")):
        with pytest.raises(TaskError, match=rf"^task classification: Classification\.count\("
                                            rf"batch\) returned {re.escape(shown)}"):
            check_count(task, wrong, batch)


def test_a_loss_is_one_floating_number_that_depends_on_the_parameters():
    task, w = Classification(), torch.ones(3, requires_grad=True)
    check_loss(task, (w * 2).sum())
    for wrong, said in ((w * 2, "no loss backward can start from: got tensor(3,) float32"),
                        ((w > 0).sum(), "no loss backward can start from"),
                        (1.5, "no loss backward can start from: got float"),
                        (torch.tensor(1.5), "does not depend on the model's parameters")):
        with pytest.raises(TaskError, match=r"^task classification: Classification\.loss") as e:
            check_loss(task, wrong)
        assert said in str(e.value) and "\n" not in str(e.value)


def test_samples_of_another_shape_than_the_model_was_sized_by_warn(make_cfg, caplog, tmp_path):
    """An MLP flattens whatever it is given: (4, 16) samples for a model built for [1, 8, 8]
    trained without a word."""
    from trainer.runner import train

    train(make_cfg("trainer.max_steps=1", "data.dataset._target_=tests.helpers.ReshapedDigits"))
    said = [r.getMessage() for r in caplog.records if "data.input_shape" in r.getMessage()]
    assert said == ["data.input_shape=[1, 8, 8], but the first batch's samples are (4, 16) "
                    "(inputs tensor(64, 4, 16) float32): the model took them, reshaped; is "
                    "data.input_shape the samples' shape?"]
    caplog.clear()
    train(make_cfg("trainer.max_steps=1", run_dir=tmp_path / "plain"))
    # sequences shorter than the longest the transformer takes (its input_shape): no mistake
    train(make_cfg("trainer.max_steps=1", "data=tokens", "model=transformer",
                   "task=language_model", "data.input_shape=[64]", "data.dataset.tokens=32",
                   run_dir=tmp_path / "lm"))
    assert not [r for r in caplog.records if "data.input_shape" in r.getMessage()]


def test_a_loss_of_ones_own_failing_on_the_first_batch_says_what_it_was_given(make_cfg):
    """Its traceback stays (the task's own code), closed by a line, as a failing first forward
    is: a custom loss of the wrong shape ended in torch's words alone."""
    with pytest.raises(ValueError, match="Target size") as e:
        train(make_cfg("task._target_=tests.helpers.BinaryLossOnClassLogits",
                       "trainer.max_steps=2"))
    assert getattr(e.value, "__notes__", []) == [
        "stoker: task classification: its loss failed on the first batch, given the model's "
        "output tensor(64, 10) float32 and the batch list(tensor(64, 1, 8, 8) float32, "
        "tensor(64,) int64): do the loss, the model's output and the data's targets fit "
        "together?"]


@pytest.mark.parametrize("layer", [torch.nn.Conv1d(3, 4, 3),
                                   torch.nn.GRU(8, 4, batch_first=True)])
def test_float64_inputs_to_a_convolution_or_an_rnn_are_one_line_as_to_a_linear(layer):
    """Only a Linear's "must have the same dtype" was said so: a Conv1d's "Input type
    (double) and bias type (float)" and a GRU's ValueError were tracebacks."""
    from trainer.firstbatch import checked_forward
    from trainer.tasks import Regression

    batch = (torch.zeros(2, 3, 8, dtype=torch.float64), torch.zeros(2))
    with pytest.raises(ConfigError, match=r"^model: .* cannot take the first batch .*the batch "
                       r"holds float64 inputs and the model's parameters are float32: make the "
                       r"dataset return tensors of the model's dtype"):
        checked_forward(Regression(), layer, batch, True, None, False)
    # a device mismatch says "Input type (torch.cuda.FloatTensor)": not a dtype, a traceback
    device = RuntimeError("Input type (torch.cuda.FloatTensor) and weight type "
                          "(torch.FloatTensor) should be the same")
    assert forward_error(device, (torch.zeros(2, 3, 8), torch.zeros(2)), torch.nn.Conv1d(3, 4, 3),
                         first=True, input_shape=None, find_unused=False) is device


def test_ids_past_the_embedding_or_labels_past_num_labels_are_one_line_under_model_loss():
    """Under task=model_loss (a Hugging Face model's own loss) token ids past vocab_size and
    labels past num_labels were a 114-line IndexError from inside the model (on CUDA a
    device-side assert): checked on the first batch, and where a later one fails."""
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2ForSequenceClassification

    from tests.helpers import tiny_gpt2
    from trainer.firstbatch import checked_forward

    lm = tiny_gpt2(vocab_size=20)
    ids = torch.randint(0, 20, (2, 8))
    fine = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    assert checked_forward(ModelLoss(), lm, fine, True, None, True) is not None
    past = {**fine, "input_ids": ids + 5}
    with pytest.raises(ConfigError) as e:
        checked_forward(ModelLoss(), lm, past, True, None, True)
    assert str(e.value) == (
        f"data: the batch's 'input_ids' holds ids from {int(ids.min()) + 5} to "
        f"{int(ids.max()) + 5}, but the model's input embedding (transformer.wte) has 20 rows: "
        "ids must be from 0 to 19 (does the tokenizer's vocabulary fit the model's "
        "vocab_size?) (in the first batch)")
    with pytest.raises(ConfigError, match=r"holds ids from .* \(in a batch after the first"):
        checked_forward(ModelLoss(), lm, past, False, None, True)  # (raised, then found)
    torch.manual_seed(0)
    classifier = GPT2ForSequenceClassification(GPT2Config(
        vocab_size=20, n_positions=8, n_embd=16, n_layer=1, n_head=2, num_labels=2,
        pad_token_id=0))
    labels = {"input_ids": ids, "labels": torch.tensor([1, 2])}
    with pytest.raises(ConfigError) as e:
        checked_forward(ModelLoss(), classifier, labels, True, None, True)
    assert str(e.value) == (
        "data: the batch's 'labels' holds class 2, but GPT2ForSequenceClassification has 2 "
        "labels (its config's num_labels): labels must be from 0 to 1 (-100 leaves one out); "
        "give the model's config num_labels=<the data's class count> (in the first batch)")
    ignored = {"input_ids": ids, "labels": torch.tensor([1, -100])}
    assert checked_forward(ModelLoss(), classifier, ignored, True, None, True) is not None


def test_a_vision_classifiers_tuple_batch_labels_and_head_are_checked_under_model_loss():
    """Tuple batches reach the model as its positional arguments (ConvNext's labels second,
    ViT's third): labels past num_labels were an IndexError traceback; a head of another size
    than the data's classes trained silently."""
    pytest.importorskip("transformers")
    from transformers import ConvNextConfig, ConvNextForImageClassification

    from trainer.firstbatch import head_mismatch, out_of_range

    model = ConvNextForImageClassification(ConvNextConfig(
        num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, patch_size=2,
        num_labels=3))
    images = torch.zeros(2, 3, 16, 16)
    assert out_of_range((images, torch.tensor([0, 2])), model) is None
    assert out_of_range((images, torch.tensor([0, 3])), model).startswith(
        "data: the batch's 'labels' holds class 3, but ConvNextForImageClassification has 3 "
        "labels")
    assert head_mismatch(model, 3) is None and head_mismatch(model, None) is None
    assert head_mismatch(model, 4) == (
        "model: ConvNextForImageClassification has 3 labels (its config's num_labels) and the "
        "data 4 classes (data.num_classes): a label past its head fails the run; give the "
        "model's config num_labels=4")
    assert "its head scores classes no sample has" in head_mismatch(model, 2)
    assert head_mismatch(torch.nn.Linear(2, 3), 4) is None  # (not a Hugging Face classifier)


def test_sequences_longer_than_a_models_learned_positions_are_one_line():
    """GPT-2 with n_positions=8 given 20 tokens was an IndexError traceback, exit 1; BERT's
    max_position_embeddings alike; a rotary model (Llama) takes any length."""
    pytest.importorskip("transformers")
    from transformers import (BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel,
                              LlamaConfig, LlamaForCausalLM)

    from trainer.firstbatch import out_of_range

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_positions=8, n_embd=8, n_layer=1,
                                      n_head=2))
    long, short = torch.ones(2, 20, dtype=torch.int64), torch.ones(2, 8, dtype=torch.int64)
    assert out_of_range({"input_ids": long, "labels": long}, gpt2) == (
        "data: the batch's 'input_ids' holds sequences of 20 tokens, but the model's position "
        "embedding (transformer.wpe) has 8 rows (its config's n_positions): give sequences of "
        "at most 8 tokens (a tokenizer's max_length with truncation) or the model's config "
        "n_positions=20 or more")
    assert out_of_range({"input_ids": short, "labels": short}, gpt2) is None
    with pytest.raises(IndexError):  # (what the line stands for)
        gpt2(input_ids=long)
    bert = BertForMaskedLM(BertConfig(vocab_size=40, hidden_size=8, num_hidden_layers=1,
                                      num_attention_heads=2, intermediate_size=16,
                                      max_position_embeddings=16))
    assert "model's position embedding (bert.embeddings.position_embeddings) has 16 rows (its " \
        "config's max_position_embeddings)" in out_of_range({"input_ids": long}, bert)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=8, intermediate_size=16,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         max_position_embeddings=8))
    assert out_of_range({"input_ids": long}, llama) is None
    assert llama(input_ids=long).logits.shape == (2, 20, 40)


def test_positions_are_judged_as_the_model_reads_them():
    """Packed sequences give their own position_ids (each from 0): a long row of short ones
    runs, and was refused by its length; RoBERTa's positions start past its padding row, so
    a table of 16 rows takes 14 tokens, and a row padded past it with few tokens runs."""
    pytest.importorskip("transformers")
    from transformers import (GPT2Config, GPT2LMHeadModel, RobertaConfig,
                              RobertaForMaskedLM)

    from trainer.firstbatch import out_of_range

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_positions=8, n_embd=8, n_layer=1,
                                      n_head=2))
    ids = torch.ones(1, 20, dtype=torch.int64)
    packed = torch.cat([torch.arange(8), torch.arange(6), torch.arange(6)])[None]
    assert out_of_range({"input_ids": ids, "position_ids": packed}, gpt2) is None
    assert gpt2(input_ids=ids, position_ids=packed).logits.shape == (1, 20, 40)
    # (positions in device memory are not read where only host memory may be: meta here)
    on_device = {"input_ids": ids, "position_ids": torch.arange(20, device="meta")[None]}
    assert out_of_range(on_device, gpt2, cpu_only=True) is None
    assert out_of_range({"input_ids": ids, "position_ids": torch.arange(20)[None]}, gpt2) == (
        "data: the batch's 'position_ids' go up to 19, but the model's position embedding "
        "(transformer.wpe) has 8 rows (its config's n_positions): give positions below 8, or "
        "the model's config n_positions=20 or more")
    roberta = RobertaForMaskedLM(RobertaConfig(
        vocab_size=40, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=16, max_position_embeddings=16, pad_token_id=1))
    fits, over = torch.full((2, 14), 5), torch.full((2, 15), 5)
    assert out_of_range({"input_ids": fits}, roberta) is None
    roberta(input_ids=fits)
    assert out_of_range({"input_ids": over}, roberta) == (
        "data: the batch's 'input_ids' holds sequences of 15 tokens, but the model's position "
        "embedding (roberta.embeddings.position_embeddings) has 16 rows (its config's "
        "max_position_embeddings; positions from 2 on): give sequences of at most 14 tokens "
        "(a tokenizer's max_length with truncation) or the model's config "
        "max_position_embeddings=17 or more")
    with pytest.raises((IndexError, RuntimeError)):  # (what the line stands for)
        roberta(input_ids=over)
    padded = torch.cat([torch.full((2, 10), 5), torch.ones(2, 10, dtype=torch.int64)], 1)
    assert out_of_range({"input_ids": padded}, roberta) is None
    roberta(input_ids=padded, token_type_ids=torch.zeros_like(padded))


def test_a_hugging_face_head_of_one_label_is_said_to_regress_not_to_fail():
    """num_labels=1 was warned of as 'a label past its head fails the run', and the run then
    completed: Hugging Face trains a head of one as a regression on the labels."""
    pytest.importorskip("transformers")
    from transformers import BertConfig, BertForSequenceClassification

    from trainer.firstbatch import head_mismatch, out_of_range

    model = BertForSequenceClassification(BertConfig(
        vocab_size=20, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=16, num_labels=1))
    batch = {"input_ids": torch.tensor([[1, 2, 3], [4, 5, 6]]), "labels": torch.tensor([0, 1])}
    assert out_of_range(batch, model) is None
    assert head_mismatch(model, 2) == (
        "model: BertForSequenceClassification has 1 label (its config's num_labels), which "
        "Hugging Face trains as a regression (mean squared error on the labels as numbers), "
        "and the data 2 classes (data.num_classes): give the model's config num_labels=2 to "
        "classify them")
    out = model(**batch)  # (what the warning says: the loss is a regression's)
    assert out.loss == torch.nn.functional.mse_loss(out.logits.squeeze(), batch["labels"].float())
    # a token classifier takes the cross-entropy over its one label: label 1 is past it
    from transformers import BertForTokenClassification

    tagger = BertForTokenClassification(BertConfig(
        vocab_size=20, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=16, num_labels=1))
    tags = {"input_ids": batch["input_ids"], "labels": torch.tensor([[0, 1, 0], [0, 0, 0]])}
    assert head_mismatch(tagger, 2).endswith("a label past its head fails the run; give the "
                                             "model's config num_labels=2")
    assert out_of_range(tags, tagger).startswith(
        "data: the batch's 'labels' holds class 1, but BertForTokenClassification has 1 labels")
    with pytest.raises(IndexError):
        tagger(**tags)


def test_integers_are_judged_only_by_the_table_the_model_names_as_its_inputs():
    """Categorical features with tables of their own, a class embedding beside uint8 images,
    a decoder's ids beside an encoder's: which table the integers index is not known, so no
    line blames one; a model naming its input table (get_input_embeddings) is judged by it."""
    from trainer.firstbatch import out_of_range
    from trainer.models import Transformer

    class Tabular(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Embedding(3, 4), torch.nn.Embedding(50, 4)

    codes = torch.tensor([[2, 40], [1, 7]])
    assert out_of_range((codes, torch.zeros(2)), Tabular()) is None
    one = torch.nn.Sequential(torch.nn.Embedding(3, 4))
    assert out_of_range((codes, torch.zeros(2)), one) is None
    lm = Transformer(input_shape=[4], num_classes=30, dim=8, layers=1, heads=2)
    pixels = torch.full((2, 4), 200, dtype=torch.uint8)
    assert out_of_range((pixels, torch.zeros(2)), lm) is None  # (uint8: no token ids)
    assert out_of_range({"input_ids": codes % 30, "decoder_input_ids": codes + 100}, lm) is None
    assert out_of_range((codes, codes), lm).startswith(
        "data: the batch's item 0 holds ids from 1 to 40, but the model's input embedding "
        "(tokens) has 30 rows")


def test_a_batchnorm_given_one_sample_in_training_is_one_line_naming_the_fixes(make_cfg):
    """torch's "Expected more than 1 value per channel when training" was a traceback at the
    end of the first epoch, where the training samples left one over data.batch_size."""
    from tests.helpers import BatchNormMLP
    from trainer.firstbatch import checked_forward

    model = BatchNormMLP([1, 8, 8], 10)
    one = (torch.zeros(1, 1, 8, 8), torch.zeros(1, dtype=torch.int64))
    for first in (True, False):
        with pytest.raises(ConfigError, match=r"^model: BatchNormMLP's BatchNorm needs more than "
                           r"one value per channel in training and got torch.Size\(\[1, 16\]\), "
                           r"a batch of one sample \(tuple\(tensor\(1, 1, 8, 8\).*: "
                           r"data.batch_size=1, or the last batch of an epoch.*data.drop_last="
                           r"true \(leaves that one out\)"):
            checked_forward(Classification(), model, one, first, [1, 8, 8], False)
    model.eval()  # (validation's batches: BatchNorm takes one sample there)
    assert checked_forward(Classification(), model, one, False, [1, 8, 8], False).shape == (1, 10)

    class Pooled(torch.nn.Module):  # (a batch of four, made one row by the model itself)
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.BatchNorm1d(64)

        def forward(self, x):
            return self.norm(x.flatten(1).mean(0, keepdim=True)).expand(len(x), -1)[:, :10]

    four = (torch.zeros(4, 1, 8, 8), torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ConfigError, match=r"^model: Pooled's BatchNorm needs more than one value "
                       r"per channel in training and got torch.Size\(\[1, 64\]\) from a batch "
                       r"of 4 samples \(.*\): the model reduces or reshapes its batch to one "
                       r"row before that BatchNorm; .*LayerNorm, GroupNorm") as e:
        checked_forward(Classification(), Pooled().train(), four, True, [1, 8, 8], False)
    assert "batch_size" not in str(e.value)  # (no batch size would help)
    # digits' 1438 training samples leave one over batches of 479, unless dropped
    target = "model._target_=tests.helpers.BatchNormMLP"
    with pytest.raises(ConfigError, match=r"BatchNorm needs more than one value per channel"):
        train(make_cfg(target, "data.batch_size=479", "trainer.max_epochs=1"))
    summary = train(make_cfg(target, "data.batch_size=479", "data.drop_last=true",
                             "trainer.max_epochs=1"))
    assert summary["steps"] == 3, summary

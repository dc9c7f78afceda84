"""trainer/spelling.py: a misspelling told from another word (the Hugging Face config check
itself is tested through components.build, in test_components.py)."""
from trainer.spelling import closest


def test_a_misspelling_is_letters_within_a_word_not_a_word_for_another():
    assert closest("num_hiden_layers", ["num_hidden_layers", "hidden_size"]) == \
        "num_hidden_layers"
    assert closest("numhidden_layers", ["num_hidden_layers"]) == "num_hidden_layers"
    assert closest("lrr", ["lr", "betas"]) == "lr"
    assert closest("bos_token_id", ["eos_token_id"]) is None  # (a word for another)
    assert closest("sep_token_id", ["pad_token_id"]) is None
    assert closest("encoder_layers", ["num_decoder_layers"]) is None


def test_a_short_name_one_letter_off_is_a_misspelling():
    """Four letters with one changed score 0.75, under the ratio longer names are held to."""
    takes = ["split", "size", "label_offset"]
    assert closest("sise", takes) == "size"  # (a letter changed)
    assert closest("szie", takes) == "size"  # (two swapped)
    assert closest("bos_token_id", ["eos_token_id"]) is None  # (a 3-letter word: a word)
    assert closest("spit", takes) == "split"  # (one left out)
    assert closest("sise", ["size", "side"]) is None  # (one letter from either: no guess)
    assert closest("bos", ["eos"]) is None
    assert closest("wine_mpl", ["wine_mlp", "synthetic_cnn"]) == "wine_mlp"  # (3: a swap)
    assert closest("mlp", ["cnn", "mpl"]) == "mpl"


def test_no_guess_between_equals_and_no_short_word_guess_for_a_refusal():
    assert closest("Conv", ["Conv1d", "Conv2d", "Conv3d"]) is None  # (which one?)
    assert closest("bias", ["bins"]) == "bins"  # (a hint may guess)
    assert closest("bias", ["bins"], short_words=False) is None  # (a refusal may not)

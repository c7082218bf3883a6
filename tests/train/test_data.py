import lzma
from pathlib import Path

import numpy as np
import pytest
import torch

from matrixopt.train.data import (
    ByteTokenizer,
    CharTokenizer,
    DataConfig,
    GPT2Tokenizer,
    load_dataset,
    train_batch,
    val_offsets,
    windows,
)

GPT2_RANKS = Path(__file__).resolve().parents[3] / "shared" / "data" / "gpt2_bpe" / "gpt2.tiktoken"


def test_builtin_shakespeare_matches_nanogpt_prepare():
    # nanoGPT's data/shakespeare_char/prepare.py prints: vocab size 65, train 1,003,854 tokens, val 111,540.
    ds = load_dataset(DataConfig())
    assert ds.vocab_size == 65
    assert (len(ds.train), len(ds.val)) == (1_003_854, 111_540)
    tok = CharTokenizer("".join(sorted(set("\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"))))
    assert tok.decode(ds.train[:14].tolist()) == "First Citizen:"


def test_char_and_byte_tokenizers_round_trip():
    char = CharTokenizer("hello")
    assert char.encode("hello") == [1, 0, 2, 2, 3]  # ids in sorted character order: e h l o
    assert char.decode(char.encode("hole")) == "hole"
    byte = ByteTokenizer()
    assert byte.encode("Aé") == [65, 195, 169]
    assert byte.decode([65, 195, 169]) == "Aé"


def test_gpt2_bpe_known_ids():
    pytest.importorskip("tiktoken")
    if not GPT2_RANKS.is_file():
        pytest.skip(f"{GPT2_RANKS} is absent")
    tok = GPT2Tokenizer(str(GPT2_RANKS))
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.encode(" the cat's") == [262, 3797, 338]
    assert tok.decode([15496, 995]) == "Hello world"
    assert tok.vocab_size == 50257


def test_text_file_with_gpt2_tokens(tmp_path):
    pytest.importorskip("tiktoken")
    if not GPT2_RANKS.is_file():
        pytest.skip(f"{GPT2_RANKS} is absent")
    (tmp_path / "t.txt").write_text("Hello world" * 10)
    ds = load_dataset(DataConfig(data=str(tmp_path / "t.txt"), tokenizer="gpt2", tokenizer_file=str(GPT2_RANKS)))
    assert ds.vocab_size == 50257 and ds.train[:2].tolist() == [15496, 995]


def test_gpt2_missing_ranks_file_is_named(tmp_path):
    pytest.importorskip("tiktoken")
    with pytest.raises(FileNotFoundError, match="nope.tiktoken does not exist"):
        GPT2Tokenizer(str(tmp_path / "nope.tiktoken"))


def write_tokens(path: Path, ids) -> Path:
    arr = np.asarray(ids, dtype="<u2")
    if path.name.endswith(".bin"):
        arr.tofile(path)
    elif path.suffix == ".npy":
        np.save(path, arr)
    else:
        path.write_bytes(lzma.compress(arr.tobytes()))
    return path


@pytest.mark.parametrize("name", ["train.bin", "train.npy", "train.u16.xz"])
def test_token_files_read_back_with_sibling_val(tmp_path, name):
    write_tokens(tmp_path / name, np.arange(100) % 50)
    write_tokens(tmp_path / name.replace("train", "val"), [7] * 30)
    ds = load_dataset(DataConfig(data=str(tmp_path / name)))
    assert ds.vocab_size == 50257
    assert ds.train.tolist() == (np.arange(100) % 50).tolist()
    assert ds.val.tolist() == [7] * 30


def test_token_file_without_val_is_split_90_10(tmp_path):
    path = write_tokens(tmp_path / "tokens.bin", np.arange(200))
    ds = load_dataset(DataConfig(data=str(path), vocab_size=300))
    assert (ds.train[-1], ds.val[0], len(ds.val)) == (179, 180, 20)


def test_token_ids_beyond_vocab_are_refused(tmp_path):
    path = write_tokens(tmp_path / "tokens.bin", [1, 2, 60000, 3])
    with pytest.raises(ValueError, match="holds id 60000, beyond the vocab of 50257 ids; pass --vocab-size 60001"):
        load_dataset(DataConfig(data=str(path)))


def test_text_folder_is_read_in_name_order(tmp_path):
    (tmp_path / "b.txt").write_text("world " * 20)
    (tmp_path / "a.txt").write_text("hello " * 20)
    ds = load_dataset(DataConfig(data=str(tmp_path), tokenizer="byte"))
    assert bytes(ds.train[:6].tolist()) == b"hello "
    assert bytes(ds.val[-6:].tolist()) == b"world "
    assert len(ds.train) + len(ds.val) == 240


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("missing.txt", None, "missing.txt does not exist"),
        ("empty.txt", b"", "holds no text"),
        ("empty.bin", b"", "is empty"),
        ("bad.u16.xz", b"not xz", "is not valid xz data"),
        ("latin1.txt", "café".encode("latin-1"), "is not UTF-8 text"),
    ],
)
def test_bad_data_files_are_named(tmp_path, name, content, message):
    if content is not None:
        (tmp_path / name).write_bytes(content)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        load_dataset(DataConfig(data=str(tmp_path / name)))


def test_batches_are_reproducible_shifted_windows():
    tokens = np.arange(1000, dtype=np.uint16)
    x, y = train_batch(tokens, 4, 16, seed=1, step=5, micro=0)
    x2, _ = train_batch(tokens, 4, 16, seed=1, step=5, micro=0)
    x3, _ = train_batch(tokens, 4, 16, seed=1, step=6, micro=0)
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64
    torch.testing.assert_close(x, x2)
    assert not torch.equal(x, x3)
    torch.testing.assert_close(y, x + 1)  # consecutive tokens: targets are inputs shifted by one
    offsets = val_offsets(tokens, 8, 16, seed=1)
    np.testing.assert_array_equal(offsets, val_offsets(tokens, 8, 16, seed=1))
    assert offsets.max() + 16 < 1000
    assert windows(tokens, offsets, 16)[0][:, 0].tolist() == offsets.tolist()

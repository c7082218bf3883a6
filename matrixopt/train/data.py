"""Token streams and batches.

A data source becomes two 1-D arrays of token ids, ``train`` and ``val``:

* ``shakespeare`` (the default): TinyShakespeare, shipped in this package xz-compressed, character-level,
  first 90% train and last 10% val, exactly as nanoGPT's ``shakespeare_char`` prepares it.
* a text file or a folder of text files, tokenized by ``char``, ``byte`` or ``gpt2`` (GPT-2 BPE through
  tiktoken; pass the ranks file for offline use), split 90/10.
* a token file: raw uint16 ``.bin`` (nanoGPT's format, memory-mapped), ``.npy`` (memory-mapped) or
  xz-compressed raw little-endian uint16 ``.u16.xz``. Its val split is ``val_data``, else the sibling file
  with ``train`` replaced by ``val`` in its name, else the last 10%.

Batches are random windows. The offsets of training batch ``(step, micro)`` depend only on
``(seed, step, micro)``, so a resumed run draws the same batches as an uninterrupted one; validation uses one
fixed set of windows, the same at every evaluation and for every optimizer.
"""

from __future__ import annotations

import lzma
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import torch

TOKENIZERS = ("auto", "char", "byte", "gpt2")
GPT2_VOCAB_SIZE = 50257
TOKEN_SUFFIXES = (".bin", ".npy", ".u16.xz")
# GPT-2's pre-tokenization pattern (tiktoken_ext.openai_public.r50k_pat_str).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


@dataclass(kw_only=True)
class DataConfig:
    """Where tokens come from. Checked here for form; files are checked when loaded."""

    data: str = "shakespeare"
    """'shakespeare' (built in), a text file or folder, or a token file (.bin, .npy, .u16.xz)."""
    val_data: str | None = None
    """Token or text file for the val split; default: a sibling '*val*' token file, else the last 10%."""
    tokenizer: str = "auto"
    """'char', 'byte' or 'gpt2' for text; 'auto' is 'char' for text and 'gpt2' ids for token files."""
    tokenizer_file: str | None = None
    """GPT-2 BPE ranks file (gpt2.tiktoken) so 'gpt2' works offline."""
    vocab_size: int | None = None
    """Vocab of a token file (default 50257, GPT-2's); every id must be below it."""
    val_fraction: float = 0.1
    """Share of the stream held out as val when there is no separate val file."""

    def __post_init__(self) -> None:
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"tokenizer must be one of {', '.join(TOKENIZERS)}, got {self.tokenizer!r}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.vocab_size is not None and not 1 <= self.vocab_size <= 65536:
            raise ValueError(f"vocab_size must be in [1, 65536] for uint16 token files, got {self.vocab_size}")


# ----------------------------------------------------------------------------------------------------------
# tokenizers


class CharTokenizer:
    """One id per distinct character, ids in sorted character order (nanoGPT's shakespeare_char)."""

    name = "char"

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.stoi = {ch: i for i, ch in enumerate(self.chars)}
        self.vocab_size = len(self.chars)

    def encode(self, text: str) -> list[int]:
        return [self.stoi[ch] for ch in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)


class ByteTokenizer:
    """The UTF-8 bytes of the text, 256 ids."""

    name = "byte"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class GPT2Tokenizer:
    """GPT-2 BPE through tiktoken, 50257 ids, ``<|endoftext|>`` = 50256.

    ``ranks_file``: a ``gpt2.tiktoken`` ranks file, for use with no network; without it tiktoken fetches (or
    reuses its cached) ranks."""

    name = "gpt2"
    vocab_size = GPT2_VOCAB_SIZE

    def __init__(self, ranks_file: str | None = None):
        try:
            import tiktoken
            import tiktoken.load
        except ImportError:
            raise ValueError("the gpt2 tokenizer needs tiktoken: pip install tiktoken") from None
        if ranks_file is None:
            try:
                self.enc = tiktoken.get_encoding("gpt2")
            except Exception as e:
                raise ValueError(
                    f"could not load GPT-2 BPE ranks through tiktoken ({type(e).__name__}); pass "
                    f"--tokenizer-file PATH/gpt2.tiktoken to work offline"
                ) from None
            return
        if not Path(ranks_file).is_file():
            raise FileNotFoundError(f"tokenizer file {ranks_file} does not exist; pass a gpt2.tiktoken ranks file")
        ranks = tiktoken.load.load_tiktoken_bpe(ranks_file)
        self.enc = tiktoken.Encoding(
            name="gpt2",
            pat_str=GPT2_PATTERN,
            mergeable_ranks=ranks,
            special_tokens={"<|endoftext|>": GPT2_VOCAB_SIZE - 1},
        )

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)

    def decode(self, ids: list[int]) -> str:
        return self.enc.decode(ids)


def make_tokenizer(name: str, text: str, ranks_file: str | None = None):
    """A tokenizer by name; ``text`` is the whole corpus (the char vocabulary is built from it)."""
    match name:
        case "char" | "auto":
            return CharTokenizer(text)
        case "byte":
            return ByteTokenizer()
        case "gpt2":
            return GPT2Tokenizer(ranks_file)
    raise ValueError(f"tokenizer must be one of {', '.join(TOKENIZERS)}, got {name!r}")


# ----------------------------------------------------------------------------------------------------------
# sources


@dataclass
class Dataset:
    """Train and val token ids: 1-D integer arrays (possibly memory maps), all ids below ``vocab_size``."""

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    description: str


def builtin_shakespeare() -> str:
    path = resources.files("matrixopt.train") / "data" / "tinyshakespeare.txt.xz"
    return lzma.decompress(path.read_bytes()).decode("utf-8")


def is_token_file(path: str) -> bool:
    return path.endswith(TOKEN_SUFFIXES)


def read_text(path: str) -> str:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"data path {path} does not exist; pass a text file, a folder or a token file")
    files = sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith(".")) if p.is_dir() else [p]
    parts = []
    for f in files:
        try:
            parts.append(f.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            raise ValueError(
                f"data file {f} is not UTF-8 text; token files must end in {', '.join(TOKEN_SUFFIXES)}"
            ) from None
    text = "".join(parts)
    if not text:
        raise ValueError(f"data path {path} holds no text; point --data at a non-empty file or folder")
    return text


def read_tokens(path: str) -> np.ndarray:
    """Token ids from a ``.bin`` (uint16, memory-mapped), ``.npy`` (memory-mapped) or ``.u16.xz`` file."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"token file {path} does not exist; check --data / --val-data")
    if p.stat().st_size == 0:
        raise ValueError(f"token file {path} is empty; point --data at a file with tokens in it")
    if path.endswith(".bin"):
        if p.stat().st_size % 2:
            raise ValueError(f"token file {path} has an odd byte count; .bin files hold raw uint16 ids")
        return np.memmap(p, dtype=np.uint16, mode="r")
    if path.endswith(".npy"):
        tokens = np.load(p, mmap_mode="r")
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise ValueError(f"token file {path} holds {tokens.dtype} of shape {tokens.shape}; need 1-D integers")
        return tokens
    try:
        raw = lzma.decompress(p.read_bytes())
    except lzma.LZMAError as e:
        raise ValueError(f"token file {path} is not valid xz data ({e})") from None
    if len(raw) % 2:
        raise ValueError(f"token file {path} decompresses to an odd byte count; .u16.xz holds uint16 ids")
    return np.frombuffer(raw, dtype="<u2")


def check_ids(tokens: np.ndarray, vocab_size: int, path: str) -> None:
    if len(tokens) and (hi := int(tokens.max())) >= vocab_size:
        raise ValueError(
            f"token file {path} holds id {hi}, beyond the vocab of {vocab_size} ids; pass --vocab-size "
            f"{hi + 1} (or more) if the ids are right"
        )
    if len(tokens) and (lo := int(tokens.min())) < 0:
        raise ValueError(f"token file {path} holds negative id {lo}")


def split(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    n = int(len(tokens) * (1 - val_fraction))
    return tokens[:n], tokens[n:]


def load_dataset(cfg: DataConfig) -> Dataset:
    """Read, tokenize and split ``cfg.data``. Raises FileNotFoundError or ValueError naming the bad input."""
    if cfg.data != "shakespeare" and is_token_file(cfg.data):
        if cfg.tokenizer not in ("auto", "gpt2"):
            raise ValueError(f"--data {cfg.data} is already tokenized; drop --tokenizer {cfg.tokenizer}")
        vocab_size = cfg.vocab_size or GPT2_VOCAB_SIZE
        train = read_tokens(cfg.data)
        val_path = cfg.val_data
        sibling = Path(cfg.data).with_name(Path(cfg.data).name.replace("train", "val"))
        if val_path is None and "train" in Path(cfg.data).name and sibling.is_file():
            val_path = str(sibling)
        if val_path is None:
            train, val = split(train, cfg.val_fraction)
        else:
            val = read_tokens(val_path)
        check_ids(train, vocab_size, cfg.data)
        check_ids(val, vocab_size, val_path or cfg.data)
        return Dataset(train, val, vocab_size, f"{cfg.data} (val: {val_path or 'last ' + str(cfg.val_fraction)})")

    text = builtin_shakespeare() if cfg.data == "shakespeare" else read_text(cfg.data)
    val_text = None if cfg.val_data is None else read_text(cfg.val_data)
    tok = make_tokenizer(cfg.tokenizer, text + (val_text or ""), cfg.tokenizer_file)
    if val_text is None:
        n = int(len(text) * (1 - cfg.val_fraction))
        text, val_text = text[:n], text[n:]  # split the text first, as nanoGPT does
    dtype = np.uint16 if tok.vocab_size <= 65536 else np.int64
    train = np.array(tok.encode(text), dtype=dtype)
    val = np.array(tok.encode(val_text), dtype=dtype)
    return Dataset(train, val, tok.vocab_size, f"{cfg.data} ({tok.name} tokens)")


# ----------------------------------------------------------------------------------------------------------
# batches


def windows(tokens: np.ndarray, offsets: np.ndarray, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets at ``offsets``: two ``(len(offsets), block_size)`` int64 tensors."""
    idx = offsets[:, None] + np.arange(block_size + 1)  # (B, T + 1)
    chunk = torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))  # (B, T + 1)
    return chunk[:, :-1], chunk[:, 1:]


def train_batch(
    tokens: np.ndarray, batch_size: int, block_size: int, seed: int, step: int, micro: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``micro`` of optimizer step ``step``: random windows drawn from ``(seed, step, micro)``."""
    rng = np.random.default_rng((seed, 0, step, micro))
    return windows(tokens, rng.integers(0, len(tokens) - block_size, size=batch_size), block_size)


def val_offsets(tokens: np.ndarray, n: int, block_size: int, seed: int) -> np.ndarray:
    """The fixed val windows: ``n`` offsets drawn once from ``seed``."""
    rng = np.random.default_rng((seed, 1))
    return rng.integers(0, len(tokens) - block_size, size=n)

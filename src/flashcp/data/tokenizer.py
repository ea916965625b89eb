"""Tokenizers: the built-in byte tokenizer and a local Hugging Face `tokenizer.json`.

The byte tokenizer needs no files: ids 0-255 are the UTF-8 bytes, 256/257/258 are BOS, EOS and
PAD (vocabulary 259), so any text round-trips exactly. `data.tokenizer: path/to/tokenizer.json`
loads a trained tokenizer through the `tokenizers` library (no network: the file must exist).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "[BOS]", "<bos>", "<|startoftext|>")
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "[EOS]", "<eos>", "<|end_of_text|>")
PAD_CANDIDATES = ("<pad>", "[PAD]", "<|pad|>", "<|padding|>")


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    vocab_size: int
    bos_id: int | None
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, skipping special tokens."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255, plus BOS=256, EOS=257, PAD=258."""

    vocab_size = 259
    bos_id: int | None = 256
    eos_id = 257
    pad_id = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=259)"


class HFTokenizer:
    """A `tokenizers.Tokenizer` read from a local `tokenizer.json`.

    Special tokens are found by name (`bos`/`eos`/`pad` arguments, else common spellings such
    as `<|endoftext|>` or `</s>`). An EOS token is required: it ends every document. Without a
    BOS token documents start directly; without PAD, EOS pads.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        bos: str | None = None,
        eos: str | None = None,
        pad: str | None = None,
    ) -> None:
        from tokenizers import Tokenizer as _Tok

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"data.tokenizer: no tokenizer file at {self.path}")
        self._tok = _Tok.from_file(str(self.path))
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.bos_id = self._find(bos, BOS_CANDIDATES)
        eos_id = self._find(eos, EOS_CANDIDATES)
        if eos_id is None:
            raise ValueError(
                f"{self.path} has no end-of-text token (looked for {', '.join(EOS_CANDIDATES)}):"
                " add one to the tokenizer, it separates packed documents"
            )
        self.eos_id = eos_id
        pad_id = self._find(pad, PAD_CANDIDATES)
        self.pad_id = eos_id if pad_id is None else pad_id

    def _find(self, name: str | None, candidates: tuple[str, ...]) -> int | None:
        for token in (name,) if name else candidates:
            tid = self._tok.token_to_id(token)
            if tid is not None:
                return int(tid)
        if name:
            raise ValueError(f"token {name!r} is not in {self.path}")
        return None

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


def build_tokenizer(spec: str) -> Tokenizer:
    """`byte` → `ByteTokenizer`; anything else is the path of a `tokenizer.json`."""
    if spec == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec)

"""Tokenizers: the built-in byte tokenizer and Hugging Face tokenizers read from local files.

* `byte`: ids 0-255 are the UTF-8 bytes, 256/257/258 are BOS, EOS and PAD (vocabulary 259), so
  any text round-trips exactly. No chat template. `ByteTokenizer.save_pretrained(dir)` writes it
  as a Hugging Face tokenizer directory (`AutoTokenizer` loads it; an export carries it).
* a `tokenizer.json` file: a trained tokenizer loaded with the `tokenizers` library. Nothing says
  which tokens are special, so BOS/EOS/PAD are found by their common spellings. No chat template.
* a directory (a Hugging Face model or tokenizer directory: `tokenizer.json`, and
  `tokenizer_config.json` / `special_tokens_map.json` when present): loaded with transformers'
  `PreTrainedTokenizerFast` (no PyTorch needed), so BOS/EOS/PAD are the ones
  `tokenizer_config.json` names, and conversations are rendered with its `chat_template`
  exactly as `transformers` renders them (`apply_chat_template`: Jinja in HF's sandboxed
  environment, with `messages`, `add_generation_prompt` and the special tokens). A GLM
  template's `[gMASK]<sop>` prefix and `<|user|>` / `<|assistant|>` role tokens come from the
  template; nothing here knows their names.

No network: every file must exist locally.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "[BOS]", "<bos>", "<|startoftext|>")
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "[EOS]", "<eos>", "<|end_of_text|>")
PAD_CANDIDATES = ("<pad>", "[PAD]", "<|pad|>", "<|padding|>")
TOKENIZER_FILE = "tokenizer.json"


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    vocab_size: int
    bos_id: int | None
    eos_id: int
    pad_id: int
    chat_template: str | None
    """The Jinja chat template (None: this tokenizer cannot render conversations)."""

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens added (special tokens written in the
        text, such as a template's role tokens, are recognised)."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, skipping special tokens."""
        ...

    def render_chat(
        self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = False
    ) -> str:
        """The conversation as text, through the chat template."""
        ...


def _no_template(
    name: str, rows: str = "records with a `messages` list (or DPO message lists)"
) -> ValueError:
    return ValueError(
        f"{name} has no chat template, so {rows} cannot be rendered: set data.tokenizer to a "
        "Hugging Face tokenizer directory whose tokenizer_config.json has a chat_template, or "
        "give prompt/response strings"
    )


def require_template(tokenizer: Tokenizer, fmt_name: str, layout: str) -> None:
    """Refuse, naming the row's own format (`fmt_name`, what it holds: `layout`), a
    conversational row for a tokenizer without a chat template."""
    if getattr(tokenizer, "chat_template", None) is None:
        path = getattr(tokenizer, "path", None)
        name = f"the tokenizer {path}" if path else "the byte tokenizer"
        raise _no_template(name, f"`{fmt_name}` rows ({layout}), conversations,")


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255, plus BOS=256, EOS=257, PAD=258."""

    vocab_size = 259
    bos_id: int | None = 256
    eos_id = 257
    pad_id = 258
    chat_template: str | None = None
    SPECIAL_TOKENS = ("<bos>", "<eos>", "<pad>")
    """The names of BOS, EOS and PAD in `save_pretrained`'s directory."""

    def save_pretrained(self, directory: str | Path) -> list[str]:
        """Write this tokenizer as a Hugging Face tokenizer directory; returns the file names.

        `tokenizer.json`: a BPE model whose vocabulary is the 256 byte tokens `<0x00>`..
        `<0xFF>` (id = byte) and no merges, with byte fallback, so every character becomes its
        UTF-8 bytes (the SentencePiece byte-fallback scheme; decoded by `ByteFallback`); the
        special tokens take ids 256-258. `tokenizer_config.json` names them, so transformers'
        `AutoTokenizer` (and `HFTokenizer` on the directory) give the same ids as this class.
        """
        # imported on use, as in HFTokenizer: training with the byte tokenizer never needs it
        from tokenizers import AddedToken, decoders, models
        from tokenizers import Tokenizer as _Tok

        out = Path(directory)
        vocab = {f"<0x{b:02X}>": b for b in range(256)}
        tok = _Tok(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
        tok.add_special_tokens([AddedToken(t, special=True) for t in self.SPECIAL_TOKENS])
        ids = [tok.token_to_id(t) for t in self.SPECIAL_TOKENS]
        if ids != [self.bos_id, self.eos_id, self.pad_id]:  # the library numbered them
            raise RuntimeError(f"byte tokenizer: special tokens got ids {ids}, not 256-258")
        tok.save(str(out / TOKENIZER_FILE))
        bos, eos, pad = self.SPECIAL_TOKENS
        special = {"bos_token": bos, "eos_token": eos, "pad_token": pad}
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **special}
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
        return [TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json"]

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def render_chat(
        self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = False
    ) -> str:
        raise _no_template("the byte tokenizer")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=259)"


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Import transformers without its "PyTorch was not found" advice (flashcp uses only its
    tokenizers, which need no PyTorch); the environment is restored afterwards."""
    key = "TRANSFORMERS_NO_ADVISORY_WARNINGS"
    before = os.environ.get(key)
    os.environ[key] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def _load_pretrained(directory: Path) -> Any:
    """transformers' fast tokenizer of a local directory (tokenizer.json + its config files)."""
    with _quiet_transformers():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(directory), local_files_only=True)


class HFTokenizer:
    """A Hugging Face tokenizer: a `tokenizer.json` file, or a directory (see the module doc).

    File: special tokens are found by name (`bos`/`eos`/`pad` arguments, else common spellings
    such as `<|endoftext|>` or `</s>`). Directory: they are `tokenizer_config.json`'s
    `bos_token` / `eos_token` / `pad_token` (the arguments override them). An EOS token is
    required: it ends every document. Without a BOS token documents start directly; without
    PAD, EOS pads.
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
        self._hf: Any = None
        if self.path.is_dir():
            if not (self.path / TOKENIZER_FILE).is_file():
                raise FileNotFoundError(
                    f"data.tokenizer: the directory {self.path} has no {TOKENIZER_FILE} (a "
                    "Hugging Face fast tokenizer is needed; save one with "
                    "`tokenizer.save_pretrained(dir)` in transformers)"
                )
            self._hf = _load_pretrained(self.path)
            self._tok = self._hf.backend_tokenizer
            bos = bos or self._hf.bos_token
            eos = eos or self._hf.eos_token
            pad = pad or self._hf.pad_token
        elif self.path.is_file():
            self._tok = _Tok.from_file(str(self.path))
        else:
            raise FileNotFoundError(
                f"data.tokenizer: no tokenizer file or directory at {self.path}"
            )
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.chat_template: str | None = None
        if self._hf is not None:
            template = self._hf.chat_template
            self.chat_template = template if isinstance(template, str) else None
            self.bos_id = self._find(bos, ()) if bos else None
            if not eos:
                raise ValueError(
                    f"{self.path}: tokenizer_config.json names no eos_token: add one (e.g. "
                    '"eos_token": "<|endoftext|>"); it separates packed documents'
                )
            self.eos_id = int(self._find(eos, ()))  # type: ignore[arg-type]
            self.pad_id = self.eos_id if not pad else int(self._find(pad, ()))  # type: ignore[arg-type]
            return
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

    def render_chat(
        self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = False
    ) -> str:
        """`apply_chat_template(messages, tokenize=False, add_generation_prompt=...)`."""
        if self._hf is None or self.chat_template is None:
            raise _no_template(f"the tokenizer {self.path}")
        text = self._hf.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return str(text)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


def build_tokenizer(spec: str) -> Tokenizer:
    """`byte` → `ByteTokenizer`; anything else is a `tokenizer.json` file or a directory."""
    if spec == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec)

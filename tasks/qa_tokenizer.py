"""The QA task's tokenizer: the Rust ``tokenizers`` library and the few settings kept beside it.

``QATokenizer.from_dir`` reads a folder written by transformers' ``save_pretrained`` (as
prepare_model.py does) without importing transformers: ``tokenizer.json`` for the tokenizer
itself, ``tokenizer_config.json`` and ``special_tokens_map.json`` for the pad and CLS tokens,
padding and truncation sides and ``model_max_length``, read as transformers reads them (the
special tokens map wins over the config). ``from_transformers`` takes the same from a loaded
``PreTrainedTokenizerFast``, for tests that compare with transformers' pipeline.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
UNLIMITED_LENGTH = int(1e30)  # transformers' model_max_length when a folder names none

# Pieces of a tokenizer under which an ASCII text of c characters has at most c tokens: these
# normalizers never lengthen ASCII text, these pre-tokenizers only split it, and WordPiece
# gives each token at least one character of a word (or one [UNK] for the whole word).
_ASCII_SAFE_NORMALIZERS = frozenset({"BertNormalizer", "Lowercase", "NFC", "NFD", "NFKC", "NFKD",
                                     "StripAccents", "Strip"})
SPLIT_ONLY_PRE_TOKENIZERS = frozenset({"BertPreTokenizer", "Whitespace", "WhitespaceSplit",
                                        "Punctuation", "Digits"})


@dataclass(frozen=True, kw_only=True, eq=False)
class QATokenizer:
    """A Rust tokenizer (never changed after loading) and what the QA task needs beside it.

    Attributes:
        backend: The tokenizer as saved; use ``copy`` for one with other settings.
        pad_id: Id of the pad token (0 when the tokenizer has none).
        cls_id: Id of the CLS token, or None.
        padding_side, truncation_side: "right" or "left".
        model_max_length: Most tokens the model accepts.
    """

    backend: Tokenizer
    pad_id: int
    cls_id: int | None
    padding_side: str = "right"
    truncation_side: str = "right"
    model_max_length: int = UNLIMITED_LENGTH

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> QATokenizer:
        """Load the tokenizer that ``save_pretrained`` wrote into ``model_dir``.

        Raises:
            ValueError: The folder has no ``tokenizer.json`` (no fast tokenizer), or names a pad
                or CLS token that its vocabulary lacks (transformers would add one, with an id
                the model has no embedding for).
        """
        folder = Path(model_dir)
        if not (folder / TOKENIZER_FILE).is_file():
            raise ValueError(f"QATask needs a fast tokenizer ({TOKENIZER_FILE}); "
                             f"{folder.resolve()} has none")
        backend = Tokenizer.from_file(str(folder / TOKENIZER_FILE))
        config = {**_read_json(folder / CONFIG_FILE), **_read_json(folder / SPECIAL_TOKENS_FILE)}
        pad_id = _token_id(backend, config.get("pad_token"))
        return cls(backend=backend, pad_id=pad_id if pad_id is not None else 0,
                   cls_id=_token_id(backend, config.get("cls_token")),
                   padding_side=config.get("padding_side", "right"),
                   truncation_side=config.get("truncation_side", "right"),
                   model_max_length=int(config.get("model_max_length") or UNLIMITED_LENGTH))

    @classmethod
    def from_transformers(cls, tokenizer: Any) -> QATokenizer:
        """The same from a loaded transformers tokenizer (``PreTrainedTokenizerFast``).

        Raises:
            ValueError: A slow (Python) tokenizer.
        """
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("QATask needs a fast tokenizer (tokenizer.json); got a slow one")
        backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
        pad_id = tokenizer.pad_token_id
        return cls(backend=backend, pad_id=pad_id if pad_id is not None else 0,
                   cls_id=tokenizer.cls_token_id, padding_side=tokenizer.padding_side,
                   truncation_side=tokenizer.truncation_side,
                   model_max_length=int(tokenizer.model_max_length or UNLIMITED_LENGTH))

    @property
    def pair_specials(self) -> int:
        """Special tokens added around a (question, context) pair."""
        return self.backend.num_special_tokens_to_add(True)

    def token_to_id(self, token: str) -> int | None:
        """The id of ``token`` in the vocabulary, or None."""
        return self.backend.token_to_id(token)

    def convert_tokens_to_ids(self, token: str) -> int | None:
        """``token_to_id`` under transformers' name, for code written against its tokenizers."""
        return self.token_to_id(token)

    def copy(self, max_length: int | None = None, stride: int = 0) -> Tokenizer:
        """A private copy of the backend: no padding; truncation of the second sequence only, to
        ``max_length`` with ``stride`` overlap, when given; special tokens written in the text
        stay special."""
        backend = Tokenizer.from_str(self.backend.to_str())
        backend.no_padding()
        backend.no_truncation()
        if max_length is not None:
            backend.enable_truncation(max_length, stride=stride, strategy="only_second",
                                      direction=self.truncation_side)
        backend.encode_special_tokens = False
        return backend

    def ascii_tokens_at_most_chars(self) -> bool:
        """True when this tokenizer provably gives an ASCII text of c characters at most c
        tokens (without special tokens), so that such a text's token count needs no encode."""
        spec = json.loads(self.backend.to_str())
        return (spec.get("model", {}).get("type") == "WordPiece"
                and made_of(spec.get("normalizer"), "normalizers", _ASCII_SAFE_NORMALIZERS)
                and made_of(spec.get("pre_tokenizer"), "pretokenizers", SPLIT_ONLY_PRE_TOKENIZERS))


def made_of(component: dict[str, Any] | None, members: str, kinds: frozenset[str]) -> bool:
    """True if ``component`` (a tokenizer.json part, whose Sequence lists its parts under
    ``members``) is absent, one of ``kinds``, or a Sequence of only those."""
    if component is None:
        return True
    if component.get("type") == "Sequence":
        return all(made_of(part, members, kinds) for part in component.get(members, []))
    return component.get("type") in kinds


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; empty when the file does not exist."""
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _token_id(backend: Tokenizer, token: str | dict[str, Any] | None) -> int | None:
    """The id of a token named in a config (a string or a saved AddedToken); None when no
    token is named.

    Raises:
        ValueError: The vocabulary lacks the token.
    """
    if isinstance(token, dict):
        token = token.get("content")
    if not isinstance(token, str):
        return None
    found = backend.token_to_id(token)
    if found is None:
        raise ValueError(f"the tokenizer's configuration names {token!r}, which is not in its "
                         "vocabulary")
    return found

"""A tokenizer that needs no download: a fixed vocabulary for the XRD task, <= 256 ids.

The ``xrd-tiny`` vocabulary (ids are stable; changing them invalidates weights)::

    0..15     special tokens: <pad> <eos> <bos> <unk>, chat roles, tool-call and answer tags
    16..112   printable ASCII (32..126), newline and tab: the fallback, so text round-trips
    113..193  the integers 10..90 as single tokens (peak positions in degrees 2-theta)
    194..255  words: chemical element symbols of two letters, task words, tool names

Encoding is greedy longest match over the vocabulary (special tokens first), so
``decode(encode(text)) == text`` for printable ASCII with newlines and tabs; any other
character becomes ``<unk>`` (lossy, and the only lossy case).  The file format is one JSON object
(``neon_tokenizer.json``: ``{"format": "neon-tokenizer", "version": 1, "name", "tokens",
"special"}``); it sits next to HF weights so an engine loads the matching vocabulary.
Real models use their own HF tokenizer through :func:`load_tokenizer` (``HFTokenizer``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

FILE_NAME = "neon_tokenizer.json"
FORMAT = "neon-tokenizer"
VERSION = 1

SPECIAL_TOKENS = [
    "<pad>", "<eos>", "<bos>", "<unk>",
    "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>",
    "<tool_call>", "</tool_call>", "<answer>", "</answer>",
    "<reserved_13>", "<reserved_14>", "<reserved_15>",
]

# Two-letter element symbols common in inorganic synthesis (one-letter ones are characters).
_ELEMENTS2 = [
    "Li", "Be", "Na", "Mg", "Al", "Si", "Cl", "Ca", "Sc", "Ti", "Cr", "Mn", "Fe", "Co", "Ni",
    "Cu", "Zn", "Ga", "Ge", "Se", "Sr", "Zr", "Nb", "Mo", "Ag", "Cd", "In", "Sn", "Sb", "Ba",
    "La", "Ce", "Nd", "Pb", "Bi", "Ta", "Hf", "Cs", "Rb", "As",
]
_WORDS = [
    "peaks", "elements", "phases", "phase", "candidates", "fraction", "wt%",
    "search", "simulate", "fit", "find", "compare", "pattern", "error", "answer",
    "none", "find_peaks", "search_phases", "simulate_pattern", "fit_phases",
    "anatase", "rutile",
]


def _xrd_tiny_tokens() -> list[str]:
    chars = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
    numbers = [str(n) for n in range(10, 91)]
    return SPECIAL_TOKENS + chars + numbers + _ELEMENTS2 + _WORDS


class TokenizerError(ValueError):
    """A tokenizer file or vocabulary is invalid; the message names the file and the fix."""


class Tokenizer:
    """Greedy longest-match tokenizer over a fixed vocabulary of strings."""

    def __init__(self, tokens: list[str], name: str = "custom", special: Iterable[str] = SPECIAL_TOKENS):
        if len(set(tokens)) != len(tokens):
            dup = sorted({t for t in tokens if tokens.count(t) > 1})
            raise TokenizerError(f"tokenizer {name!r}: duplicate tokens {dup[:5]}")
        self.name = name
        self.tokens = list(tokens)
        self.special = [t for t in special if t in tokens]
        self.id_of = {t: i for i, t in enumerate(self.tokens)}
        missing = [t for t in ("<pad>", "<eos>", "<bos>", "<unk>") if t not in self.id_of]
        if missing:
            raise TokenizerError(f"tokenizer {name!r}: missing required special tokens {missing}")
        self._max_len = max(len(t) for t in self.tokens)
        self._special_set = set(self.special)

    # --- well-known ids ------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @property
    def pad_id(self) -> int:
        return self.id_of["<pad>"]

    @property
    def eos_id(self) -> int:
        return self.id_of["<eos>"]

    @property
    def bos_id(self) -> int:
        return self.id_of["<bos>"]

    @property
    def unk_id(self) -> int:
        return self.id_of["<unk>"]

    def token_id(self, token: str) -> int:
        """Id of one whole vocabulary entry (e.g. ``"<answer>"``); KeyError names it."""
        try:
            return self.id_of[token]
        except KeyError:
            raise KeyError(f"tokenizer {self.name!r} has no token {token!r}") from None

    # --- text <-> ids --------------------------------------------------------------------
    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Greedy longest match; special-token strings map to their ids when ``allow_special``."""
        ids: list[int] = []
        i, n = 0, len(text)
        while i < n:
            tid, width = self._match(text, i, allow_special)
            ids.append(tid)
            i += width
        return ids

    def _match(self, text: str, i: int, allow_special: bool) -> tuple[int, int]:
        for width in range(min(self._max_len, len(text) - i), 0, -1):
            piece = text[i:i + width]
            tid = self.id_of.get(piece)
            if tid is not None and (allow_special or piece not in self._special_set or width == 1):
                return tid, width
        return self.unk_id, 1

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < len(self.tokens):
                out.append("<unk>")  # ids beyond the vocabulary (model vocab may be padded)
                continue
            tok = self.tokens[i]
            if skip_special and tok in self._special_set:
                continue
            out.append(tok)
        return "".join(out)

    # --- files ---------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "name": self.name,
                "tokens": self.tokens, "special": self.special}

    def save(self, directory: str | os.PathLike) -> Path:
        """Write ``neon_tokenizer.json`` into ``directory`` (atomically) and return its path."""
        from neon_hpc.protocol.rundir import atomic_write_json  # deferred: heavy (neon_hpc.protocol.rundir: pydantic)
        path = Path(directory) / FILE_NAME
        atomic_write_json(path, self.to_json())
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Tokenizer":
        """Load from a ``neon_tokenizer.json`` file or a directory that holds one."""
        path = Path(path)
        if path.is_dir():
            path = path / FILE_NAME
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise TokenizerError(f"{path}: no tokenizer file; save one with Tokenizer.save(dir) "
                                 f"or use load_tokenizer('xrd-tiny')") from None
        except json.JSONDecodeError as e:
            raise TokenizerError(f"{path}: not valid JSON ({e})") from e
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise TokenizerError(f"{path}: not a neon tokenizer file (expected format {FORMAT!r})")
        if data.get("version") != VERSION:
            raise TokenizerError(f"{path}: tokenizer file version {data.get('version')!r}, "
                                 f"this code reads version {VERSION}")
        tokens = data.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, str) and t for t in tokens):
            raise TokenizerError(f"{path}: 'tokens' must be a list of non-empty strings")
        return cls(tokens, name=str(data.get("name", "custom")), special=data.get("special", SPECIAL_TOKENS))

    def __repr__(self) -> str:
        return f"Tokenizer(name={self.name!r}, vocab_size={self.vocab_size})"


class HFTokenizer:
    """A local HF tokenizer (a real model's) behind the same small interface.

    Only for evaluating real models; special tags are whatever the model's chat format
    uses, so the agent's token-level template is the ``xrd-tiny`` one only for our models.
    """

    def __init__(self, path: str):
        from transformers import AutoTokenizer  # deferred: heavy (transformers)
        self.name = str(path)
        self._tok = self.hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.vocab_size = len(self._tok)
        self.eos_id = self._tok.eos_token_id
        self.pad_id = self._tok.pad_token_id if self._tok.pad_token_id is not None else self.eos_id
        self.bos_id = self._tok.bos_token_id if self._tok.bos_token_id is not None else self.eos_id

    def token_id(self, token: str) -> int:
        tid = self._tok.convert_tokens_to_ids(token)
        if tid is None or tid == self._tok.unk_token_id:
            raise KeyError(f"tokenizer {self.name!r} has no token {token!r}")
        return tid

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)


def xrd_tiny() -> Tokenizer:
    return Tokenizer(_xrd_tiny_tokens(), name="xrd-tiny")


def load_tokenizer(name: str = "xrd-tiny"):
    """``"xrd-tiny"`` (built in), a directory or file with ``neon_tokenizer.json``, or a local
    HF tokenizer directory (real models; nothing is downloaded)."""
    if name == "xrd-tiny":
        return xrd_tiny()
    p = Path(name)
    if (p.is_dir() and (p / FILE_NAME).exists()) or (p.is_file() and p.name.endswith(".json")):
        return Tokenizer.load(p)
    if p.is_dir():
        return HFTokenizer(str(p))
    raise TokenizerError(f"unknown tokenizer {name!r}: use 'xrd-tiny', a directory holding "
                         f"{FILE_NAME}, or a local HF tokenizer directory")

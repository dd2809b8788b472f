"""The served model's tokenizer files, loaded from the same files as its weights.

A Hugging Face folder already holds `tokenizer.json` and `tokenizer_config.json`. A GGUF
file holds only the vocabulary as metadata; transformers turns that into a tokenizer in
seconds, so that is done once and its `tokenizer.json` (+ config and chat template) kept
in a cache folder keyed by the file's content. Serving then loads the fast Rust
`tokenizers.Tokenizer` from that folder: transformers stays out of the serving path.

The gateway adds chat-template rendering (`services/gateway/tokenizer.py`); the worker takes
token bytes and marker ids for grammars and regions; `spillway bench` encodes its prompts.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import uuid
from functools import cache
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from spillway.shared.model_files import ModelSource

log = logging.getLogger(__name__)

# Bumped when the layout of a cached folder changes, so old folders are not reused.
CACHE_FORMAT = 1
# The GGUF metadata (vocabulary, merges, template) sits at the head of the file.
_GGUF_HASHED_BYTES = 16 << 20
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class LoadedTokenizer:
    """Encoding, decoding and per-token bytes for one model, and its chat template's text."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        special_tokens: dict[str, str | None],
        chat_template: str | None,
    ) -> None:
        self.tokenizer = tokenizer
        self.special_tokens = special_tokens
        self.chat_template_source = chat_template
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._byte_level = _uses_byte_level(tokenizer)
        added = tokenizer.get_added_tokens_decoder()
        self._added = {token_id: token.content for token_id, token in added.items()}
        self.special_ids = frozenset(i for i, token in added.items() if token.special)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes one token stands for (a piece of a character for byte tokens)."""
        return _token_bytes(self, token_id)


@cache
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of the GPT-2 byte-level alphabet: printable stand-ins for all 256 bytes."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _uses_byte_level(tokenizer: Tokenizer) -> bool:
    if tokenizer.decoder is None:
        return False
    decoder = json.loads(tokenizer.decoder.__getstate__())
    if decoder.get("type") == "ByteLevel":
        return True
    return any(d.get("type") == "ByteLevel" for d in decoder.get("decoders") or [])


def _token_bytes(tok: LoadedTokenizer, token_id: int) -> bytes:
    if token_id in tok._added:
        return tok._added[token_id].encode()
    piece = tok.tokenizer.id_to_token(token_id)
    if piece is None:
        return b""
    if tok._byte_level:
        table = _unicode_to_byte()
        if all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return piece.encode()
    # SentencePiece: "<0xNN>" byte-fallback pieces and "▁" for a space.
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        with contextlib.suppress(ValueError):
            return bytes([int(piece[3:5], 16)])
    return piece.replace("\u2581", " ").encode()


# --- loading ---------------------------------------------------------------------------


def load_tokenizer(source: ModelSource, cache_dir: str | Path) -> LoadedTokenizer:
    """The tokenizer of `source`; a GGUF (or a folder without tokenizer.json) is converted
    once into `cache_dir`/tokenizers/<content key>/ and loaded from there afterwards."""
    if source.kind == "hf" and (source.path / "tokenizer.json").is_file():
        return load_tokenizer_folder(source.path)
    folder = cache_folder(source, cache_dir)
    if not (folder / "tokenizer.json").is_file():
        log.info("converting the tokenizer of %s once into %s", source.path, folder)
        convert_tokenizer(source, folder)
    return load_tokenizer_folder(folder)


def cache_folder(source: ModelSource, cache_dir: str | Path) -> Path:
    """Where the tokenizer converted from `source` is kept (keyed by its content)."""
    return Path(cache_dir).expanduser() / "tokenizers" / cache_key(source)


def load_tokenizer_folder(folder: Path) -> LoadedTokenizer:
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    special = {name: _token_content(config.get(name)) for name in SPECIAL_TOKEN_NAMES}
    return LoadedTokenizer(tokenizer, special, _chat_template_of(folder, config))


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):  # older transformers save AddedToken fields
        return value.get("content")
    return value if isinstance(value, str) else None


def _chat_template_of(folder: Path, config: dict[str, Any]) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the "default" one serves chat
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    if isinstance(template, str):
        return template
    json_file = folder / "chat_template.json"
    if json_file.is_file():
        return json.loads(json_file.read_text()).get("chat_template")
    return None


def cache_key(source: ModelSource) -> str:
    digest = hashlib.sha256(f"spillway-tokenizer-{CACHE_FORMAT}".encode())
    if source.kind == "gguf":
        digest.update(str(source.path.stat().st_size).encode())
        with source.path.open("rb") as f:
            digest.update(f.read(_GGUF_HASHED_BYTES))
    else:
        for path in sorted(source.path.glob("*token*")):
            stat = path.stat()
            digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return f"{source.model_id}-{digest.hexdigest()[:16]}"


def _gguf_tokenizer(path: Path) -> Any:
    """transformers' tokenizer of a GGUF file: AutoTokenizer's class for the model it reads
    the file as, or, for an architecture its GGUF loader does not read (deepseek2), the
    generic fast tokenizer, built from the file's tokenizer keys by the same converter."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from spillway.shared.gguf_arch import GGUF_ARCHITECTURES
    from spillway.shared.model_config import gguf_fields

    arch = GGUF_ARCHITECTURES.get(str(gguf_fields(path).get("general.architecture")))
    if arch is not None and not arch.transformers_loads:
        return PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def convert_tokenizer(source: ModelSource, folder: Path) -> Any:
    """Builds the tokenizer with transformers and saves it into `folder`, atomically (a
    concurrent conversion of the same model just loses the race). Returns transformers'
    tokenizer, the reference the tests compare against."""
    try:
        from transformers import AutoTokenizer
    except ImportError as e:  # transformers is needed for this one-time step only
        raise RuntimeError(
            f"converting the tokenizer of {source.path} needs the `transformers` package"
            " once; install it (`make install` does) or serve a folder with tokenizer.json"
        ) from e
    if source.kind == "gguf":
        hf = _gguf_tokenizer(source.path)
    else:
        hf = AutoTokenizer.from_pretrained(str(source.path))
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = folder.parent / f".{folder.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    try:
        hf.save_pretrained(str(staging))
        if hf.chat_template and not (staging / "chat_template.jinja").is_file():
            (staging / "chat_template.jinja").write_text(hf.chat_template)
        try:
            staging.rename(folder)
        except OSError:
            if not (folder / "tokenizer.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return hf

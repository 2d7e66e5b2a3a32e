"""The project's byte-level tokenizer and a thin wrapper over any Hugging Face tokenizer.json.

Byte tokenizer layout (vocab_size 260): ids 0..255 are the byte values themselves
(id == byte), then the special tokens 256 `<|endoftext|>`, 257 `<|im_start|>`,
258 `<|im_end|>`, 259 `<|pad|>`. It is stored as a plain `tokenizers` BPE model with no
merges over the GPT-2 byte-to-unicode alphabet, so `tokenizers.Tokenizer.from_file` and
`transformers.PreTrainedTokenizerFast(tokenizer_file=...)` load it unchanged.

`python -m backend.tokenizer --write DIR` writes DIR/tokenizer.json and tokenizer_config.json.
"""

from __future__ import annotations

import argparse
import json
import re
from functools import cached_property
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from backend.detokenize import DEFAULT_CONTEXT_LEN, IncrementalDecoder

NUM_BYTES = 256
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")
BYTE_VOCAB_SIZE = NUM_BYTES + len(SPECIAL_TOKENS)
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"

# Fallbacks for tokenizer.json files that come without a tokenizer_config.json.
_EOS_CANDIDATES = ("<|endoftext|>", "<|im_end|>", "</s>", "<eos>")
_PAD_CANDIDATES = ("<|pad|>", "<pad>", "<|endoftext|>")
# Qwen's ChatML layout, spelled with the byte tokenizer's special tokens; with `tools`, Qwen's
# (Hermes) tool-calling layout: the tools' signatures in the system turn, an assistant's calls as
# <tool_call> JSON objects, tool results as <tool_response> in a user turn.
CHATML_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ message['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{% if not loop.first or message['content'] %}{{ '\\n' }}{% endif %}"
    "<tool_call>\n{\"name\": \"{{ call['function']['name'] }}\", \"arguments\": "
    "{{ call['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from each byte to a printable unicode character.

    Printable Latin-1 bytes map to themselves; the other bytes are shifted to 256 + n so that
    no byte becomes whitespace or a control character (the ByteLevel components expect this).
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), ord("\xff") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    num_shifted = 0
    for b in range(NUM_BYTES):
        if b not in mapping:
            mapping[b] = chr(NUM_BYTES + num_shifted)
            num_shifted += 1
    return mapping


def build_byte_tokenizer() -> tokenizers.Tokenizer:
    """The project's byte tokenizer: id b is byte b, special tokens from id 256."""
    byte_chars = bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(NUM_BYTES)}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split and no prefix space: the text is mapped byte for byte.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    if ids != list(range(NUM_BYTES, BYTE_VOCAB_SIZE)):
        raise ValueError(f"special token ids {ids} are not 256..259")
    return tok


class Tokenizer:
    """Encode/decode plus the ids the serving path needs (eos, pad, special tokens)."""

    def __init__(
        self,
        tok: tokenizers.Tokenizer,
        eos_token: str | None = None,
        pad_token: str | None = None,
    ) -> None:
        self.tok = tok
        self.eos_token = eos_token or self._first_known(_EOS_CANDIDATES)
        self.pad_token = pad_token or self._first_known(_PAD_CANDIDATES) or self.eos_token

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self.tok.token_to_id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return None if self.pad_token is None else self.tok.token_to_id(self.pad_token)

    @property
    def special_tokens(self) -> dict[str, int]:
        """Special token text -> id."""
        added = self.tok.get_added_tokens_decoder()
        return {t.content: i for i, t in added.items() if t.special}

    def token_id(self, token: str) -> int:
        """Id of a token (special or not); ValueError if the vocabulary lacks it."""
        token_id = self.tok.token_to_id(token)
        if token_id is None:
            raise ValueError(f"token {token!r} is not in the vocabulary (size {self.vocab_size})")
        return token_id

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; bytes that are not valid UTF-8 come out as U+FFFD."""
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, alone: an added token's text; a byte-level
        piece mapped back through GPT-2's byte alphabet; a SentencePiece byte-fallback piece
        (`<0xE2>`) its byte, any other piece with `▁` as a space. A token's bytes need not be
        valid UTF-8 on their own (a character split over tokens); b"" for an unknown id."""
        piece = self.tok.id_to_token(token_id)
        if piece is None:
            return b""
        byte = _BYTE_PIECE.fullmatch(piece)
        if byte:
            return bytes([int(byte.group(1), 16)])
        if token_id in self._added_ids:
            return piece.encode("utf-8")
        if self._byte_level and all(c in _BYTE_DECODER for c in piece):
            return bytes(_BYTE_DECODER[c] for c in piece)
        return piece.replace("\u2581", " ").encode("utf-8")

    def shown_bytes(self, token_id: int, skip_special_tokens: bool = True) -> bytes:
        """What `token_id` adds to `decode`'s UTF-8 where `decodes_bytes`: its bytes, or b""
        for a special token that is skipped."""
        if skip_special_tokens and token_id in self._special_ids:
            return b""
        return self.token_bytes(token_id)

    @cached_property
    def decodes_bytes(self) -> bool:
        """Whether `decode(ids)` is the UTF-8 of the ids' `token_bytes` joined, invalid bytes
        as U+FFFD: a ByteLevel decoder alone (GPT-2, Llama 3, Qwen, the byte tokenizer)."""
        return self._decoder.get("type") == "ByteLevel"

    @cached_property
    def _decoder(self) -> dict:
        """The tokenizer's decoder as tokenizer.json writes it ({} for none)."""
        return json.loads(self.tok.to_str()).get("decoder") or {}

    @cached_property
    def _special_ids(self) -> frozenset[int]:
        return frozenset(self.special_tokens.values())

    @cached_property
    def _added_ids(self) -> frozenset[int]:
        return frozenset(self.tok.get_added_tokens_decoder())

    @cached_property
    def _byte_level(self) -> bool:
        """Whether the decoder maps pieces through the byte alphabet (GPT-2, Llama 3, Qwen)."""
        decoder = self._decoder
        parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" \
            else [decoder]
        return any(isinstance(p, dict) and p.get("type") == "ByteLevel" for p in parts)

    def incremental_decoder(
        self, skip_special_tokens: bool = True, context_len: int = DEFAULT_CONTEXT_LEN
    ) -> IncrementalDecoder:
        """A streaming detokenizer fed one or more ids at a time."""
        return IncrementalDecoder(self.decode, skip_special_tokens, context_len)

    def _first_known(self, candidates: tuple[str, ...]) -> str | None:
        return next((t for t in candidates if self.tok.token_to_id(t) is not None), None)


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_BYTE_DECODER = {c: b for b, c in bytes_to_unicode().items()}


def byte_tokenizer() -> Tokenizer:
    """The byte tokenizer wrapped, built in memory."""
    return Tokenizer(build_byte_tokenizer(), "<|endoftext|>", "<|pad|>")


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a directory holding tokenizer.json (and optionally tokenizer_config.json) or the file.

    Raises FileNotFoundError when the file is missing and ValueError when it cannot be parsed.
    """
    path = Path(path)
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer file at {file} (from path {path})")
    try:
        tok = tokenizers.Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises a bare Exception for bad JSON
        raise ValueError(f"cannot read tokenizer {file}: {exc}") from exc
    eos_token, pad_token = _read_special_names(file.parent / TOKENIZER_CONFIG_FILE)
    return Tokenizer(tok, eos_token, pad_token)


def _read_special_names(config_file: Path) -> tuple[str | None, str | None]:
    """eos/pad token text from a transformers tokenizer_config.json, if there is one."""
    if not config_file.is_file():
        return None, None
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read tokenizer config {config_file}: {exc}") from exc
    return token_text(config.get("eos_token")), token_text(config.get("pad_token"))


def token_text(entry: object) -> str | None:
    # transformers writes either "<tok>" or {"content": "<tok>", ...}.
    if isinstance(entry, dict):
        entry = entry.get("content")
    return entry if isinstance(entry, str) else None


def byte_tokenizer_config() -> dict[str, object]:
    """tokenizer_config.json for transformers' AutoTokenizer (Triton's OpenAI frontend uses it)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|pad|>",
        "model_max_length": 1 << 20,
        "chat_template": CHATML_TEMPLATE,
    }


def write_byte_tokenizer(directory: str | Path) -> Path:
    """Write tokenizer.json and tokenizer_config.json into `directory` (created if needed)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    file = directory / TOKENIZER_FILE
    build_byte_tokenizer().save(str(file), pretty=True)
    config = json.dumps(byte_tokenizer_config(), indent=2, ensure_ascii=False)
    (directory / TOKENIZER_CONFIG_FILE).write_text(config + "\n", encoding="utf-8")
    return file


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", metavar="DIR", required=True, help="write DIR/tokenizer.json")
    args = parser.parse_args(argv)
    print(write_byte_tokenizer(args.write))


if __name__ == "__main__":
    main()

"""Tokenizers for the server: the embedded models' bytes, a checkpoint's ``tokenizer.json``
(tokenizers) or Kimi's ``tiktoken.model`` with ``tokenizer_config.json`` (tiktoken), chat templates
(jinja2), and incremental detokenization that never splits a character."""

from __future__ import annotations

import functools
import json
import logging
import os

from serving.engine import EMBEDDED, RequestError
from serving.http_base import APIError

log = logging.getLogger("k3jax.server")


class ByteTokenizer:
    """UTF-8 bytes as token ids (the embedded default model's vocabulary of 256)."""

    vocab_size = 256
    chat_template = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def token_bytes(self, tok: int) -> bytes:
        return bytes([tok]) if 0 <= tok < 256 else b""


class HFTokenizer:
    """A checkpoint directory's ``tokenizer.json`` through ``tokenizers``; the chat template from
    its ``tokenizer_config.json`` when there is one."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(path)
        self.chat_template, self.special = None, {}
        cfg_path = os.path.join(os.path.dirname(path), "tokenizer_config.json")
        if os.path.exists(cfg_path):
            with open(cfg_path) as f:
                cfg = json.load(f)
            self.chat_template = cfg.get("chat_template")
            for k in ("bos_token", "eos_token"):
                v = cfg.get(k)
                self.special[k] = v.get("content") if isinstance(v, dict) else v

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)

    def token_bytes(self, tok: int) -> bytes:
        """The token's bytes: through GPT-2's byte-to-character map for byte-level BPE (so a piece
        of a character keeps its bytes), else its decoded text."""
        from tokenizers import decoders

        piece = self.tok.id_to_token(tok)
        if piece is None:
            return b""
        if isinstance(self.tok.decoder, decoders.ByteLevel):
            inv = _unicode_to_bytes()
            if all(ch in inv for ch in piece):
                return bytes(inv[ch] for ch in piece)
        return self.tok.decode([tok], skip_special_tokens=False).encode()


class TiktokenTokenizer:
    """Kimi's tokenizer: ``tiktoken.model`` (BPE ranks) through ``tiktoken`` with the split pattern of
    Moonshot's ``tokenization_kimi.py``; the 256 ids after the base vocabulary are special tokens
    named by ``tokenizer_config.json``'s ``added_tokens_decoder`` (``<|reserved_token_{id}|>``
    otherwise), which also gives the chat template. Special tokens written in the text (as chat
    templates write them) are encoded as such."""

    PAT_STR = "|".join([
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ])
    NUM_RESERVED_SPECIAL = 256

    def __init__(self, directory: str):
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        ranks = load_tiktoken_bpe(os.path.join(directory, "tiktoken.model"))
        cfg_path = os.path.join(directory, "tokenizer_config.json")
        cfg = {}
        if os.path.exists(cfg_path):
            with open(cfg_path) as f:
                cfg = json.load(f)
        added = {int(k): (v.get("content") if isinstance(v, dict) else v)
                 for k, v in cfg.get("added_tokens_decoder", {}).items()}
        n = len(ranks)
        ids = sorted(set(range(n, n + self.NUM_RESERVED_SPECIAL)) | {i for i in added if i >= n})
        specials = {added.get(i) or f"<|reserved_token_{i}|>": i for i in ids}
        self.enc = tiktoken.Encoding(name=os.path.basename(os.path.abspath(directory)), pat_str=self.PAT_STR,
                                     mergeable_ranks=ranks, special_tokens=specials)
        self.valid = set(range(n)) | set(specials.values())
        self.chat_template = cfg.get("chat_template")
        self.special = {}
        for k in ("bos_token", "eos_token"):
            v = cfg.get(k)
            self.special[k] = v.get("content") if isinstance(v, dict) else v

    def encode(self, text: str) -> list[int]:
        return self.enc.encode(text, allowed_special="all")

    def decode(self, ids: list[int]) -> str:
        return self.enc.decode([i for i in ids if i in self.valid], errors="replace")

    def token_bytes(self, tok: int) -> bytes:
        return self.enc.decode_single_token_bytes(tok) if tok in self.valid else b""


class NoTokenizer:
    """For checkpoints without a tokenizer file: prompts must be token-id lists."""

    chat_template = None

    def encode(self, text: str) -> list[int]:
        raise RequestError("this model has no tokenizer (no tokenizer.json or tiktoken.model in its directory): "
                           "send the prompt as token ids")

    def decode(self, ids: list[int]) -> str:
        return ""


@functools.cache
def _unicode_to_bytes() -> dict[str, int]:
    """The inverse of GPT-2's ``bytes_to_unicode`` (the byte-level BPE alphabet)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


def token_text_bytes(tokenizer, tok: int) -> tuple[str, list[int]]:
    """A token as log probabilities name it: its text, or ``"bytes:\\xNN..."`` when its bytes are
    not whole UTF-8 (a piece of a character), and its bytes; ``"token_id:N"`` without a tokenizer."""
    fn = getattr(tokenizer, "token_bytes", None)
    if fn is None:
        return f"token_id:{tok}", []
    raw = fn(tok)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return text, list(raw)


def load_tokenizer(model: str):
    """The embedded model's byte tokenizer, a checkpoint's ``tokenizer.json`` (tokenizers) or
    ``tiktoken.model`` (Kimi, tiktoken), or :class:`NoTokenizer`."""
    if model in EMBEDDED:
        return ByteTokenizer()
    path = os.path.join(model, "tokenizer.json")
    if os.path.exists(path):
        return HFTokenizer(path)
    if os.path.exists(os.path.join(model, "tiktoken.model")):
        return TiktokenTokenizer(model)
    log.warning("no tokenizer.json or tiktoken.model in %s: prompts must be token-id lists", model)
    return NoTokenizer()


def render_chat(tokenizer, messages: list[dict]) -> str:
    """The prompt text for ``messages``: the tokenizer's jinja2 chat template (as transformers
    renders it, with ``add_generation_prompt``), else ``"{role}: {content}\\n"`` lines and ``"assistant:"``."""
    template = getattr(tokenizer, "chat_template", None)
    if template:
        try:
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:  # pragma: no cover - jinja2 is a dependency of the chat-template path only
            raise APIError(500, "this model's chat template needs jinja2 (pip install jinja2)") from None

        def raise_exception(msg):
            raise jinja2.TemplateError(msg)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                                    **getattr(tokenizer, "special", {}))
        except jinja2.TemplateError as e:
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


class Detokenizer:
    """Incremental detokenization that never splits a character: text is released only once it
    does not end in an incomplete UTF-8 sequence (decoded as U+FFFD); the previous piece is
    decoded with the new tokens so tokenizers that strip leading spaces keep them."""

    def __init__(self, tokenizer):
        self.tok, self.ids, self.prefix, self.read = tokenizer, [], 0, 0

    def add(self, tok: int) -> str:
        self.ids.append(tok)
        return self._delta(final=False)

    def flush(self) -> str:
        return self._delta(final=True)

    def _delta(self, final: bool) -> str:
        if self.read == len(self.ids):
            return ""
        before = self.tok.decode(self.ids[self.prefix : self.read])
        now = self.tok.decode(self.ids[self.prefix :])
        if len(now) > len(before) and (final or not now.endswith("\ufffd")):
            self.prefix, self.read = self.read, len(self.ids)
            return now[len(before):]
        if final:
            self.prefix = self.read = len(self.ids)
        return ""

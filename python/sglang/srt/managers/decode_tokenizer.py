"""What the detokenizer decodes with, without importing transformers (or torch) in its process.

The HTTP process loads the tokenizer anyway; once it has, it sends the detokenizer a `DecoderSpec`: its
tokenizer's backend (the `tokenizers` library's `Tokenizer`, as transformers built it: its added and
special tokens included) serialized, where transformers' `decode` is exactly that backend's `decode` (a
`TokenizersBackend` whose decode nobody overrides, no cleanup of tokenization spaces). The detokenizer
then decodes with `tokenizers` alone: its start takes ~0.15 s of CPU where loading the tokenizer through
transformers took ~4 s (torch and transformers imported), on each server start. Otherwise the spec
says so and the detokenizer loads the tokenizer through transformers itself, as before.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# transformers' decode of a tokenizer with a `tokenizers` backend, when it is nothing but the backend's.
_PLAIN_DECODE = {("decode", "PreTrainedTokenizerBase.decode"), ("_decode", "TokenizersBackend._decode")}


@dataclass
class DecoderSpec:
    """HTTP process -> detokenizer, once: the tokenizer's backend as JSON, or None (load it through
    transformers from --tokenizer-path)."""

    backend_json: str | None


def decoder_spec(tokenizer: Any) -> DecoderSpec:
    """The spec of this (transformers) tokenizer: its backend where decoding is the backend's alone."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    cls = type(tokenizer)
    plain = all(
        getattr(getattr(cls, name, None), "__qualname__", None) == qual for name, qual in _PLAIN_DECODE
    )
    if backend is None or not plain or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return DecoderSpec(None)
    try:
        return DecoderSpec(backend.to_str())
    except Exception:  # noqa: BLE001 - e.g. a custom pre-tokenizer (tokenizers cannot serialize it)
        return DecoderSpec(None)


def send_decoder_spec(tokenizer: Any, detokenizer_ipc_name: str) -> Any:
    """Send the detokenizer this tokenizer's spec (nothing without a tokenizer: --skip-tokenizer-init);
    returns the socket, which the caller keeps open until it closes (a detokenizer still starting gets
    the spec once it binds), or None."""
    if tokenizer is None:
        return None
    import zmq

    spec = decoder_spec(tokenizer)
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.connect(detokenizer_ipc_name)
    sock.send_pyobj(spec)
    return sock


class BackendDecoder:
    """`decode` as transformers' TokenizersBackend decodes (`_PLAIN_DECODE`), from the backend's JSON."""

    def __init__(self, backend_json: str):
        from tokenizers import Tokenizer

        self.backend = Tokenizer.from_str(backend_json)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)


def load_decoder(spec: DecoderSpec | None, tokenizer_path: str) -> Any:
    """What decodes for the detokenizer: the backend of `spec`, else the tokenizer through transformers."""
    if spec is not None and spec.backend_json is not None:
        try:
            return BackendDecoder(spec.backend_json)
        except Exception:  # noqa: BLE001 - the tokenizer through transformers still decodes
            logger.exception("The tokenizer's backend cannot be rebuilt here: loading the tokenizer.")
    from sglang.srt.utils.hf_transformers_utils import get_tokenizer

    return get_tokenizer(tokenizer_path)

"""The detokenizer's decoder (`managers/decode_tokenizer.py`): the tokenizer's backend as the HTTP process
sends it decodes exactly as transformers does, outputs that come before it wait for it, and the
detokenizer's process (and each child's re-run of the launcher's module) imports neither torch nor
transformers."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from sglang.srt.managers import detokenizer_manager
from sglang.srt.managers.decode_tokenizer import BackendDecoder, DecoderSpec, decoder_spec, load_decoder
from sglang.srt.managers.detokenizer_manager import DetokenizerManager
from sglang.srt.managers.io_struct import BatchTokenIDOut
from sglang.srt.utils.hf_transformers_utils import get_tokenizer
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=6, suite="per-commit-cpu")

# Every preset's tokenizer is one of two (the random presets share one); the demo model's is its own.
TOKENIZERS = ["tiny-qwen3-next", "tiny-qwen3-next-demo"]
TEXT = "def f(x):\n    return x  # héllo 世界 🙂\n"


def _sequences(tokenizer, count: int, seed: int) -> list[list[int]]:
    """Random id sequences over the whole vocabulary, added and special tokens included, some of them
    cut inside a multi-byte character."""
    rng = random.Random(seed)
    vocab = len(tokenizer)
    special = list(tokenizer.all_special_ids) + [t for t in tokenizer.added_tokens_decoder]
    out = [tokenizer.encode(TEXT), tokenizer.encode(TEXT)[:-1]]
    for _ in range(count):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 24))]
        for _ in range(rng.randrange(3)):
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(special))
        out.append(ids)
    return out


@pytest.mark.parametrize("name", TOKENIZERS)
def test_the_backend_decodes_as_transformers_does(name):
    tokenizer = get_tokenizer(name)
    spec = decoder_spec(tokenizer)
    assert spec.backend_json is not None  # (these tokenizers are plain backends: the fast path serves)
    decoder = BackendDecoder(spec.backend_json)
    checked_special = 0
    for ids in _sequences(tokenizer, 300, seed=len(name)):
        for skip in (True, False):
            assert decoder.decode(ids, skip_special_tokens=skip) == tokenizer.decode(
                ids, skip_special_tokens=skip
            )
        checked_special += set(ids) & set(tokenizer.all_special_ids) != set()
    assert checked_special > 50  # the skip flag was really exercised


def test_a_tokenizer_whose_decode_is_its_own_or_cleans_spaces_is_loaded_in_full():
    tokenizer = get_tokenizer("tiny-qwen3-next")

    class OwnDecode(type(tokenizer)):
        def _decode(self, token_ids, **kwargs):  # noqa: ANN001 - transformers' signature
            return "!" + super()._decode(token_ids, **kwargs)

    tokenizer.__class__ = OwnDecode
    assert decoder_spec(tokenizer) == DecoderSpec(None)
    tokenizer.__class__ = OwnDecode.__mro__[1]
    assert decoder_spec(tokenizer).backend_json is not None
    tokenizer.clean_up_tokenization_spaces = True
    assert decoder_spec(tokenizer) == DecoderSpec(None)


def _out(rid: str, ids: list[int], finished: bool) -> BatchTokenIDOut:
    reason = {"type": "length", "length": len(ids)} if finished else None
    return BatchTokenIDOut([rid], [reason], [ids], [1], [len(ids)], [0], skip_special_tokens=[True])


def test_outputs_wait_for_the_decoder_then_go_in_order():
    tokenizer = get_tokenizer("tiny-qwen3-next")
    ids = tokenizer.encode(TEXT)
    manager = DetokenizerManager(None, "tiny-qwen3-next")
    assert manager.wait_ms() is None  # nothing waits: the loop blocks for its next message
    assert manager.take_output(_out("a", ids[:5], False)) == []
    assert manager.take_output(_out("a", ids[5:], True)) == []
    assert 0 < manager.wait_ms() <= detokenizer_manager.SPEC_WAIT_S * 1000
    replies = manager.take_spec(decoder_spec(tokenizer))
    assert "".join(r.output_strs[0] for r in replies) == TEXT and manager.wait_ms() is None
    assert isinstance(manager.tokenizer, BackendDecoder)
    manager.take_spec(DecoderSpec(None))  # (a second spec changes nothing)
    assert isinstance(manager.tokenizer, BackendDecoder)
    # No spec at all (the wait ran out): the tokenizer is loaded through transformers, same text.
    late = DetokenizerManager(None, "tiny-qwen3-next")
    assert late.take_output(_out("b", ids, True)) == []
    assert late.take_spec(DecoderSpec(None))[0].output_strs == [TEXT]
    # --skip-tokenizer-init: no path, nothing waits, the ids pass with no text.
    skip = DetokenizerManager(None)
    assert [r.output_strs for r in skip.take_output(_out("c", ids, True))] == [[""]]


def test_the_detokenizer_and_a_childs_run_of_the_launcher_import_neither_torch_nor_transformers():
    """What the detokenizer's process imports: the launcher's module (each spawned child runs it again as
    `__mp_main__`), the warm children's modules (`prestart.WARM_MODULES`), its decoder's."""
    code = (
        "import sys\n"
        "import sglang.launch_server\n"
        "from sglang.srt.entrypoints import prestart\n"
        "from sglang.srt.managers import decode_tokenizer, detokenizer_manager, data_parallel_controller\n"
        "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_a_backend_that_cannot_be_serialized_or_rebuilt_falls_back_to_transformers():
    tokenizer = get_tokenizer("tiny-qwen3-next")

    class Unserializable:
        def to_str(self) -> str:
            raise Exception("Custom PreTokenizer cannot be serialized")  # (what tokenizers raises)

    tokenizer._tokenizer = Unserializable()
    assert decoder_spec(tokenizer) == DecoderSpec(None)
    # A spec the detokenizer's tokenizers cannot read: the tokenizer through transformers, same text.
    decoder = load_decoder(DecoderSpec("{not json"), "tiny-qwen3-next")
    ids = get_tokenizer("tiny-qwen3-next").encode(TEXT)
    assert not isinstance(decoder, BackendDecoder) and decoder.decode(ids) == TEXT


def test_a_tokenizer_manager_whose_start_fails_closes_what_it_opened():
    import asyncio

    from sglang.srt.managers.io_struct import PortArgs
    from sglang.test.app_harness import build_app

    _, tm = build_app()
    ports = PortArgs.init_new()
    # A socket path past the system's limit: the detokenizer's connect fails after two sockets opened.
    tm.port_args = PortArgs(ports.tokenizer_ipc_name, ports.scheduler_input_ipc_name, "ipc:///" + "x" * 300)
    with pytest.raises(Exception):  # noqa: B017, PT011 - zmq's error for the path
        asyncio.run(tm.start())
    assert tm._ctx is None and tm._recv.closed and tm._send.closed
    tm.encoder.close()

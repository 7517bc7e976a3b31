"""The tiny presets: deterministic, real HF format, loadable offline, with a working tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sglang.srt.configs.presets import PRESETS
from sglang.test.ci_register import register_cpu_ci
from sglang.tools.make_tiny_model import ARCHS, CHATML_TEMPLATE, make_tiny_model

register_cpu_ci(est_time=25, suite="per-commit-cpu")


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("arch", ARCHS)
def test_same_seed_gives_bit_identical_checkpoints(arch, tmp_path):
    a = _files(make_tiny_model(arch, tmp_path / "a", seed=3))
    b = _files(make_tiny_model(arch, tmp_path / "b", seed=3))
    assert a.keys() == b.keys() and {"config.json", "model.safetensors", "tokenizer.json"} <= a.keys()
    for name in a:
        assert a[name] == b[name], f"{name} differs between two runs with the same seed"
    c = load_file(make_tiny_model(arch, tmp_path / "c", seed=4) / "model.safetensors")
    wa = load_file(tmp_path / "a" / "model.safetensors")
    assert any(not torch.equal(wa[k], c[k]) for k in wa), "a different seed must give different weights"


def test_qwen3_next_config_states_both_layer_forms(preset_paths):
    cfg = json.loads((Path(preset_paths["tiny-qwen3-next"]) / "config.json").read_text())
    assert cfg["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert cfg["full_attention_interval"] == 4
    assert cfg["linear_conv_kernel_dim"] == 4 and cfg["num_experts"] > 1


@pytest.mark.parametrize(
    ("name", "arch"), [("tiny-qwen3.5", "Qwen3_5ForCausalLM"), ("tiny-qwen3.5-moe", "Qwen3_5MoeForCausalLM")]
)
def test_qwen3_5_configs(name, arch, preset_paths):
    cfg = json.loads((Path(preset_paths[name]) / "config.json").read_text())
    assert cfg["architectures"] == [arch] and cfg["layer_types"][-1] == "full_attention"
    # The published checkpoints' interleaved mRoPE, so the oracle runs that path.
    assert cfg["rope_parameters"]["mrope_interleaved"] is True
    assert (cfg.get("num_experts", 0) > 1) == name.endswith("moe")


def test_nemotron_h_config_chunk_size(preset_paths):
    cfg = json.loads((Path(preset_paths["tiny-nemotron-h"]) / "config.json").read_text())
    assert cfg["chunk_size"] == 32
    assert cfg["layers_block_type"].count("linear_attention") >= 3
    assert "moe" in cfg["layers_block_type"] and "full_attention" in cfg["layers_block_type"]


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_load_offline_with_auto_classes(name, preset_paths, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = preset_paths[name]
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    ids = tok("The cache holds a state.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 512)
    # Far from uniform: the mean top probability is many times the uniform 1/512.
    probs = model(torch.arange(3, 131)[None]).logits.softmax(-1).amax(-1).mean()
    assert probs > 20 / 512


def test_tokenizer_round_trips_mixed_text(preset_paths):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(preset_paths["tiny-qwen3-next"])
    text = "Hello, wörld!\n\tdef f(x): return x**2  # 你好 🙂 привет  $19.99 <tag> 127.0.0.1:30000"
    ids = tok(text)["input_ids"]
    assert all(0 <= i < 512 for i in ids)
    assert tok.decode(ids) == text
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert tok.convert_tokens_to_ids(specials) == [0, 1, 2]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"


def test_chat_template_renders_chatml(preset_paths):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(preset_paths["tiny-nemotron-h"])
    assert tok.chat_template == CHATML_TEMPLATE
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_preset_resolution_uses_cache_dir(tmp_path, monkeypatch):
    from sglang.srt.configs import presets
    from sglang.srt.environ import envs

    with envs.SGLANG_CACHE_DIR.override(str(tmp_path)):
        path = Path(presets.resolve_model_path("tiny-nemotron-h"))
        assert path.parent == tmp_path / "presets" and (path / "model.safetensors").is_file()
        calls = []
        monkeypatch.setattr("sglang.tools.make_tiny_model.make_tiny_model", lambda *a, **k: calls.append(a))
        assert presets.resolve_model_path("tiny-nemotron-h") == str(path)
        assert calls == [], "a generated preset is reused, not generated again"
    assert presets.resolve_model_path("/some/folder") == "/some/folder"


def test_a_rank_other_than_0_writes_its_own_preset(tmp_path, monkeypatch):
    """transformers' save_pretrained writes only from rank 0 of an initialized torch.distributed group;
    a preset generated by rank 1 of a TP test (its own private folder) must still get every file (CI
    failed on it: FileNotFoundError for the folder's config.json in test_tp_model)."""
    from transformers.distributed import mixin

    monkeypatch.setattr(mixin, "_is_torch_distributed_initialized", lambda: True)
    monkeypatch.setattr(mixin, "_get_torch_distributed_rank", lambda: 1)
    files = _files(make_tiny_model(ARCHS[0], tmp_path / "rank1", seed=3))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files.keys(), sorted(files)

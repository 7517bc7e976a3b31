"""`ModelRunner.update_weights_from_tensor` (/update_weights_from_tensor): new values written into the
serving model's parameters in place, from checkpoint-named tensors in any subset and order, through the
same mapping as loading (renames, stacked experts, row blocks, folded multipliers, Qwen3-Next's regrouped
projections) and into every layout the post-load steps made (transposed experts, shared experts fused
into the C++ op, decode blocks). A model updated to checkpoint B computes exactly what a model loaded
from B computes; a tensor that does not fit changes nothing."""

from __future__ import annotations

import pytest
import torch

from sglang.test.ci_register import register_cpu_ci
from sglang.test.model_checks import (
    decode_steps,
    make_runner,
    noisy_checkpoint,
    prefill,
    random_ids,
    served_tensors,
)
from sglang.test.runner_driver import RunnerDriver

register_cpu_ci(est_time=20, suite="per-commit-cpu")

PRESETS = [
    "tiny-qwen3-next",
    "tiny-nemotron-h",
    "tiny-qwen3.5",
    "tiny-qwen3.5-moe",
    "tiny-granite-4.0-h",
    "tiny-falcon-h1",
    "tiny-bamba",
    "tiny-lfm2",
    "tiny-lfm2-moe",
]


def checkpoint_tensors(path: str) -> dict[str, torch.Tensor]:
    return served_tensors(path)  # (the MTP layer's tensors are not served without NEXTN)


def logprobs(runner, prompt: list[int]) -> list[float]:
    """A prefill, then decode steps (where the CPU decode blocks run: they hold the weights too)."""
    driver = RunnerDriver(runner)
    req = driver.new_request()
    return prefill(driver, req, prompt) + decode_steps(driver, [req], 3)[0]


@pytest.fixture(scope="module")
def checkpoints_b(preset_paths, tmp_path_factory):
    folder = tmp_path_factory.mktemp("b")
    return {p: noisy_checkpoint(preset_paths[p], folder / p) for p in PRESETS}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("preset", PRESETS)
def test_updated_in_place_computes_what_the_new_checkpoint_does(preset, dtype, checkpoints_b):
    prompt = random_ids(48, seed=5)
    runner = make_runner(preset, dtype=dtype)
    before = logprobs(runner, prompt)
    new = checkpoint_tensors(checkpoints_b[preset])
    names = sorted(new, reverse=True)  # not the checkpoint's order, in three updates
    for part in (names[0::3], names[1::3], names[2::3]):
        assert runner.update_weights_from_tensor([(n, new[n]) for n in part]) == []
    after = logprobs(runner, prompt)
    expected = logprobs(make_runner(checkpoints_b[preset], dtype=dtype), prompt)
    # The same values copied into the same parameters: bit for bit what loading B computes.
    assert after == expected
    assert after != before


def test_direct_names_are_the_served_parameters(checkpoints_b, preset_paths):
    """load_format "direct": this server's parameter names and layout (a model's own state, as
    `named_parameters` gives it, moved to another server)."""
    prompt = random_ids(40, seed=6)
    source = make_runner(checkpoints_b["tiny-qwen3-next"])
    target = make_runner("tiny-qwen3-next")
    named = [(n, p.detach().clone()) for n, p in source.model.named_parameters()]
    assert target.update_weights_from_tensor(named, "direct") == []
    assert logprobs(target, prompt) == logprobs(source, prompt)


def test_a_tensor_that_does_not_fit_changes_no_weight(checkpoints_b):
    runner = make_runner("tiny-nemotron-h")
    before = {n: p.detach().clone() for n, p in runner.model.named_parameters()}
    new = checkpoint_tensors(checkpoints_b["tiny-nemotron-h"])
    bad = "backbone.layers.0.mixer.D"
    payloads = [
        [*new.items(), (bad, torch.zeros(3))],  # the last one has the wrong shape
        [*new.items(), ("backbone.layers.1.mixer.experts.0.up_proj.weight", torch.zeros(2, 2))],
        [*new.items(), (bad, torch.zeros_like(new[bad], dtype=torch.int8))],  # quantized
    ]
    no_expert = "backbone.layers.1.mixer.experts.99.up_proj.weight"  # the layer has fewer
    payloads.append([*new.items(), (no_expert, torch.zeros(2, 2))])
    for named in payloads:
        with pytest.raises(ValueError):
            runner.update_weights_from_tensor(named)
    with pytest.raises(ValueError, match="shape"):
        runner.update_weights_from_tensor([(bad, torch.zeros(3))], "direct")
    with pytest.raises(ValueError, match="float8_e4m3fn"):  # a floating dtype, but packed
        runner.update_weights_from_tensor([(bad, new[bad].to(torch.float8_e4m3fn))], "direct")
    after = dict(runner.model.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_get_weights_by_name_reads_what_direct_writes():
    """/get_weights_by_name: the first rows of a parameter in this server's names and layout, as
    load_format "direct" takes them back."""
    runner = make_runner("tiny-qwen3-next")
    name = "model.layers.0.linear_attn.in_proj_qkvz.weight"  # regrouped for serving
    param = dict(runner.model.named_parameters())[name]
    assert runner.get_weights_by_name(name, 3) == param[:3].tolist()
    assert len(runner.get_weights_by_name(name)) == min(100, param.shape[0])
    new = [[0.25] * param.shape[1]] * param.shape[0]
    runner.update_weights_from_tensor([(name, torch.tensor(new))], "direct")
    assert runner.get_weights_by_name(name, 2) == new[:2]
    checkpoint_piece = "model.layers.0.linear_attn.in_proj_qkv.weight"  # Qwen3.5's name, not a parameter
    with pytest.raises(ValueError, match=r"no parameter .*in_proj_qkv\.weight' \(close: .*in_proj_qkvz"):
        runner.get_weights_by_name(checkpoint_piece)


def test_get_weights_by_name_answers_a_bounded_number_of_values(monkeypatch):
    """A stacked experts tensor is [E, rows, hidden]: 100 "rows" are 100 experts; past the cap the call
    is refused with how many it would be, not answered with a list that stalls the scheduler."""
    from sglang.srt.model_executor import model_runner

    runner = make_runner("tiny-qwen3-next")
    name = next(n for n, _ in runner.model.named_parameters() if n.endswith("experts.w13"))
    monkeypatch.setattr(model_runner, "MAX_WEIGHT_VALUES", 1000)
    with pytest.raises(ValueError, match="values; at most 1000 per call"):
        runner.get_weights_by_name(name)
    norm = runner.get_weights_by_name("model.norm.weight")
    assert runner.get_weights_by_name("model.norm.weight", 1) == norm[:1]


def test_a_qwen3_next_projection_of_another_shape_is_refused_by_name():
    """The projections are regrouped for serving: one of a wrong shape is named, not a reshape error."""
    runner = make_runner("tiny-qwen3-next")
    name = "model.layers.0.linear_attn.in_proj_qkvz.weight"
    with pytest.raises(ValueError, match=f"{name} has shape"):
        runner.update_weights_from_tensor([(name, torch.zeros(3, 5))])


def test_names_no_parameter_takes_are_returned_and_the_rest_loads(checkpoints_b):
    prompt = random_ids(40, seed=7)
    runner = make_runner("tiny-qwen3-next")
    new = checkpoint_tensors(checkpoints_b["tiny-qwen3-next"])
    extra = [
        ("model.layers.0.not_a_weight", torch.zeros(2)),
        ("model.layers.99.linear_attn.in_proj_ba.weight", torch.zeros(2, 2)),  # no such layer
    ]
    ignored = runner.update_weights_from_tensor([*new.items(), *extra])
    assert ignored == [name for name, _ in extra]
    assert runner.update_weights_from_tensor(extra[:1], "direct") == ["model.layers.0.not_a_weight"]
    assert logprobs(runner, prompt) == logprobs(make_runner(checkpoints_b["tiny-qwen3-next"]), prompt)

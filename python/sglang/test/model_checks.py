"""Helpers for tests that run the model runner against the transformers oracle."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.models.loader import checkpoint_files
from sglang.srt.server_args import ServerArgs
from sglang.test.reference import LinearState
from sglang.test.runner_driver import DriverRequest, Extend, RunnerDriver


def make_runner(preset: str, page_size: int = 1, **server_args) -> ModelRunner:
    """A runner with small fixed pools (no memory-budget sizing in tests)."""
    kwargs = dict(
        model_path=preset,
        page_size=page_size,
        max_total_tokens=16384,
        max_mamba_cache_size=48,
        max_running_requests=16,
        random_seed=0,
    )
    kwargs.update(server_args)
    return ModelRunner(ServerArgs(**kwargs))


def random_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


def prefill(
    driver: RunnerDriver, req: DriverRequest, tokens: Sequence[int], cuts: Sequence[int] = ()
) -> list[float]:
    """Prefill `tokens` on top of what `req` holds, in chunks split at `cuts` (offsets into tokens).
    Returns the logprobs of tokens[1:] and then of the token sampled after the last one."""
    bounds = [0, *[c for c in cuts if 0 < c < len(tokens)], len(tokens)]
    lps: list[float] = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        nxt = tokens[b] if b < len(tokens) else None
        res = driver.extend([Extend(req, list(tokens[a:b]), next_token=nxt)])
        lps += res.input_token_logprobs[0]
    return lps + [float(res.next_token_logprobs[0])]


def decode_steps(driver: RunnerDriver, reqs: Sequence[DriverRequest], n: int) -> list[list[float]]:
    """n greedy decode steps for the batch; per request the logprobs of the tokens it sampled."""
    out: list[list[float]] = [[] for _ in reqs]
    for _ in range(n):
        res = driver.decode(reqs)
        for i in range(len(reqs)):
            out[i].append(float(res.next_token_logprobs[i]))
    return out


def max_abs(a: Sequence[float] | torch.Tensor, b: Sequence[float] | torch.Tensor) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape, f"{tuple(a.shape)} vs {tuple(b.shape)}"
    return (a - b).abs().max().item()


def pool_state(runner: ModelRunner, slot: int) -> dict[int, LinearState]:
    """Each linear layer's (conv, ssm) in one mamba slot, as float32 copies."""
    pool = runner.mamba_pool
    return {
        layer: LinearState(pool.conv_state[i, slot].float().clone(), pool.ssm_state[i, slot].float().clone())
        for layer, i in pool.mamba_map.items()
    }


def state_errors(got: dict[int, LinearState], want: dict[int, LinearState]) -> tuple[float, float]:
    """(max relative conv error, max relative SSM error) over layers; relative to the largest entry
    of the oracle's tensor, since the SSM state grows with the sequence."""
    conv = max(
        (g.conv - want[k].conv).abs().max().item() / want[k].conv.abs().max().item() for k, g in got.items()
    )
    ssm = max(
        (g.ssm - want[k].ssm).abs().max().item() / want[k].ssm.abs().max().item() for k, g in got.items()
    )
    return conv, ssm


def greedy_tokens_and_logprobs(
    runner: ModelRunner, prompt_lens: Sequence[int], steps: int
) -> tuple[list[list[int]], torch.Tensor]:
    """One extend of fresh requests with random prompts of `prompt_lens` tokens, then `steps` greedy
    decode steps: (the sampled tokens per step, the input logprobs and then every step's logprobs)."""
    driver = RunnerDriver(runner)
    reqs = [driver.new_request() for _ in prompt_lens]
    first = driver.extend([Extend(r, random_ids(n, seed=n)) for r, n in zip(reqs, prompt_lens, strict=True)])
    tokens, logprobs = [], [torch.tensor(sum(first.input_token_logprobs, []))]
    for _ in range(steps):
        res = driver.decode(reqs)
        tokens.append(res.next_token_ids.tolist())
        logprobs.append(res.next_token_logprobs.clone())
    return tokens, torch.cat(logprobs)


def batched_extends_with_prefixes(
    driver: RunnerDriver, prefixes: Sequence[int], extends: Sequence[int], decode: int, seed: int
) -> tuple[list[DriverRequest], list[list[float]]]:
    """Requests whose prompts (random, `prefixes[i] + extends[i]` tokens) are prefilled in two batched
    extends, the prefixes first (those of length 0 skip it), then `decode` batched greedy steps: the
    requests and, per request, the logprobs of its prompt's tokens after the first and of each sampled
    token (to score against the oracle on `req.token_ids + [req.next_token]`)."""
    pairs = zip(prefixes, extends, strict=True)
    prompts = [random_ids(p + e, seed=seed + i) for i, (p, e) in enumerate(pairs)]
    reqs = [driver.new_request() for _ in prompts]
    lps: list[list[float]] = [[] for _ in reqs]
    first = [Extend(r, p[:n], next_token=p[n]) for r, p, n in zip(reqs, prompts, prefixes, strict=True) if n]
    if first:
        for it, got in zip(first, driver.extend(first).input_token_logprobs, strict=True):
            lps[reqs.index(it.req)] += got
    res = driver.extend([Extend(r, p[n:]) for r, p, n in zip(reqs, prompts, prefixes, strict=True)])
    for i in range(len(reqs)):
        lps[i] += res.input_token_logprobs[i] + [float(res.next_token_logprobs[i])]
    for i, steps in enumerate(decode_steps(driver, reqs, decode)):
        lps[i] += steps
    return reqs, lps


def checkpoint_variant(src: str, edit: dict, dst: Path) -> str:
    """A copy of the checkpoint folder `src` at `dst` whose config.json has the fields of `edit` (the same
    weights under another setting: a norm's order, no positions, no experts); `src` itself if no edit."""
    if not edit:
        return src
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **edit}))
    return str(dst)


def noisy_checkpoint(src: str, dst: Path, seed: int = 7, scale: float = 0.05) -> str:
    """A copy of the checkpoint folder `src` at `dst` with seeded noise on every weight: the same network
    with other outputs (a checkpoint to update the weights to)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for path in checkpoint_files(dst):
        weights = load_file(str(path))
        gen = torch.Generator().manual_seed(seed)
        noisy = {
            k: t + scale * torch.randn(t.shape, generator=gen, dtype=t.dtype) for k, t in weights.items()
        }
        save_file(noisy, str(path), metadata={"format": "pt"})
    return str(dst)


def chunked_prefill_and_decode_error(
    path: str, oracle, *, prompt_len: int, cuts: Sequence[int], decode: int, seed: int, page_size: int = 16
) -> float:
    """Max |logprob - oracle| over a random prompt prefilled in chunks cut at `cuts`, then `decode`
    greedy steps (teacher-forced scoring of the tokens the runner produced)."""
    driver = RunnerDriver(make_runner(path, page_size=page_size))
    req = driver.new_request()
    lps = prefill(driver, req, random_ids(prompt_len, seed=seed), cuts=cuts)
    lps += decode_steps(driver, [req], decode)[0]
    return max_abs(lps, oracle.token_logprobs(req.token_ids + [req.next_token], start=1).tolist())


def batched_extends_error(
    path: str, oracle, *, prefixes: Sequence[int], extends: Sequence[int], seed: int, decode: int = 5
) -> float:
    """Max |logprob - oracle| over `batched_extends_with_prefixes` on a fresh runner (page size 1)."""
    driver = RunnerDriver(make_runner(path))
    reqs, lps = batched_extends_with_prefixes(driver, prefixes, extends, decode=decode, seed=seed)
    return max(
        max_abs(got, oracle.token_logprobs(req.token_ids + [req.next_token], start=1).tolist())
        for req, got in zip(reqs, lps, strict=True)
    )


def variants_with_oracles(src: str, variants: dict[str, dict], make_dir) -> dict[str, tuple[str, Any]]:
    """name -> (`checkpoint_variant` of `src` with that config edit, its transformers oracle);
    `make_dir(name)` gives a fresh folder (pytest's `tmp_path_factory.mktemp`)."""
    from sglang.test.reference import ReferenceModel

    out = {}
    for name, edit in variants.items():
        folder = checkpoint_variant(src, edit, make_dir(name) / "ckpt")
        out[name] = (folder, ReferenceModel(folder))
    return out


def served_tensors(path: str) -> dict:
    """Every tensor of the checkpoint folder `path` that a server without speculative decoding serves:
    all but the MTP layer's (`mtp.*`, loaded only with --speculative-algorithm NEXTN; an update that
    sends them gets their names back as not taken)."""
    from safetensors.torch import load_file

    from sglang.srt.models.loader import checkpoint_files

    out = {}
    for f in checkpoint_files(path):
        out.update({n: t for n, t in load_file(str(f)).items() if not n.startswith("mtp.")})
    return out

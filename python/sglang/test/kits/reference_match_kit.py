"""`ReferenceMatchMixin`: greedy output logprobs match the transformers oracle, teacher-forced.

It takes the place of upstream's GSM8K accuracy checks (meaningless on random weights). The oracle
(`sglang.test.reference.ReferenceModel`, float32) scores the server's own output tokens, so a near-tie
that flips one greedy token cannot derail the comparison; each output token must also be the oracle's
argmax up to `greedy_tie_tol` (greedy decoding picked the best token).
"""

from __future__ import annotations

from typing import Any

from sglang.test.kits.common import KitRequests, prompt_ids


class ReferenceMatchMixin(KitRequests):
    reference_prompt_lens: tuple[int, ...] = (24, 150)
    reference_new_tokens: int = 16
    reference_logprob_tol: float = 1e-4
    greedy_tie_tol: float = 1e-4
    reference_seed: int = 777
    _oracles: dict[str, Any] = {}

    def oracle(self) -> Any:
        from sglang.test.reference import ReferenceModel

        if self.model not in self._oracles:
            self._oracles[self.model] = ReferenceModel(self.model)
        return self._oracles[self.model]

    def test_reference_match(self) -> None:
        ref = self.oracle()
        worst = 0.0
        for k, length in enumerate(self.reference_prompt_lens):
            prompt = prompt_ids(length, self.reference_seed + k)
            out = self.greedy(prompt, self.reference_new_tokens)
            self.assertEqual(len(out.output_ids), self.reference_new_tokens)
            full = prompt + out.output_ids
            lp = ref.logprobs(full)[len(prompt) - 1 : len(full) - 1]
            for i, (tok, server_lp) in enumerate(zip(out.output_ids, out.logprobs, strict=True)):
                oracle_lp = float(lp[i, tok])
                worst = max(worst, abs(oracle_lp - server_lp))
                self.assertLessEqual(
                    abs(oracle_lp - server_lp),
                    self.reference_logprob_tol,
                    f"prompt {length}, output {i}: server {server_lp} vs oracle {oracle_lp}",
                )
                self.assertGreaterEqual(
                    oracle_lp, float(lp[i].max()) - self.greedy_tie_tol, f"output {i} is not the greedy token"
                )
        print(f"[{type(self).__name__}] reference max |dlogprob| {worst:.3e}")

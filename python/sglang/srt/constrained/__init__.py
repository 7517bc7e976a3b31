"""Constrained decoding (upstream's `sglang.srt.constrained`): a request's output held to a JSON schema, a
regular expression, an EBNF grammar or a structural tag, through xgrammar.

- `grammar_spec.py`: the request fields, checked where the request comes in (a 400 naming the field);
- `xgrammar_backend.py`: the scheduler's compiler (`--grammar-backend xgrammar`) and each request's
  matcher;
- `vocab_mask.py`: a batch's masks, built on the host and applied to the logits before sampling.
"""

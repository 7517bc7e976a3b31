"""`--reasoning-parser` (upstream's flag): a chat answer's reasoning, between think tags, goes to the
message's `reasoning_content` and the rest to `content`, whole or as it streams.

The parsers (upstream's names): `qwen3` (Qwen3 / Qwen3-Next / Qwen3.5), `nemotron_3` (alias `nano_v3`;
Nemotron 3, which reads as `qwen3`), `qwen3-thinking` and `deepseek-r1`, all `<think> ... </think>`. Where the answer starts:
- inside the reasoning when the generation prompt (what the template adds after the messages, and a
  continued final message) leaves a think block open: a thinking template ends it with `<think>`; and
  always for `qwen3-thinking` and `deepseek-r1` (whose models may leave the opening tag out);
- otherwise in the content, and an answer that opens with `<think>` (leading whitespace aside; not a
  continued message's middle) enters the reasoning there. `enable_thinking: false` templates close
  the block in the prompt. Tags in the messages themselves (a system prompt about `<think>`) count
  for nothing.

The reasoning ends at `</think>` (the text after it is content, as it comes); for `qwen3` also where a
tool call (`<tool_call>`) begins. An answer cut off inside its reasoning is all reasoning. While
streaming, text that may be the start of a tag is held back until the next piece decides it, so any
cutting of a text into pieces gives what the whole text gives.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from sglang.srt.utils.text_markers import partial_marker_len

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    always_reasoning: bool  # the answer starts in the reasoning whatever the prompt
    ends_at: tuple[str, ...]  # markers that end the reasoning; the first one is dropped, others kept


_QWEN3 = ReasoningFormat(always_reasoning=False, ends_at=(THINK_END, "<tool_call>"))
FORMATS = {
    "qwen3": _QWEN3,
    # Nemotron 3's (upstream's names, old and new): Qwen3's tags, the block opened by the template
    # (`enable_thinking`), and a tool call may follow without `</think>`.
    "nano_v3": _QWEN3,
    "nemotron_3": _QWEN3,
    "qwen3-thinking": ReasoningFormat(always_reasoning=True, ends_at=(THINK_END, "<tool_call>")),
    "deepseek-r1": ReasoningFormat(always_reasoning=True, ends_at=(THINK_END,)),
}


def prompt_opens_reasoning(generation_prompt: str, always: bool = False) -> bool:
    """Whether `generation_prompt` (the template's tail after the messages, and a continued message)
    ends inside a think block (its last opening tag is not closed); `always`: the block is open from
    the start (a model that may leave the opening tag out), closed only by an end tag after the last
    opening one."""
    return opens_at(generation_prompt.rfind(THINK_START), generation_prompt.rfind(THINK_END), always)


def opens_at(start: int, end: int, always: bool = False) -> bool:
    """The rule of `prompt_opens_reasoning` on where the last opening and end tags are (-1: none), in
    text or in token ids."""
    return start > end or (always and end < 0)


def last_index(ids: list[int], marker: list[int]) -> int:
    """Where `marker` (a tag's token ids) last occurs in `ids`, or -1; a search in C (bytes.rfind on
    the ids' 4-byte words), so a long prompt costs no Python loop."""
    if not marker:
        return -1
    hay, needle = array("i", ids).tobytes(), array("i", marker).tobytes()
    at = hay.rfind(needle)
    while at >= 0 and at % 4:  # (a match across two ids' bytes: look further left)
        at = hay.rfind(needle, 0, at + len(needle) - 1)
    return at // 4 if at >= 0 else -1


class ReasoningParser:
    """One answer's split into (reasoning, content): `feed` each new piece of text, then `finish`."""

    def __init__(self, fmt: ReasoningFormat, prompt_opens: bool = False, continues: bool = False):
        """`continues`: the answer goes on from a continued message's text (no opening tag there)."""
        self.fmt = fmt
        self.in_reasoning = fmt.always_reasoning or prompt_opens
        self.at_start = not continues  # nothing of the answer consumed yet: an opening tag may come
        self.saw_reasoning = self.in_reasoning
        self._buf = ""
        self._lead = 0  # (at the start: how much of the buffer is known to be leading whitespace)

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that `text` completes."""
        self._buf += text
        reasoning, content = [], []
        while self._buf:
            if self.at_start:
                # Only the new text is scanned: a long run of whitespace fed a token at a time stays linear.
                lead = self._lead
                while lead < len(self._buf) and self._buf[lead].isspace():
                    lead += 1
                self._lead = lead
                stripped = self._buf[lead:]
                if not stripped or (THINK_START.startswith(stripped) and stripped != THINK_START):
                    break  # whitespace or a partial opening tag: wait
                self.at_start = False
                if stripped.startswith(THINK_START):
                    self._buf = stripped[len(THINK_START) :]
                    self.in_reasoning = self.saw_reasoning = True
                continue
            if not self.in_reasoning:
                content.append(self._buf)
                self._buf = ""
                break
            hits = [(self._buf.find(m), i, m) for i, m in enumerate(self.fmt.ends_at) if m in self._buf]
            if hits:
                at, i, marker = min(hits)
                reasoning.append(self._buf[:at])
                self._buf = self._buf[at + len(marker) :] if i == 0 else self._buf[at:]
                self.in_reasoning = False
                continue
            keep = partial_marker_len(self._buf, self.fmt.ends_at)
            reasoning.append(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is held back, once the answer is complete."""
        text, self._buf = self._buf, ""
        self.at_start = False
        return (text, "") if self.in_reasoning else ("", text)

    def parse(self, text: str) -> tuple[str | None, str]:
        """A whole answer: (reasoning, or None where it has none, content)."""
        r1, c1 = self.feed(text)
        r2, c2 = self.finish()
        return (r1 + r2 if self.saw_reasoning else None), c1 + c2

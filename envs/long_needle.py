"""LongNeedle-v0 (long context): page through a document, then recall a word read pages ago
against a decoy read just before the question.

One page, drawn uniformly over the ``num_pages`` pages, holds the needle ``The code word is W.``
(W from :data:`CODE_WORDS`); the last page ends with a decoy ``The note word is D.`` (D from
:data:`NOTE_WORDS`) right before the question, which always asks for the code word. The policy
reads each page with a no-argument ``next_page`` call (one assistant turn per page) and answers
``The code word is W.``, the needle's own words, so the word is the same token as in the page. Everything else is filler of single-token words that occur in neither list, so
the answer is a one-token copy of a word seen once, up to ``num_pages`` pages back, while the
decoy sits a few tokens back. Every other page ends with ``(continued on the next page)``, so
whether to read on or answer is decided by the last line read, at any page length. With the pages before the last cut out, a policy can be right at
most when the needle is on the last page, plus a guess: ``1/num_pages + (1 - 1/num_pages) /
len(CODE_WORDS)`` (see :func:`cut_pages` and tools/long_recall_diag.py ``--cut``).

Knows nothing of models, tokenizers or the rollout loop; it only assumes (for cheap long pages)
that the filler words are single tokens of the tiny tokenizer, which only changes cost.
"""

from __future__ import annotations

import math
import random
import re
from typing import Any

from agentrl.envs.base import Message, ToolEnv
from agentrl.envs.tools import tool

from agentrl.rollout.chat import format_tool_call

__all__ = ["CODE_WORDS", "CONTINUED", "NOTE_WORDS", "LongNeedleEnv", "cut_pages", "expert"]

SYSTEM = ("Read every page with the next_page tool. One page gives the code word; the last page asks "
          "for it. Reply: The code word is WORD.")
CODE_WORDS = ("apples", "books", "coins", "cards", "marbles", "pens", "boxes", "bags", "letter", "divided",
              "file", "number")
NOTE_WORDS = ("sum", "difference", "product", "times", "plus", "minus", "answer", "total", "result",
              "value", "position", "directory")
FILLER = ("the", "a", "an", "and", "of", "to", "in", "is", "has", "have", "had", "buys", "sells", "gives",
          "gets", "more", "fewer", "each", "every", "how", "many", "much", "who", "which", "left", "after",
          "before", "then", "tool", "call", "function", "arguments", "expression", "calculate", "search",
          "open", "read", "list", "error", "invalid", "unknown", "please", "by", "you", "your", "user",
          "helpful", "solve", "problem", "use", "step", "think", "final", "correct", "wrong", "try", "again",
          "guess")
QUESTION = "Question: what is the code word?"
CONTINUED = "(continued on the next page)"
_WORD_RE = re.compile(r"[A-Za-z]+")


def _range(words: int | list[int] | tuple[int, int]) -> tuple[int, int]:
    return (words, words) if isinstance(words, int) else (int(words[0]), int(words[1]))


def _log_uniform(rng: random.Random, low: int, high: int) -> int:
    """Filler words of one page, log-uniform over ``[low, high]``: with a wide range most pages
    are short (cheap demonstrations) and some are as long as the longest."""
    return min(high, int(math.exp(rng.uniform(math.log(low), math.log(high + 1)))))


def needle_line(word: str) -> str:
    return f"The code word is {word}."


def decoy_line(word: str) -> str:
    return f"The note word is {word}."


class LongNeedleEnv(ToolEnv):
    """Read ``num_pages`` pages, then answer the code word; reward 1.0 if right (after every page).

    Args:
        num_pages: pages, hence assistant turns before the answer.
        page_words: filler words per page: an int, or ``[low, high]`` drawn log-uniformly per page.
        words_per_line: filler words per line.
        repeats: copies of the needle line on its page, and of the decoy line on the last page
            (at random lines; the last decoy copy right before the question).
        long_prob: probability that an episode's pages draw their length from ``long_page_words``
            instead (demonstrations: mostly short episodes, a few at full length).
        long_page_words: page length of those episodes, as ``page_words``.
        max_turns: steps before truncation (default: ``num_pages + 2``).
        **kwargs: ``tool_timeout_s``, ``max_tool_calls_per_turn``, ``max_tool_output_chars``.
    """

    def __init__(self, *, num_pages: int = 4, page_words: int | list[int] | tuple[int, int] = 1900,
                 words_per_line: int = 12, repeats: int = 1, long_prob: float = 0.0,
                 long_page_words: int | list[int] | tuple[int, int] = 1900, max_turns: int | None = None,
                 max_tool_output_chars: int = 64_000, **kwargs: Any) -> None:
        low, high = _range(page_words)
        long_low, long_high = _range(long_page_words)
        if (num_pages < 1 or not 1 <= low <= high or not 1 <= long_low <= long_high or words_per_line < 1
                or repeats < 1 or not 0.0 <= long_prob <= 1.0):
            raise ValueError(f"need num_pages >= 1, 1 <= page_words and long_page_words (low <= high), "
                             f"words_per_line >= 1, repeats >= 1, 0 <= long_prob <= 1; got {num_pages}, "
                             f"{page_words!r}, {long_page_words!r}, {words_per_line}, {repeats}, {long_prob}")
        super().__init__(max_turns=max_turns or num_pages + 2, max_tool_output_chars=max_tool_output_chars, **kwargs)
        self.num_pages, self.page_words, self.words_per_line = num_pages, (low, high), words_per_line
        self.repeats, self.long_prob, self.long_page_words = repeats, long_prob, (long_low, long_high)
        self.pages: list[str] = []
        self.code = self.note = ""
        self.needle_page = 0
        self.next_index = 0

    def new_task(self, rng: random.Random, options: dict[str, Any]) -> list[Message]:
        self.code, self.note = rng.choice(CODE_WORDS), rng.choice(NOTE_WORDS)
        self.needle_page = rng.randrange(self.num_pages)
        self.pages, self.next_index = [], 0
        lengths = self.long_page_words if self.long_prob and rng.random() < self.long_prob else self.page_words
        for i in range(self.num_pages):
            words = [rng.choice(FILLER) for _ in range(_log_uniform(rng, *lengths))]
            lines = [" ".join(words[k:k + self.words_per_line]) for k in range(0, len(words), self.words_per_line)]
            if i == self.needle_page:
                for _ in range(self.repeats):
                    lines.insert(rng.randrange(len(lines) + 1), needle_line(self.code))
            if i == self.num_pages - 1:  # the decoy right before the question: the nearest candidate
                for _ in range(self.repeats - 1):
                    lines.insert(rng.randrange(len(lines) + 1), decoy_line(self.note))
                lines += [decoy_line(self.note), QUESTION]
            else:  # a cue next to the end, whatever the page's length: read on, do not answer yet
                lines.append(CONTINUED)
            self.pages.append("\n".join([f"Page {i + 1} of {self.num_pages}.", *lines]))
        return [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"The document has {self.num_pages} pages."}]

    @tool
    def next_page(self) -> str:
        """Read the next page of the document."""
        if self.next_index >= len(self.pages):
            raise IndexError("no more pages: answer the question on the last page")
        self.next_index += 1
        return self.pages[self.next_index - 1]

    def score(self, answer: str) -> float:
        if self.next_index < len(self.pages):  # the question is on the last page: no answer before it
            return 0.0
        words = _WORD_RE.findall(answer)
        return 1.0 if words and words[-1] == self.code else 0.0


def cut_pages(env: LongNeedleEnv) -> None:
    """Remove the needle from every page but the last (after ``reset``): what a policy that cannot
    see the early pages has to work with. Filler, decoy and question are unchanged."""
    for i in range(len(env.pages) - 1):
        env.pages[i] = env.pages[i].replace("\n" + needle_line(env.code), "")


def expert(seed: int, *, give_up_prob: float = 0.0, near_pages: int = 0, env_kwargs: dict[str, Any] | None = None,
           rng_seed: int | None = None, tool_parser: str = "hermes") -> list[str]:
    """An imperfect demonstrator's assistant messages for the episode ``reset(seed=seed)`` starts.

    It reads every page, then answers ``The code word is W.``. With probability ``give_up_prob``
    it gives up instead: ``The code word is unknown.``, always wrong, one fixed token that a tiny
    model learns at once; the habit sits on the answer word, the one token RL has to change.
    With ``near_pages`` > 0 it gives up only when the needle is further back than the last
    ``near_pages`` pages: a demonstrator that recalls what it read last but not what it read
    thousands of tokens earlier, so the SFT policy learns the copy at the answer from the near
    needles (every one of them answered) and RL has to carry it to the far ones. (A habit of
    answering the decoy's note word is not learned by a tiny model: after "The code word is"
    the note word is no copy the model can make.) ``tool_parser`` names the model's tool-call
    format the calls are written in.

    Example:
        >>> expert(0, env_kwargs={"page_words": 20})[-1]
        'The code word is file.'
    """
    env = LongNeedleEnv(**(env_kwargs or {}))
    env.reset(seed=seed)
    rng = random.Random(f"expert:{seed}:{rng_seed}")
    far = env.needle_page < env.num_pages - near_pages
    answer = needle_line("unknown") if far and rng.random() < give_up_prob else needle_line(env.code)
    return [format_tool_call("next_page", {}, tool_parser)] * env.num_pages + [answer]


LongNeedleEnv.expert = staticmethod(expert)  # the same function, reachable from the env class

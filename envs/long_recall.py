"""LongRecall-v0 (long context): read a document page by page, then recall a fact from any page.

Each of ``num_pages`` pages is long filler text with one fact line ``NAME = NN`` (a different name
on every page). The last page ends with the question: the value of one of the names, drawn
uniformly over the pages. The policy pages through with the ``next_page`` tool (one assistant
turn per page), passing the three-digit cursor that the previous page (or, for the first, the
user) gave, and answers ``NAME = NN``. The cursors give every turn a short copy from the context,
the same kind of copy the answer needs from far back. The asked fact is on page 1 as often as on the last
page, so the answer sits anywhere from a few hundred to ``num_pages * page_words`` tokens back;
the value (10-99) occurs nowhere else, so without the asked page in context the best one can do
is a 1-in-90 guess. The filler is words a tiny tokenizer holds as single tokens: long
trajectories that are cheap to render and to prefill, while the facts are a few tokens each.
"""

from __future__ import annotations

import math
import random
import re
from typing import Any

from agentrl.rollout.chat import format_tool_call
from agentrl.envs.base import Message, ToolEnv
from agentrl.envs.calculator import last_integer
from agentrl.envs.tools import tool

__all__ = ["LongRecallEnv", "expert"]

SYSTEM = ("Read every page with the next_page tool and the cursor you were given. The last page asks a "
          "question; reply: NAME = N.")
NAMES = ("apples", "books", "coins", "cards", "marbles", "pens", "boxes", "bags")
FILLER = ("the", "a", "and", "of", "to", "in", "is", "has", "had", "then", "more", "each", "every", "after",
          "before", "Tom", "Anna", "Ben", "Maria", "Sam", "Zoe", "Omar", "Ivy", "Raj", "step", "think", "word",
          "letter", "guess", "try", "again", "list", "file", "search", "open", "read", "problem", "solve")
ANSWER_RE = re.compile(r"([A-Za-z]+) = (\d+)")


class LongRecallEnv(ToolEnv):
    """Page through a long document, then answer a question about one page; reward 1.0 if right.

    Args:
        num_pages: pages, hence assistant turns before the answer.
        page_words: filler words per page: an int, or ``[low, high]`` drawn log-uniformly per page.
        words_per_line: filler words per line.
        max_turns: steps before truncation (default: ``num_pages + 2``).
        **kwargs: ``tool_timeout_s``, ``max_tool_calls_per_turn``, ``max_tool_output_chars``.
    """

    def __init__(self, *, num_pages: int = 4, page_words: int | list[int] | tuple[int, int] = 1800,
                 words_per_line: int = 12, max_turns: int | None = None,
                 max_tool_output_chars: int = 64_000, **kwargs: Any) -> None:
        low, high = (page_words, page_words) if isinstance(page_words, int) else tuple(page_words)
        if not 1 <= num_pages <= len(NAMES) or not 1 <= low <= high or words_per_line < 1:
            raise ValueError(f"need 1 <= num_pages <= {len(NAMES)}, 1 <= page_words (low <= high), "
                             f"words_per_line >= 1; got {num_pages}, {page_words!r}, {words_per_line}")
        super().__init__(max_turns=max_turns or num_pages + 2, max_tool_output_chars=max_tool_output_chars, **kwargs)
        self.num_pages, self.page_words, self.words_per_line = num_pages, (low, high), words_per_line
        self.pages: list[str] = []
        self.facts: list[tuple[str, int]] = []
        self.cursors: list[int] = []
        self.asked = 0
        self.next_index = 0

    def new_task(self, rng: random.Random, options: dict[str, Any]) -> list[Message]:
        names = rng.sample(NAMES, self.num_pages)
        self.facts = list(zip(names, rng.sample(range(10, 100), self.num_pages)))  # distinct: one right answer
        self.asked = rng.randrange(self.num_pages)
        self.cursors = rng.sample(range(100, 1000), self.num_pages)  # three digits: never a fact's value
        self.pages, self.next_index = [], 0
        for i, (name, value) in enumerate(self.facts):
            words = [rng.choice(FILLER) for _ in range(self._page_length(rng))]
            lines = [" ".join(words[k:k + self.words_per_line]) for k in range(0, len(words), self.words_per_line)]
            lines.insert(rng.randrange(len(lines) + 1), f"{name} = {value}")
            head = f"Page {i + 1} of {self.num_pages}."
            last = i == self.num_pages - 1
            tail = [f"Question: what is the value of {self.facts[self.asked][0]}?" if last
                    else f"Next page cursor: {self.cursors[i + 1]}"]
            self.pages.append("\n".join([head, *lines, *tail]))
        return [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"The document has {self.num_pages} pages. First page cursor: "
                                             f"{self.cursors[0]}"}]

    def _page_length(self, rng: random.Random) -> int:
        """Filler words of one page, log-uniform over ``page_words``: with a wide range most pages
        are short (cheap demonstrations) and some are as long as the longest."""
        low, high = self.page_words
        return min(high, int(math.exp(rng.uniform(math.log(low), math.log(high + 1)))))

    @property
    def gold(self) -> int:
        return self.facts[self.asked][1]

    @tool
    def next_page(self, cursor: int) -> str:
        """Read the next page of the document.

        Args:
            cursor: The cursor of the page to read: given for the first page, at the end of each
                page for the next one.
        """
        if self.next_index >= len(self.pages):
            raise IndexError("no more pages: answer the question on the last page")
        if cursor != self.cursors[self.next_index]:
            raise ValueError(f"cursor {cursor} is not the next page's cursor")
        self.next_index += 1
        return self.pages[self.next_index - 1]

    def score(self, answer: str) -> float:
        if self.next_index < len(self.pages):  # the question is on the last page: no answer before it
            return 0.0
        return 1.0 if last_integer(answer) == self.gold else 0.0


def expert(seed: int, *, recency_prob: float = 0.0, env_kwargs: dict[str, Any] | None = None,
           rng_seed: int | None = None, tool_parser: str = "hermes") -> list[str]:
    """An imperfect demonstrator's assistant messages for the episode ``reset(seed=seed)`` starts.

    It reads every page, then answers. With probability ``recency_prob`` it answers with the fact
    of the *last* page instead of the asked one (right only when the last page is the asked one):
    the habit of a reader who recalls what it read most recently. Every demonstration still copies
    a name and its value from the document, so the wrong answers are learnable targets.
    ``tool_parser`` names the model's tool-call format the calls are written in.

    Example:
        >>> expert(0, env_kwargs={"page_words": 20})[-1]
        'apples = 77'
    """
    env = LongRecallEnv(**(env_kwargs or {}))
    env.reset(seed=seed)
    rng = random.Random(f"expert:{seed}:{rng_seed}")
    name, value = env.facts[-1] if rng.random() < recency_prob else env.facts[env.asked]
    return [format_tool_call("next_page", {"cursor": c}, tool_parser) for c in env.cursors] + [f"{name} = {value}"]


LongRecallEnv.expert = staticmethod(expert)  # the same function, reachable from the env class

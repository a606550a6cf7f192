"""Search-v0: two-hop questions over a synthetic corpus generated per seed, with BM25 search.

Each seed builds a small world of people, companies and cities, one document per entity. A question
such as "Who is the manager of the founder of Velora Labs?" needs two documents: the company's (for
its founder) and the founder's (for the manager).
"""

from __future__ import annotations

import random
import string
from collections import Counter
from typing import Any

from rank_bm25 import BM25Okapi

from agentrl.envs.base import Message, ToolEnv
from agentrl.envs.tools import tool

__all__ = ["SearchEnv", "token_f1"]

SYSTEM = ("Answer the question using the search and open tools. Documents describe people, companies and "
          "cities. Give the final answer as <answer>...</answer>.")
FIRST = ("Ada", "Bram", "Cleo", "Dario", "Elin", "Farah", "Goran", "Hana", "Ivo", "Juno", "Kira", "Lev", "Mara",
         "Nils", "Orla", "Pia", "Quinn", "Rhea", "Soren", "Tess", "Ugo", "Vera", "Wim", "Yara", "Zane")
LAST = ("Arden", "Brask", "Calder", "Dunmore", "Eskil", "Falk", "Garrow", "Holm", "Ilves", "Jarl", "Kestrel",
        "Lund", "Morrow", "Norell", "Oakes", "Pell", "Quarry", "Rask", "Stroud", "Thorne", "Vance", "Wick")
STEMS = ("Velo", "Nimbu", "Quanta", "Heli", "Orbi", "Lumen", "Cresta", "Tessel", "Brava", "Kopra", "Zephy", "Maro")
SUFFIXES = ("Labs", "Systems", "Foods", "Motors", "Works", "Media", "Energy", "Bank")
CITIES = ("Port Arvel", "Lindmoor", "Skarsund", "Velmont", "Ostrava Bay", "Kelder", "Mirrowfield", "Tamsin",
          "Brennholt", "Caldera Point", "Yssel", "Norhaven")
ROLES = ("engineer", "designer", "accountant", "chemist", "pilot", "teacher", "lawyer", "analyst")


def normalize(text: str) -> list[str]:
    """Lower-case word tokens without punctuation or articles (SQuAD-style answer normalization)."""
    text = text.lower().translate(str.maketrans(string.punctuation, " " * len(string.punctuation)))
    return [t for t in text.split() if t not in ("a", "an", "the")]


def token_f1(prediction: str, gold: str) -> float:
    """Token-level F1 between two answers after normalization."""
    pred, ref = normalize(prediction), normalize(gold)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


class SearchEnv(ToolEnv):
    """Two-hop QA over a per-seed corpus; reward = token F1 of the final answer (1.0 iff exact match).

    Args:
        num_people: people in the world (each gets a document).
        num_companies: companies (each gets a document).
        top_k: results per search.
        max_turns: steps before truncation.
        **kwargs: ``tool_timeout_s``, ``max_tool_calls_per_turn``, ``max_tool_output_chars``.
    """

    def __init__(self, *, num_people: int = 20, num_companies: int = 8, top_k: int = 5, max_turns: int = 8,
                 **kwargs: Any) -> None:
        super().__init__(max_turns=max_turns, **kwargs)
        if not (2 <= num_people <= len(FIRST) * len(LAST) and 1 <= num_companies <= len(STEMS) * len(SUFFIXES)):
            raise ValueError(f"num_people must be in [2, {len(FIRST) * len(LAST)}] and num_companies in "
                             f"[1, {len(STEMS) * len(SUFFIXES)}], got {num_people} and {num_companies}")
        self.num_people, self.num_companies, self.top_k = num_people, num_companies, top_k
        self.docs: dict[str, tuple[str, str]] = {}
        self.gold = ""

    def new_task(self, rng: random.Random, options: dict[str, Any]) -> list[Message]:
        people = rng.sample([f"{f} {l}" for f in FIRST for l in LAST], self.num_people)
        companies = rng.sample([f"{s}{'ra' if s[-1] in 'aeiou' else 'ix'} {x}" for s in STEMS for x in SUFFIXES],
                               self.num_companies)
        born = {p: rng.choice(CITIES) for p in people}
        works = {p: rng.choice(companies) for p in people}
        manager = {p: rng.choice([q for q in people if q != p]) for p in people}
        founder = {c: rng.choice(people) for c in companies}
        based = {c: rng.choice(CITIES) for c in companies}
        texts = {p: f"{p} is a {rng.choice(ROLES)} born in {born[p]}. {p} works at {works[p]}, "
                    f"where the manager of {p} is {manager[p]}." for p in people}
        texts.update({c: f"{c} is a company based in {based[c]}. {c} was founded in {rng.randint(1950, 2020)} "
                         f"by {founder[c]}." for c in companies})
        titles = list(texts)
        rng.shuffle(titles)
        self.docs = {f"d{i:03d}": (title, texts[title]) for i, title in enumerate(titles)}
        self._ids = list(self.docs)
        self._bm25 = BM25Okapi([normalize(f"{t} {x}") for t, x in self.docs.values()])
        company, person = rng.choice(companies), rng.choice(people)
        question, self.gold = rng.choice([
            (f"Who is the manager of the founder of {company}?", manager[founder[company]]),
            (f"In which city was the founder of {company} born?", born[founder[company]]),
            (f"In which city is the company that {person} works at based?", based[works[person]]),
            (f"Who founded the company that {person} works at?", founder[works[person]]),
        ])
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]

    @tool
    def search(self, query: str) -> str:
        """Search the documents with BM25.

        Args:
            query: Keywords, e.g. a name.
        """
        scores = self._bm25.get_scores(normalize(query)[:64])
        ranked = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[: self.top_k]
        hits = [self._ids[i] for i in ranked if scores[i] > 0]
        return "\n".join(f"[{d}] {self.docs[d][0]}: {self.docs[d][1][:60]}..." for d in hits) or "No results."

    @tool
    def open(self, doc_id: str) -> str:
        """Read a whole document.

        Args:
            doc_id: A document id from search results, e.g. "d007".
        """
        if doc_id.strip() not in self.docs:
            raise ValueError(f"no document {doc_id[:40]!r}; ids look like 'd007'")
        title, text = self.docs[doc_id.strip()]
        return f"[{doc_id.strip()}] {title}\n{text}"

    def score(self, answer: str) -> float:
        end = answer.rfind("</answer>")  # rfind, not a lazy regex: linear on any text
        start = answer.rfind("<answer>", 0, max(end, 0))
        if end >= 0 and start >= 0:
            text = answer[start + len("<answer>"):end]
        else:
            text = (answer.strip().splitlines() or [""])[-1]
        return 1.0 if normalize(text) == normalize(self.gold) else token_f1(text, self.gold)

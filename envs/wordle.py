"""Wordle-v0: a tool-free multi-turn game; each guess gets per-letter feedback as a user message."""

from __future__ import annotations

import random
import re
from typing import Any

from agentrl.envs.base import Message, TextEnv, Turn

__all__ = ["WordleEnv", "feedback"]

WORDS = tuple("""
about above actor adapt admit adopt after again agent agree alarm album alert alike alive allow alone
along alter among anger angle apple apply arena argue arise array aside asset audio avoid award aware
badge basic beach begin being below bench birth black blade blame blank blast blend blind block blood
board boost brain brand brave bread break brick brief bring broad brown brush build bunch buyer cabin
cable candy cargo carry catch cause chain chair chalk charm chart chase cheap check chest chief child
civil claim class clean clear climb clock close cloud coach coast could count court cover craft crane
crash cream crime cross crowd crown curve cycle daily dance dealt death delay depth doubt dozen draft
drama dream dress drink drive eager early earth eight elbow elite empty enemy enjoy enter entry equal
error event every exact exist extra faith false fancy fault feast fence fiber field fifty fight final
flame flash fleet floor fluid focus force forth forty forum frame fresh front fruit giant glass globe
grace grade grain grand grant grape grass great green group guard guess guide happy heart heavy hobby
honey horse hotel house human humor ideal image index inner input issue joint judge juice knife label
large laser later laugh layer learn lease least leave legal lemon level light limit linen logic loose
lover lower loyal lucky lunch magic major maker march match maybe mayor medal metal meter minor model
money month moral motor mount mouse mouth movie music nerve never night noble noise north novel nurse
ocean offer often olive onion opera orbit order other outer owner paint panel paper party peace pearl
phase phone photo piano piece pilot pitch place plain plane plant plate point polar pound power press
""".split())
SYSTEM = ("Let's play Wordle. Guess the secret five-letter English word in at most six guesses. Reply with "
          "one guess in square brackets, e.g. [crane]. After each guess you get feedback per letter: "
          "G = right letter, right place; Y = in the word, elsewhere; - = not in the word.")


def feedback(guess: str, secret: str) -> str:
    """Per-letter marks (G, Y, -) with Wordle's rule for repeated letters."""
    marks = ["-"] * 5
    unmatched = [s for g, s in zip(guess, secret) if g != s]
    for i, (g, s) in enumerate(zip(guess, secret)):
        if g == s:
            marks[i] = "G"
        elif g in unmatched:
            marks[i] = "Y"
            unmatched.remove(g)
    return "".join(marks)


class WordleEnv(TextEnv):
    """Wordle with six guesses; reward 1.0 when solved. Guesses need not be dictionary words.

    Args:
        max_guesses: valid guesses before the game is lost (terminated).
        max_turns: steps before truncation (malformed replies also use turns).
    """

    def __init__(self, *, max_guesses: int = 6, max_turns: int = 10) -> None:
        super().__init__(max_turns=max_turns)
        self.max_guesses = max_guesses
        self.secret, self.guesses = "", []

    def new_task(self, rng: random.Random, options: dict[str, Any]) -> list[Message]:
        self.secret, self.guesses = rng.choice(WORDS), []
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Make your first guess."}]

    def respond(self, action: str) -> Turn:
        found = re.findall(r"\[\s*([A-Za-z]{5})\s*\]", action) if isinstance(action, str) else []
        if not found:
            error = "no guess found: reply with one five-letter word in square brackets, e.g. [crane]"
            return Turn([{"role": "user", "content": f"Error: {error}."}], error=error)
        guess = found[-1].lower()
        self.guesses.append(guess)
        marks, left = feedback(guess, self.secret), self.max_guesses - len(self.guesses)
        if guess == self.secret:
            text = f"{guess.upper()}: {marks}. Solved in {len(self.guesses)} guesses!"
            return Turn([{"role": "user", "content": text}], reward=1.0, terminated=True, success=True,
                        info={"feedback": marks})
        if left == 0:
            text = f"{guess.upper()}: {marks}. Out of guesses; the word was {self.secret.upper()}."
            return Turn([{"role": "user", "content": text}], terminated=True, info={"feedback": marks})
        text = f"{guess.upper()}: {marks}. {left} guess{'es' if left > 1 else ''} left."
        return Turn([{"role": "user", "content": text}], info={"feedback": marks})

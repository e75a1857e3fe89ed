"""What every toolworld domain module is made of: blueprints, worked examples, the domain record, entity pools.

The domain modules (:mod:`.shop`, :mod:`.calendar`, :mod:`.weather`, :mod:`.bank`) build their
:class:`Domain` from these pieces; :mod:`lopd_core.envs.toolworld` turns domains into a suite.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lopd_core.envs.base import Split
from lopd_core.envs.tool_env import AnswerItem
from lopd_core.envs.tools import Toolbox, format_tool_call, format_tool_response, schema_of

LEVELS = (1, 2, 3, 4)


@dataclass
class Blueprint:
    instruction: str
    state: dict[str, Any]
    calls: list[tuple[str, dict[str, Any]]]
    """The calls of a correct solution, in order."""
    answer: list[AnswerItem]
    final_answer: str
    checked_calls: list[int] | None = None
    """Indices of ``calls`` that the checklist requires (None = all)."""


Kind = Callable[[random.Random, Split], Blueprint]


@dataclass
class Shot:
    """A worked example shown as real chat turns before the task: request, call, tool response, answer."""

    request: str
    call: tuple[str, dict[str, Any]]
    response: Any
    answer: str

    def messages(self) -> list[dict[str, Any]]:
        return [{"role": "user", "content": self.request},
                {"role": "assistant", "content": format_tool_call(*self.call)},
                {"role": "tool", "content": format_tool_response(self.response)},
                {"role": "assistant", "content": self.answer}]


@dataclass
class Domain:
    name: str
    tools_class: type
    """Instantiated with the state dict; its public methods listed in ``tool_names`` are the tools."""
    tool_names: list[str]
    system_prompt: str
    kinds: dict[int, list[Kind]]
    shots: list[Shot] = field(default_factory=list)
    """Worked examples (entities outside both splits' pools) played before the user's request."""
    _schemas: list[dict[str, Any]] = field(default_factory=list, repr=False)

    @property
    def schemas(self) -> list[dict[str, Any]]:
        if not self._schemas:
            probe = self.tools_class({})
            self._schemas = [schema_of(getattr(probe, n)) for n in self.tool_names]
        return self._schemas

    def toolbox(self, state: dict[str, Any]) -> tuple[Toolbox, Callable[[], dict[str, Any]]]:
        tools = self.tools_class(state)
        box = Toolbox({n: getattr(tools, n) for n in self.tool_names}, self.schemas)
        return box, lambda: tools.state


def system_prompt(role: str) -> str:
    """Compact domain prompt: the role and the rules (the worked examples follow as chat turns)."""
    return (f"{role} Use the tools to look things up and to make changes; never invent data. "
            "After the tool responses, answer the user in one short sentence (no tool call).")


def pick(rng: random.Random, pools: dict[str, list[Any]], split: Split, k: int = 1) -> list[Any]:
    """k distinct entities from the split's half of a pool."""
    return rng.sample(pools[split], k)


class Phrasing(str):
    """A task's request, remembering the template it was phrased from (the evaluation clusters by it)."""

    template: str = ""


def phrase(rng: random.Random, phrasings: dict[str, list[str]], split: Split, **values: Any) -> Phrasing:
    template = rng.choice(phrasings[split])
    text = Phrasing(template.format(**values))
    text.template = template
    return text


def ident(rng: random.Random, split: Split, width: int = 3) -> str:
    """An id whose prefix letter is from the split's half of the alphabet (entities never cross splits)."""
    letters = "ABCDEFGHJKLM" if split == "train" else "NPQRSTUVWXYZ"
    return rng.choice(letters) + "".join(rng.choice("0123456789") for _ in range(width))


# Entity pools: the train half and the test half never share a value.
PEOPLE = {
    "train": ["Alice Moreau", "Bram Jensen", "Chloe Park", "Diego Alvarez", "Elena Rossi", "Farid Haddad",
              "Grace Liu", "Hugo Lambert", "Ines Costa", "Jonas Weber", "Keiko Tanaka", "Liam O'Brien",
              "Maya Patel", "Nils Berg", "Olga Petrova", "Pablo Ruiz"],
    "test": ["Quinn Foster", "Rosa Marin", "Sven Olsen", "Tara Singh", "Umar Khan", "Vera Novak",
             "Wen Zhao", "Ximena Torres", "Yusuf Demir", "Zoe Martin", "Arjun Mehta", "Bea Schulz"],
}
CITIES = {
    "train": ["Lisbon", "Oslo", "Nairobi", "Lima", "Osaka", "Dublin", "Cairo", "Denver", "Hanoi", "Perth",
              "Porto", "Quito", "Seville", "Tallinn"],
    "test": ["Reykjavik", "Accra", "Bogota", "Kyoto", "Glasgow", "Tunis", "Austin", "Manila", "Adelaide",
             "Krakow", "Valencia", "Riga"],
}
PRODUCTS = {
    "train": ["desk lamp", "water bottle", "yoga mat", "coffee grinder", "backpack", "phone case", "notebook",
              "headphones", "tea kettle", "umbrella", "bike light", "plant pot"],
    "test": ["wool scarf", "chess set", "travel mug", "desk fan", "hiking socks", "picture frame", "kitchen scale",
             "bluetooth speaker", "rain jacket", "wall clock"],
}
TITLES = {
    "train": ["design review", "budget sync", "team standup", "client call", "1:1 with manager", "sprint planning",
              "lunch with Sam", "dentist", "hiring panel", "roadmap workshop"],
    "test": ["board prep", "vendor demo", "retro", "yoga class", "quarterly review", "parent meeting",
             "code walkthrough", "coffee with Ana"],
}

"""toolworld domain 'weather': current conditions per city and a unit converter (read-only)."""

from __future__ import annotations

import random
from typing import Any, Literal

from lopd_core.envs.base import Split
from lopd_core.envs.tool_env import AnswerItem
from lopd_core.envs.tools import ToolFailure
from lopd_core.envs.toolworld.domain import CITIES, Blueprint, Domain, Shot, phrase, pick, system_prompt

CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "foggy", "snowy"]


def c_to_f(value: float) -> float:
    return round(value * 9 / 5 + 32, 1)


class WeatherTools:
    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state
        self.state.setdefault("cities", {})

    def get_weather(self, city: str) -> dict:
        """Current weather of a city (temperature in Celsius).

        Args:
            city: City name.
        """
        for name, record in self.state["cities"].items():
            if name.lower() == city.strip().lower():
                return {"city": name, **record}
        raise ToolFailure(f"no weather station for {city}")

    def convert_temperature(self, value: float, to_unit: Literal["F", "C"]) -> dict:
        """Convert a temperature (C to F or F to C).

        Args:
            value: Temperature.
            to_unit: Target unit.
        """
        if to_unit == "F":
            return {"value": c_to_f(value), "unit": "F"}
        return {"value": round((value - 32) * 5 / 9, 1), "unit": "C"}


def _cities(rng: random.Random, split: Split, n: int) -> tuple[dict, list[str]]:
    names = pick(rng, CITIES, split, n + 2)
    temps = rng.sample(range(-8, 36), n + 2)
    cities = {c: {"temp_c": float(t), "condition": rng.choice(CONDITIONS), "humidity": rng.randint(20, 95)}
              for c, t in zip(names, temps, strict=True)}
    return {"cities": cities}, names[:n]


def temp_celsius(rng: random.Random, split: Split) -> Blueprint:
    state, (city,) = _cities(rng, split, 1)
    t = state["cities"][city]["temp_c"]
    text = phrase(rng, {"train": ["What is the temperature in {c} right now?", "How warm is it in {c}?"],
                        "test": ["Tell me the current temperature in {c}.", "Is it cold in {c}? Give the temperature."]},
                  split, c=city)
    return Blueprint(text, state, [("get_weather", {"city": city})],
                     [AnswerItem(number=t, tolerance=0.5, unit="C", other=c_to_f(t))], f"It is {t:g} °C in {city}.")


def condition(rng: random.Random, split: Split) -> Blueprint:
    state, (city,) = _cities(rng, split, 1)
    cond = state["cities"][city]["condition"]
    text = phrase(rng, {"train": ["What's the weather like in {c}?"], "test": ["Describe today's sky in {c}."]},
                  split, c=city)
    return Blueprint(text, state, [("get_weather", {"city": city})], [AnswerItem(text=cond)],
                     f"It is {cond} in {city}.")


def convert_only(rng: random.Random, split: Split) -> Blueprint:
    state, _ = _cities(rng, split, 1)
    t = float(rng.randint(-10, 35))
    f = c_to_f(t)
    text = phrase(rng, {"train": ["What is {t:g} °C in Fahrenheit?"], "test": ["Convert {t:g} degrees Celsius to °F."]},
                  split, t=t)
    return Blueprint(text, state, [("convert_temperature", {"value": t, "to_unit": "F"})],
                     [AnswerItem(number=f, tolerance=0.6, unit="F", other=t)], f"{t:g} °C is {f:g} °F.")


def temp_fahrenheit(rng: random.Random, split: Split) -> Blueprint:
    state, (city,) = _cities(rng, split, 1)
    t = state["cities"][city]["temp_c"]
    text = phrase(rng, {"train": ["What is the temperature in {c} in Fahrenheit?"],
                        "test": ["Give me {c}'s current temperature in °F."]}, split, c=city)
    f = c_to_f(t)
    return Blueprint(text, state, [("get_weather", {"city": city}), ("convert_temperature", {"value": t, "to_unit": "F"})],
                     [AnswerItem(number=f, tolerance=0.6, unit="F", other=t)], f"It is {f:g} °F in {city}.",
                     checked_calls=[0])


def warmer_of_two(rng: random.Random, split: Split) -> Blueprint:
    state, (a, b) = _cities(rng, split, 2)
    warm = max((a, b), key=lambda c: state["cities"][c]["temp_c"])
    f = c_to_f(state["cities"][warm]["temp_c"])
    text = phrase(rng, {"train": ["Which is warmer right now, {a} or {b}? Give its temperature in Fahrenheit."],
                        "test": ["Compare {a} and {b}: which one is hotter, and how hot in °F?"]}, split, a=a, b=b)
    calls = [("get_weather", {"city": a}), ("get_weather", {"city": b}),
             ("convert_temperature", {"value": state["cities"][warm]["temp_c"], "to_unit": "F"})]
    return Blueprint(text, state, calls, [AnswerItem(text=warm), AnswerItem(number=f, tolerance=0.6)],
                     f"{warm} is warmer: {f:g} °F.", checked_calls=[0, 1])


def warmest_of_three(rng: random.Random, split: Split) -> Blueprint:
    state, cities = _cities(rng, split, 3)
    warm = max(cities, key=lambda c: state["cities"][c]["temp_c"])
    cold = min(cities, key=lambda c: state["cities"][c]["temp_c"])
    f = c_to_f(state["cities"][warm]["temp_c"])
    text = phrase(rng, {"train": ["Of {a}, {b} and {c}, which is the warmest and which the coldest? "
                                  "Give the warmest one's temperature in Fahrenheit."],
                        "test": ["Rank {a}, {b}, {c} by temperature: name the hottest (in °F) and the coldest."]},
                  split, a=cities[0], b=cities[1], c=cities[2])
    calls = [("get_weather", {"city": c}) for c in cities] + [
        ("convert_temperature", {"value": state["cities"][warm]["temp_c"], "to_unit": "F"})]
    return Blueprint(text, state, calls, [AnswerItem(text=warm), AnswerItem(text=cold), AnswerItem(number=f, tolerance=0.6)],
                     f"The warmest is {warm} at {f:g} °F; the coldest is {cold}.", checked_calls=[0, 1, 2])


DOMAIN = Domain(
    name="weather", tools_class=WeatherTools, tool_names=["get_weather", "convert_temperature"],
    system_prompt=system_prompt("You are a weather assistant."),
    shots=[Shot("Convert 10 °C to Fahrenheit.", ("convert_temperature", {"value": 10.0, "to_unit": "F"}),
                {"value": 50.0, "unit": "F"}, "10 °C is 50 °F."),
           Shot("And 68 °F in Celsius?", ("convert_temperature", {"value": 68.0, "to_unit": "C"}),
                {"value": 20.0, "unit": "C"}, "68 °F is 20 °C.")],
    kinds={1: [temp_celsius, condition, convert_only], 2: [temp_fahrenheit], 3: [warmer_of_two], 4: [warmest_of_three]},
)

"""toolworld domain 'calendar': one person's meetings (list a day, create, move, delete)."""

from __future__ import annotations

import random
from typing import Any

from lopd_core.envs.base import Split
from lopd_core.envs.tool_env import AnswerItem
from lopd_core.envs.tools import ToolFailure
from lopd_core.envs.toolworld.domain import (
    PEOPLE,
    TITLES,
    Blueprint,
    Domain,
    Shot,
    ident,
    phrase,
    pick,
    system_prompt,
)

DAYS = {"train": ["2026-06-01", "2026-06-02", "2026-06-03", "2026-06-04", "2026-06-05"],
        "test": ["2026-06-08", "2026-06-09", "2026-06-10", "2026-06-11"]}


def _valid_time(value: str) -> str:
    parts = value.strip().split(":")
    if len(parts) != 2 or not all(p.isdigit() for p in parts) or not (0 <= int(parts[0]) < 24 and 0 <= int(parts[1]) < 60):
        raise ToolFailure(f"time {value!r} must be HH:MM (24-hour), e.g. 14:30")
    return f"{int(parts[0]):02d}:{int(parts[1]):02d}"


class CalendarTools:
    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state
        self.state.setdefault("events", {})

    def list_events(self, date: str) -> list:
        """List the meetings of one day.

        Args:
            date: YYYY-MM-DD.
        """
        rows = [{"event_id": eid, "title": e["title"], "start": e["start"], "duration_min": e["duration_min"],
                 **({"with": e["with"]} if e["with"] else {})}
                for eid, e in self.state["events"].items() if e["date"] == date.strip()]
        return sorted(rows, key=lambda r: r["start"])

    def create_event(self, title: str, date: str, start: str, duration_min: int) -> dict:
        """Add a meeting.

        Args:
            title: Meeting title.
            date: YYYY-MM-DD.
            start: HH:MM (24-hour).
            duration_min: Minutes.
        """
        eid = f"E{len(self.state['events']) + 1:03d}"
        while eid in self.state["events"]:
            eid = "E" + str(int(eid[1:]) + 1).zfill(3)
        self.state["events"][eid] = {"title": title, "date": date.strip(), "start": _valid_time(start),
                                     "duration_min": int(duration_min), "with": ""}
        return {"event_id": eid, **self.state["events"][eid]}

    def move_event(self, event_id: str, start: str) -> dict:
        """Move a meeting to a new start time (same day).

        Args:
            event_id: Meeting id.
            start: New start, HH:MM.
        """
        event = self._event(event_id)
        event["start"] = _valid_time(start)
        return {"event_id": event_id.strip().upper(), **event}

    def delete_event(self, event_id: str) -> dict:
        """Delete a meeting.

        Args:
            event_id: Meeting id.
        """
        self._event(event_id)
        del self.state["events"][event_id.strip().upper()]
        return {"event_id": event_id.strip().upper(), "deleted": True}

    def _event(self, event_id: str) -> dict[str, Any]:
        event = self.state["events"].get(event_id.strip().upper())
        if event is None:
            raise ToolFailure(f"event {event_id} not found")
        return event


# --------------------------------------------------------------------------------------------------
def _day(rng: random.Random, split: Split, n: int, date: str, state: dict | None = None,
         people: list[str] | None = None) -> tuple[dict, list[str]]:
    state = state or {"events": {}}
    titles = rng.sample(TITLES[split], n)
    hours = sorted(rng.sample(range(8, 18), n))
    ids = []
    for title, hour in zip(titles, hours, strict=True):
        eid = ident(rng, split)
        while eid in state["events"]:
            eid = ident(rng, split)
        state["events"][eid] = {"title": title, "date": date, "start": f"{hour:02d}:{rng.choice(['00', '30'])}",
                                "duration_min": rng.choice([30, 45, 60]), "with": rng.choice(people or [""])}
        ids.append(eid)
    return state, ids


def start_time(rng: random.Random, split: Split) -> Blueprint:
    date, = pick(rng, DAYS, split)
    state, ids = _day(rng, split, rng.randint(2, 3), date)
    event = state["events"][rng.choice(ids)]
    text = phrase(rng, {"train": ["What time does the {t} start on {d}?", "When is my {t} on {d}?"],
                        "test": ["On {d}, at what time is the {t}?", "Check {d} for me: when does the {t} begin?"]},
                  split, t=event["title"], d=date)
    return Blueprint(text, state, [("list_events", {"date": date})], [AnswerItem(text=event["start"])],
                     f"The {event['title']} starts at {event['start']} on {date}.")


def count_meetings(rng: random.Random, split: Split) -> Blueprint:
    date, = pick(rng, DAYS, split)
    n = rng.randint(1, 4)
    state, _ = _day(rng, split, n, date)
    other, = [d for d in pick(rng, DAYS, split, 2) if d != date][:1] or [date]
    if other != date:
        _day(rng, split, rng.randint(1, 2), other, state)
    text = phrase(rng, {"train": ["How many meetings do I have on {d}?"],
                        "test": ["Count my meetings on {d}, please."]}, split, d=date)
    return Blueprint(text, state, [("list_events", {"date": date})], [AnswerItem(number=n, only=True)],
                     f"You have {n} meeting{'s' if n != 1 else ''} on {date}.")


def meeting_partner(rng: random.Random, split: Split) -> Blueprint:
    date, = pick(rng, DAYS, split)
    people = pick(rng, PEOPLE, split, 3)
    state, ids = _day(rng, split, rng.randint(2, 3), date, people=people)
    event = state["events"][rng.choice(ids)]
    text = phrase(rng, {"train": ["Who is the {t} on {d} with?"], "test": ["On {d}, whom do I meet for the {t}?"]},
                  split, t=event["title"], d=date)
    return Blueprint(text, state, [("list_events", {"date": date})], [AnswerItem(text=event["with"])],
                     f"The {event['title']} is with {event['with']}.")


def move_meeting(rng: random.Random, split: Split) -> Blueprint:
    date, = pick(rng, DAYS, split)
    state, ids = _day(rng, split, 3, date)
    eid = rng.choice(ids)
    title = state["events"][eid]["title"]
    taken = {state["events"][i]["start"][:2] for i in ids}
    new = f"{rng.choice([h for h in range(8, 19) if f'{h:02d}' not in taken]):02d}:00"
    text = phrase(rng, {"train": ["Move my {t} on {d} to {n}."], "test": ["Please reschedule the {t} on {d} to start at {n}."]},
                  split, t=title, d=date, n=new)
    return Blueprint(text, state, [("list_events", {"date": date}), ("move_event", {"event_id": eid, "start": new})],
                     [AnswerItem(text=new)], f"The {title} on {date} now starts at {new}.")


def clear_person(rng: random.Random, split: Split) -> Blueprint:
    date, = pick(rng, DAYS, split)
    person, other = pick(rng, PEOPLE, split, 2)
    state, ids = _day(rng, split, 4, date, people=[other])
    doomed = rng.sample(ids, 2)
    for eid in doomed:
        state["events"][eid]["with"] = person
    text = phrase(rng, {"train": ["Cancel all my meetings with {p} on {d}."],
                        "test": ["{p} is away on {d}: delete every meeting I have with them that day."]},
                  split, p=person, d=date)
    calls = [("list_events", {"date": date})] + [("delete_event", {"event_id": e}) for e in doomed]
    return Blueprint(text, state, calls, [AnswerItem(number=2, only=True, label="the answer says 2 meetings were removed")],
                     f"I deleted the 2 meetings with {person} on {date}.")


def book_and_shift(rng: random.Random, split: Split) -> Blueprint:
    date, = pick(rng, DAYS, split)
    state, ids = _day(rng, split, 3, date)
    clash = rng.choice(ids)
    title, = [t for t in pick(rng, TITLES, split, 4) if t not in {e["title"] for e in state["events"].values()}][:1]
    start = state["events"][clash]["start"]
    taken = {state["events"][i]["start"][:2] for i in ids}
    later = f"{max(h for h in range(8, 20) if f'{h:02d}' not in taken):02d}:00"
    text = phrase(rng, {"train": ["Book a 30-minute {t} on {d} at {s}. If another meeting starts then, move it to {l}, "
                                  "and tell me which meeting you moved."],
                        "test": ["I need {t} (30 min) on {d} at {s}; shift whatever already starts at {s} to {l} "
                                 "and tell me what you shifted."]},
                  split, t=title, d=date, s=start, l=later)
    clash_title = state["events"][clash]["title"]
    calls = [("list_events", {"date": date}), ("move_event", {"event_id": clash, "start": later}),
             ("create_event", {"title": title, "date": date, "start": start, "duration_min": 30}),
             ("list_events", {"date": date})]
    return Blueprint(text, state, calls, [AnswerItem(text=clash_title)],
                     f"I moved the {clash_title} to {later} and booked the {title} at {start}.", checked_calls=[0, 1, 2])


DOMAIN = Domain(
    name="calendar", tools_class=CalendarTools, tool_names=["list_events", "create_event", "move_event", "delete_event"],
    system_prompt=system_prompt("You manage the user's calendar."),
    shots=[Shot("What's on my calendar on 2026-01-15?", ("list_events", {"date": "2026-01-15"}),
                [{"event_id": "A1234", "title": "team lunch", "start": "12:00", "duration_min": 60}],
                "On 2026-01-15 you have the team lunch at 12:00."),
           Shot("When does the gym session start on 2026-02-20?", ("list_events", {"date": "2026-02-20"}),
                [{"event_id": "B7777", "title": "gym session", "start": "07:30", "duration_min": 45}],
                "The gym session starts at 07:30.")],
    kinds={1: [start_time, count_meetings, meeting_partner], 2: [move_meeting], 3: [clear_person], 4: [book_and_shift]},
)

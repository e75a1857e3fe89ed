"""toolworld domain 'shop': orders of an online shop (look up, list, cancel, change the address)."""

from __future__ import annotations

import random
from typing import Any

from lopd_core.envs.base import Split
from lopd_core.envs.tool_env import AnswerItem
from lopd_core.envs.tools import ToolFailure
from lopd_core.envs.toolworld.domain import (
    PEOPLE,
    PRODUCTS,
    Blueprint,
    Domain,
    Shot,
    ident,
    phrase,
    pick,
    system_prompt,
)

STREETS = {"train": ["Harbor Street", "Maple Avenue", "Mill Lane", "Station Road", "Park Row"],
           "test": ["Cedar Court", "Lake Drive", "Orchard Way", "Bridge End"]}


class ShopTools:
    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state
        self.state.setdefault("orders", {})

    def _order(self, order_id: str) -> dict[str, Any]:
        order = self.state["orders"].get(order_id.strip().upper())
        if order is None:
            raise ToolFailure(f"order {order_id} not found")
        return order

    def get_order(self, order_id: str) -> dict:
        """Look up one order.

        Args:
            order_id: Order id.
        """
        return {"order_id": order_id.strip().upper(), **self._order(order_id)}

    def list_orders(self, customer: str) -> list:
        """A customer's orders, newest first.

        Args:
            customer: Full name.
        """
        rows = [{"order_id": oid, "placed": o["placed"], "status": o["status"]}
                for oid, o in self.state["orders"].items() if o["customer"].lower() == customer.strip().lower()]
        return sorted(rows, key=lambda r: r["placed"], reverse=True)

    def cancel_order(self, order_id: str) -> dict:
        """Cancel an unshipped order; returns the refund.

        Args:
            order_id: Order id.
        """
        order = self._order(order_id)
        if order["status"] != "processing":
            raise ToolFailure(f"order {order_id} is {order['status']} and cannot be cancelled")
        order["status"] = "cancelled"
        return {"order_id": order_id.strip().upper(), "status": "cancelled", "refund": order["total"]}

    def update_address(self, order_id: str, address: str) -> dict:
        """Change the address of an unshipped order.

        Args:
            order_id: Order id.
            address: New address.
        """
        order = self._order(order_id)
        if order["status"] != "processing":
            raise ToolFailure(f"order {order_id} is {order['status']}; its address can no longer change")
        order["address"] = address
        return {"order_id": order_id.strip().upper(), "address": address}


# --------------------------------------------------------------------------------------------------
def _state(rng: random.Random, split: Split, customer: str, statuses: list[str]) -> tuple[dict, list[str]]:
    """Orders of ``customer`` (one per status, newest first) plus distractor orders of other people."""
    orders, mine = {}, []
    others = [p for p in PEOPLE[split] if p != customer]
    day = rng.randint(1, 9)
    for status in statuses:
        oid = ident(rng, split)
        while oid in orders:
            oid = ident(rng, split)
        day += rng.randint(1, 4)
        orders[oid] = {"customer": customer, "product": rng.choice(PRODUCTS[split]), "status": status,
                       "total": round(rng.uniform(8, 180), 2), "address": _address(rng, split),
                       "placed": f"2026-05-{day:02d}"}
        mine.append(oid)
    for _ in range(rng.randint(2, 3)):
        oid = ident(rng, split)
        if oid not in orders:
            orders[oid] = {"customer": rng.choice(others), "product": rng.choice(PRODUCTS[split]),
                           "status": rng.choice(["processing", "shipped"]), "total": round(rng.uniform(8, 180), 2),
                           "address": _address(rng, split), "placed": f"2026-05-{rng.randint(1, 28):02d}"}
    return {"orders": orders}, mine


def _address(rng: random.Random, split: Split) -> str:
    return f"{rng.randint(2, 99)} {rng.choice(STREETS[split])}"


def order_status(rng: random.Random, split: Split) -> Blueprint:
    customer, = pick(rng, PEOPLE, split)
    status = rng.choice(["processing", "shipped", "delivered"])
    state, mine = _state(rng, split, customer, [status])
    oid = mine[0]
    text = phrase(rng, {"train": ["What is the status of order {o}?", "Has my order {o} shipped yet?"],
                        "test": ["Can you check where order {o} is?", "Order {o}: what's its current status?"]},
                  split, o=oid)
    return Blueprint(text, state, [("get_order", {"order_id": oid})], [AnswerItem(text=status)],
                     f"Order {oid} is {status}.")


def order_total(rng: random.Random, split: Split) -> Blueprint:
    customer, = pick(rng, PEOPLE, split)
    state, mine = _state(rng, split, customer, [rng.choice(["processing", "shipped", "delivered"])])
    oid = mine[0]
    total = state["orders"][oid]["total"]
    text = phrase(rng, {"train": ["How much did order {o} cost?"], "test": ["What was the total of order {o}?"]},
                  split, o=oid)
    return Blueprint(text, state, [("get_order", {"order_id": oid})], [AnswerItem(number=total)],
                     f"Order {oid} cost {total:.2f}.")


def count_orders(rng: random.Random, split: Split) -> Blueprint:
    customer, = pick(rng, PEOPLE, split)
    n = rng.randint(1, 4)
    state, _ = _state(rng, split, customer, [rng.choice(["processing", "shipped", "delivered"]) for _ in range(n)])
    text = phrase(rng, {"train": ["How many orders has {c} placed?"], "test": ["Count the orders of {c}, please."]},
                  split, c=customer)
    return Blueprint(text, state, [("list_orders", {"customer": customer})], [AnswerItem(number=n, only=True)],
                     f"{customer} has placed {n} order{'s' if n != 1 else ''}.")


def latest_product(rng: random.Random, split: Split) -> Blueprint:
    customer, = pick(rng, PEOPLE, split)
    state, mine = _state(rng, split, customer, rng.sample(["processing", "shipped", "delivered"], 2))
    newest = mine[-1]
    product = state["orders"][newest]["product"]
    text = phrase(rng, {"train": ["What did {c} order most recently?"],
                        "test": ["Which product is in {c}'s newest order?"]}, split, c=customer)
    return Blueprint(text, state, [("list_orders", {"customer": customer}), ("get_order", {"order_id": newest})],
                     [AnswerItem(text=product)], f"{customer}'s most recent order ({newest}) is a {product}.")


def cancel_open(rng: random.Random, split: Split) -> Blueprint:
    customer, = pick(rng, PEOPLE, split)
    state, mine = _state(rng, split, customer, rng.sample(["processing", "shipped", "delivered"], 2))
    oid = next(o for o in mine if state["orders"][o]["status"] == "processing") if any(
        state["orders"][o]["status"] == "processing" for o in mine) else None
    if oid is None:  # make sure there is exactly one open order to cancel
        oid = mine[0]
        state["orders"][oid]["status"] = "processing"
    refund = state["orders"][oid]["total"]
    text = phrase(rng, {"train": ["Please cancel {c}'s order that has not shipped yet, and tell me the refund."],
                        "test": ["{c} wants to cancel the order that is still processing. How much is refunded?"]},
                  split, c=customer)
    return Blueprint(text, state, [("list_orders", {"customer": customer}), ("cancel_order", {"order_id": oid})],
                     [AnswerItem(number=refund)], f"I cancelled order {oid}; the refund is {refund:.2f}.")


def readdress_open(rng: random.Random, split: Split) -> Blueprint:
    customer, = pick(rng, PEOPLE, split)
    state, mine = _state(rng, split, customer, ["processing", "shipped", "processing"])
    address = _address(rng, split)
    open_ids = [o for o in mine if state["orders"][o]["status"] == "processing"]
    text = phrase(rng, {"train": ["{c} moved to {a}. Update the address of all their orders that have not shipped."],
                        "test": ["Change the shipping address to {a} on every unshipped order of {c}."]},
                  split, c=customer, a=address)
    calls = [("list_orders", {"customer": customer})] + [("update_address", {"order_id": o, "address": address})
                                                          for o in open_ids]
    return Blueprint(text, state, calls, [AnswerItem(text=address)],
                     f"Done: orders {' and '.join(open_ids)} now ship to {address}.")


def cancel_all_open(rng: random.Random, split: Split) -> Blueprint:
    customer, = pick(rng, PEOPLE, split)
    state, mine = _state(rng, split, customer, ["processing", "delivered", "processing", "processing"])
    open_ids = [o for o in mine if state["orders"][o]["status"] == "processing"]
    refund = round(sum(state["orders"][o]["total"] for o in open_ids), 2)
    text = phrase(rng, {"train": ["Cancel every order of {c} that is still processing and tell me the total refund."],
                        "test": ["{c} wants all unshipped orders cancelled. What is the refund altogether?"]},
                  split, c=customer)
    calls = [("list_orders", {"customer": customer})] + [("cancel_order", {"order_id": o}) for o in open_ids]
    return Blueprint(text, state, calls, [AnswerItem(number=refund, tolerance=0.02)],
                     f"I cancelled {', '.join(open_ids)}; the total refund is {refund:.2f}.")


DOMAIN = Domain(
    name="shop", tools_class=ShopTools, tool_names=["get_order", "list_orders", "cancel_order", "update_address"],
    system_prompt=system_prompt("You are the support agent of an online shop."),
    shots=[Shot("Which orders does Sam Lee have?", ("list_orders", {"customer": "Sam Lee"}),
                [{"order_id": "A1234", "placed": "2026-01-09", "status": "processing"},
                 {"order_id": "B7777", "placed": "2026-01-03", "status": "delivered"}],
                "Sam Lee has two orders: A1234 (processing) and B7777 (delivered)."),
           Shot("Any orders for Kim Ray?", ("list_orders", {"customer": "Kim Ray"}),
                [{"order_id": "C5555", "placed": "2026-02-11", "status": "shipped"}], "Kim Ray has one order, C5555 (shipped).")],
    kinds={1: [order_status, order_total, count_orders], 2: [latest_product, cancel_open], 3: [readdress_open],
           4: [cancel_all_open]},
)

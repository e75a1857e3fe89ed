"""toolworld domain 'bank': a ledger of accounts (find by owner, balance, transactions, transfer)."""

from __future__ import annotations

import random
from typing import Any

from lopd_core.envs.base import Split
from lopd_core.envs.tool_env import AnswerItem
from lopd_core.envs.tools import ToolFailure
from lopd_core.envs.toolworld.domain import (
    PEOPLE,
    Blueprint,
    Domain,
    Shot,
    ident,
    phrase,
    pick,
    system_prompt,
)


class BankTools:
    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state
        self.state.setdefault("accounts", {})

    def _account(self, account_id: str) -> dict[str, Any]:
        account = self.state["accounts"].get(account_id.strip().upper())
        if account is None:
            raise ToolFailure(f"account {account_id} not found")
        return account

    def find_account(self, owner: str) -> dict:
        """Find a customer's account id.

        Args:
            owner: Full name.
        """
        for aid, acc in self.state["accounts"].items():
            if acc["owner"].lower() == owner.strip().lower():
                return {"account_id": aid, "owner": acc["owner"]}
        raise ToolFailure(f"no account owned by {owner}")

    def get_balance(self, account_id: str) -> dict:
        """Balance of an account.

        Args:
            account_id: Account id.
        """
        acc = self._account(account_id)
        return {"account_id": account_id.strip().upper(), "balance": acc["balance"], "currency": "EUR"}

    def transfer(self, from_account: str, to_account: str, amount: float) -> dict:
        """Move money between accounts.

        Args:
            from_account: Payer account id.
            to_account: Payee account id.
            amount: EUR.
        """
        src, dst = self._account(from_account), self._account(to_account)
        if amount <= 0:
            raise ToolFailure("amount must be positive")
        if src["balance"] < amount:
            raise ToolFailure(f"insufficient funds: balance is {src['balance']:.2f}")
        src["balance"] = round(src["balance"] - amount, 2)
        dst["balance"] = round(dst["balance"] + amount, 2)
        return {"from_balance": src["balance"], "to_balance": dst["balance"], "amount": amount}


def _ledger(rng: random.Random, split: Split, owners: list[str]) -> tuple[dict, dict[str, str]]:
    accounts, ids = {}, {}
    everyone = owners + [p for p in pick(rng, PEOPLE, split, 4) if p not in owners][:2]
    for owner in everyone:
        aid = ident(rng, split)
        while aid in accounts:
            aid = ident(rng, split)
        accounts[aid] = {"owner": owner, "balance": round(rng.uniform(40, 2500), 2)}
        ids[owner] = aid
    return {"accounts": accounts}, ids


def balance_by_id(rng: random.Random, split: Split) -> Blueprint:
    owner, = pick(rng, PEOPLE, split)
    state, ids = _ledger(rng, split, [owner])
    aid = ids[owner]
    bal = state["accounts"][aid]["balance"]
    text = phrase(rng, {"train": ["What is the balance of account {a}?", "How much money is in account {a}?"],
                        "test": ["Check the balance on account {a} for me.", "Account {a}: what's left in it?"]},
                  split, a=aid)
    return Blueprint(text, state, [("get_balance", {"account_id": aid})], [AnswerItem(number=bal)],
                     f"Account {aid} holds {bal:.2f} EUR.")


def account_of(rng: random.Random, split: Split) -> Blueprint:
    owner, = pick(rng, PEOPLE, split)
    state, ids = _ledger(rng, split, [owner])
    text = phrase(rng, {"train": ["What is the account id of {o}?"], "test": ["Which account number belongs to {o}?"]},
                  split, o=owner)
    return Blueprint(text, state, [("find_account", {"owner": owner})], [AnswerItem(text=ids[owner])],
                     f"{owner}'s account is {ids[owner]}.")


def balance_by_owner(rng: random.Random, split: Split) -> Blueprint:
    owner, = pick(rng, PEOPLE, split)
    state, ids = _ledger(rng, split, [owner])
    bal = state["accounts"][ids[owner]]["balance"]
    text = phrase(rng, {"train": ["How much money does {o} have in their account?"],
                        "test": ["What's {o}'s current balance?"]}, split, o=owner)
    return Blueprint(text, state, [("find_account", {"owner": owner}), ("get_balance", {"account_id": ids[owner]})],
                     [AnswerItem(number=bal)], f"{owner} has {bal:.2f} EUR.")


def pay_by_names(rng: random.Random, split: Split) -> Blueprint:
    payer, payee = pick(rng, PEOPLE, split, 2)
    state, ids = _ledger(rng, split, [payer, payee])
    amount = float(rng.choice([20, 35, 50, 75, 120]))
    state["accounts"][ids[payer]]["balance"] = max(state["accounts"][ids[payer]]["balance"], amount + 10)
    text = phrase(rng, {"train": ["Transfer {m:g} EUR from {a}'s account to {b}'s account."],
                        "test": ["{a} owes {b} {m:g} EUR; move it between their accounts."]},
                  split, a=payer, b=payee, m=amount)
    calls = [("find_account", {"owner": payer}), ("find_account", {"owner": payee}),
             ("transfer", {"from_account": ids[payer], "to_account": ids[payee], "amount": amount})]
    left = round(state["accounts"][ids[payer]]["balance"] - amount, 2)
    return Blueprint(text, state, calls, [AnswerItem(number=amount)],
                     f"Transferred {amount:g} EUR; {payer} now has {left:.2f} EUR.")


def pay_then_report(rng: random.Random, split: Split) -> Blueprint:
    payer, payee = pick(rng, PEOPLE, split, 2)
    state, ids = _ledger(rng, split, [payer, payee])
    amount = float(rng.choice([25, 40, 60, 90, 150]))
    state["accounts"][ids[payer]]["balance"] = max(state["accounts"][ids[payer]]["balance"], amount + 10)
    after_payer = round(state["accounts"][ids[payer]]["balance"] - amount, 2)
    after_payee = round(state["accounts"][ids[payee]]["balance"] + amount, 2)
    text = phrase(rng, {"train": ["Send {m:g} EUR from {a} to {b}, then tell me both new balances."],
                        "test": ["Pay {m:g} EUR from {a}'s account into {b}'s and report what each has afterwards."]},
                  split, a=payer, b=payee, m=amount)
    calls = [("find_account", {"owner": payer}), ("find_account", {"owner": payee}),
             ("transfer", {"from_account": ids[payer], "to_account": ids[payee], "amount": amount}),
             ("get_balance", {"account_id": ids[payee]})]
    return Blueprint(text, state, calls, [AnswerItem(number=after_payer), AnswerItem(number=after_payee)],
                     f"Done: {payer} has {after_payer:.2f} EUR and {payee} has {after_payee:.2f} EUR.",
                     checked_calls=[0, 1, 2])


DOMAIN = Domain(
    name="bank", tools_class=BankTools, tool_names=["find_account", "get_balance", "transfer"],
    system_prompt=system_prompt("You are a banking assistant."),
    shots=[Shot("Which account does Sam Lee own?", ("find_account", {"owner": "Sam Lee"}),
                {"account_id": "A1234", "owner": "Sam Lee"}, "Sam Lee's account is A1234."),
           Shot("Kim Ray's account id, please?", ("find_account", {"owner": "Kim Ray"}),
                {"account_id": "B7777", "owner": "Kim Ray"}, "Kim Ray's account id is B7777.")],
    kinds={1: [balance_by_id, account_of], 2: [balance_by_owner], 3: [pay_by_names], 4: [pay_then_report]},
)

"""Tools of the example 'library' plug-in suite: typed, documented methods acting on the task's state.

The state is plain JSON: {"books": {book_id: {...}}, "members": {member_id: {...}}}.
"""

from __future__ import annotations

from typing import Any


class LibraryTools:
    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state
        self.state.setdefault("books", {})
        self.state.setdefault("members", {})

    def find_book(self, title: str) -> dict:
        """Find a book by its title.

        Args:
            title: The book's title (case does not matter).
        """
        for book_id, book in self.state["books"].items():
            if book["title"].lower() == title.strip().lower():
                return {"book_id": book_id, **book}
        return {"error": f"no book titled {title!r}"}

    def borrow_book(self, book_id: str, member_id: str) -> dict:
        """Lend a book that is on the shelf to a member.

        Args:
            book_id: The book's id, e.g. "BK-12".
            member_id: The member's id, e.g. "M-3".
        """
        book = self.state["books"].get(book_id)
        if book is None or member_id not in self.state["members"]:
            return {"error": "unknown book or member id"}
        if book["on_loan_to"]:
            return {"error": f"{book['title']} is already on loan"}
        book["on_loan_to"] = member_id
        return {"book_id": book_id, "on_loan_to": member_id, "due_in_days": 21}

    def return_book(self, book_id: str) -> dict:
        """Record that a borrowed book came back.

        Args:
            book_id: The book's id.
        """
        book = self.state["books"].get(book_id)
        if book is None or not book["on_loan_to"]:
            return {"error": "that book is not on loan"}
        book["on_loan_to"] = ""
        return {"book_id": book_id, "returned": True}

    def member_loans(self, member_id: str) -> list:
        """The books a member currently has on loan.

        Args:
            member_id: The member's id.
        """
        return [{"book_id": b, "title": x["title"]} for b, x in self.state["books"].items() if x["on_loan_to"] == member_id]

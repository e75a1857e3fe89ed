"""SQL literals for LanceDB filters (keys and ids are quoted, never interpolated raw)."""

from __future__ import annotations


def sql_literal(value: str) -> str:
    return "'" + str(value).replace("'", "''") + "'"


def sql_in(column: str, values) -> str:
    return f"{column} IN ({', '.join(sql_literal(v) for v in values)})"

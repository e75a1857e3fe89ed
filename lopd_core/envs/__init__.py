"""Task suites and verifiers: ``get_suite(name_or_path)`` is the one entry point.

Built in: ``toolworld`` (procedural multi-turn tool use), ``codegen`` (procedural function writing with
hidden unit tests), ``humaneval`` (HumanEval's 164 problems, test split only), ``bfcl`` (BFCL v4
single-turn function calling, test split only, levels 1–4 = simple, multiple, parallel,
parallel_multiple) and ``bfcl_multi_turn`` (BFCL v4 multi-turn, test split only, levels 1–4 = base,
miss_func, miss_param, long_context; itself a plug-in suite, ``suites/bfcl_multi_turn/suite.yaml``).
Anything else is read as the path of a plug-in suite YAML (see ``docs/plugin-suites.md``). Every model-generated program runs in :mod:`lopd_core.envs.sandbox`.

A suite's kind (``tool`` or ``code``: which success threshold applies) is :func:`suite_kind`, the one place
it is worked out.
"""

from __future__ import annotations

import functools
from pathlib import Path

from lopd_core.envs.base import Environment, EpisodeResult, Split, StepResult, Suite, Task
from lopd_core.envs.bfcl import BFCLSuite
from lopd_core.envs.codegen import CodegenSuite
from lopd_core.envs.humaneval import HumanEvalSuite
from lopd_core.envs.plugin import BUILTIN_PLUGIN_SUITES, load_plugin_suite
from lopd_core.envs.toolworld import ToolWorldSuite

BUILTIN_SUITES = ("toolworld", "codegen", "humaneval", "bfcl", *BUILTIN_PLUGIN_SUITES)
_CODE_SUITE_WORDS = ("code", "humaneval", "mbpp", "livecodebench")

__all__ = ["BUILTIN_SUITES", "Environment", "EpisodeResult", "Split", "StepResult", "Suite", "Task",
           "get_suite", "list_suites", "suite_kind"]

_CACHE: dict[str, Suite] = {}


def get_suite(name_or_path: str) -> Suite:
    """A built-in suite by name, or a plug-in suite from the path of its YAML file."""
    key = str(name_or_path)
    if key in _CACHE:
        return _CACHE[key]
    if key == "toolworld":
        suite: Suite = ToolWorldSuite()
    elif key == "codegen":
        suite = CodegenSuite()
    elif key == "humaneval":
        suite = HumanEvalSuite()
    elif key == "bfcl":
        suite = BFCLSuite()
    elif key in BUILTIN_PLUGIN_SUITES:
        suite = load_plugin_suite(BUILTIN_PLUGIN_SUITES[key])
    elif key.endswith((".yaml", ".yml")) or Path(key).exists():
        suite = load_plugin_suite(Path(key))
    else:
        raise ValueError(f"unknown suite {key!r}: use one of {', '.join(BUILTIN_SUITES)} or the path of a "
                         "plug-in suite YAML (see docs/plugin-suites.md)")
    _CACHE[key] = suite
    return suite


def list_suites() -> list[dict[str, str]]:
    """The built-in suites with their kind and a one-line description."""
    return [
        {"name": "toolworld", "kind": "tool", "description": "procedural multi-turn tool use: shop, calendar, weather, bank"},
        {"name": "codegen", "kind": "code", "description": "procedural Python function writing, hidden unit tests"},
        {"name": "humaneval", "kind": "code", "description": "HumanEval (164 problems, test split), pass@1 in our sandbox"},
        {"name": "bfcl", "kind": "tool", "description": "BFCL v4 single-turn function calling (test split), AST checker"},
        {"name": "bfcl_multi_turn", "kind": "tool",
         "description": "BFCL v4 multi-turn (test split): executable backends, BFCL's multi-turn checker"},
    ]


@functools.lru_cache(maxsize=64)
def suite_kind(suite: str) -> str:
    """'tool' or 'code' for a suite name or plug-in path: the suite's own ``kind`` when it loads, else (an
    unknown or broken plug-in, e.g. while curating old rows) a name containing ``code``, ``humaneval``,
    ``mbpp`` or ``livecodebench`` is a code suite and anything else a tool suite."""
    try:
        kind = getattr(get_suite(suite), "kind", None)
        if kind in ("tool", "code"):
            return kind
    except Exception:  # noqa: BLE001 - an unknown or broken suite falls back to the naming rule
        pass
    return "code" if any(w in suite.lower() for w in _CODE_SUITE_WORDS) else "tool"

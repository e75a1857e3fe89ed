"""The 51 procedural function-writing templates of the codegen suite (train / test per level: 10/5, 11/3, 8/3, 8/3).

A template is: the function's signature, a description with parameters drawn per task (``{k}`` …), a
reference solution (trusted code written here, executed in-process to compute expected values), and a
generator of hidden test inputs. Levels: 1 = one-liners with a drawn parameter, half plain and half with a twist
(SmolLM2-135M passed 1 of 24 level-1 tasks when all had a twist, and 5 of 8 bare one-liners in an earlier
probe), 2 = a loop with state or string handling, 3 = a classic algorithm with edge cases, 4 = dynamic
programming / parsing. Test templates are never used for training tasks.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Params = Callable[[random.Random], dict[str, Any]]
Cases = Callable[[random.Random, dict[str, Any]], list[list[Any]]]


@dataclass(frozen=True)
class Template:
    key: str
    level: int
    split: str
    signature: str
    description: str
    solution: str
    params: Params
    cases: Cases

    @property
    def function(self) -> str:
        return self.signature.split("(", 1)[0]


WORDS = ["apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "ocean", "maple", "robot", "candle",
         "forest", "a", "an", "the", "sun", "moon", "star", "delta", "echo"]


def ints(r: random.Random, n: int, lo: int = -20, hi: int = 50) -> list[int]:
    return [r.randint(lo, hi) for _ in range(n)]


def text(r: random.Random, n: int) -> str:
    return " ".join(r.choice(WORDS) for _ in range(n))


def word(r: random.Random, lo: int = 3, hi: int = 8, alphabet: str = "abcde") -> str:
    return "".join(r.choice(alphabet) for _ in range(r.randint(lo, hi)))


def _lists(r, lo=-20, hi=50, empty=True):
    cases = [[ints(r, r.randint(3, 9), lo, hi)] for _ in range(6)]
    return cases + ([[[]]] if empty else [])


def _none(r):
    return {}


T = Template
TEMPLATES: list[Template] = [
    # ---------------------------------------------------------------- level 1
    T("lists/scale_all", 1, "train", "scale_all(nums)",
      "returns a new list with every number of the list `nums` multiplied by {k}",
      "def scale_all(nums):\n    return [x * {k} for x in nums]\n",
      lambda r: {"k": r.randint(2, 9)}, lambda r, p: _lists(r)),
    T("strings/starting_with", 1, "train", "starting_with(words)",
      "returns the strings of the list `words` that start with the letter '{c}', in their original order",
      "def starting_with(words):\n    return [w for w in words if w.startswith('{c}')]\n",
      lambda r: {"c": r.choice("acmrst")}, lambda r, p: [[[r.choice(WORDS) for _ in range(r.randint(0, 6))]] for _ in range(6)]),
    T("lists/first_n", 1, "train", "first_n(items)",
      "returns a list of the first {k} elements of the list `items` (all of them if there are fewer)",
      "def first_n(items):\n    return items[:{k}]\n",
      lambda r: {"k": r.randint(2, 5)}, lambda r, p: [[ints(r, r.randint(0, 8), 0, 9)] for _ in range(6)]),
    T("strings/count_long", 1, "train", "count_long(words)",
      "returns how many strings in the list `words` are longer than {k} characters",
      "def count_long(words):\n    return sum(1 for w in words if len(w) > {k})\n",
      lambda r: {"k": r.randint(3, 5)}, lambda r, p: [[[r.choice(WORDS) for _ in range(r.randint(0, 7))]] for _ in range(6)]),
    T("numbers/is_multiple", 1, "train", "is_multiple(n)",
      "returns True when the integer n is divisible by {k}, otherwise False",
      "def is_multiple(n):\n    return n % {k} == 0\n",
      lambda r: {"k": r.randint(3, 9)}, lambda r, p: [[r.randint(-30, 60)] for _ in range(5)] + [[p["k"] * 3], [0]]),
    T("lists/max_times", 1, "test", "max_times(nums)",
      "returns the largest number of the list `nums` multiplied by {k} (0 for an empty list)",
      "def max_times(nums):\n    return max(nums) * {k} if nums else 0\n",
      lambda r: {"k": r.randint(2, 9)}, lambda r, p: _lists(r)),
    T("strings/shout", 1, "test", "shout(s)",
      "returns the string `s` in upper case followed by {k} exclamation marks",
      "def shout(s):\n    return s.upper() + '!' * {k}\n",
      lambda r: {"k": r.randint(1, 4)}, lambda r, p: [[text(r, r.randint(0, 3))] for _ in range(6)]),
    T("lists/sum_above", 1, "train", "sum_above(nums)",
      "returns the sum of the numbers in the list `nums` that are strictly greater than {k} (0 if there are none)",
      "def sum_above(nums):\n    return sum(x for x in nums if x > {k})\n",
      lambda r: {"k": r.randint(3, 15)}, lambda r, p: _lists(r)),
    T("strings/count_char", 1, "train", "count_char(s)",
      "returns how many times the letter '{c}' occurs in the string `s`, counting upper and lower case",
      "def count_char(s):\n    return s.lower().count('{c}')\n",
      lambda r: {"c": r.choice("aeiou")}, lambda r, p: [[word(r, 2, 12, "aeiouAEIOUxyz ")] for _ in range(6)] + [[""]]),
    T("lists/every_nth", 1, "train", "every_nth(items)",
      "returns every {k}-th element of the list `items`, starting with the element at index {start}",
      "def every_nth(items):\n    return items[{start}::{k}]\n",
      lambda r: {"k": r.randint(2, 4), "start": r.randint(1, 2)},
      lambda r, p: [[ints(r, r.randint(0, 12), 0, 9)] for _ in range(6)]),
    T("lists/clamp_all", 1, "train", "clamp_all(nums)",
      "returns a new list where every number of `nums` below {lo} becomes {lo} and every number above {hi} becomes {hi}",
      "def clamp_all(nums):\n    return [min(max(x, {lo}), {hi}) for x in nums]\n",
      lambda r: {"lo": r.randint(-5, 5), "hi": r.randint(10, 30)}, lambda r, p: _lists(r)),
    T("numbers/last_digit_sum", 2, "train", "last_digit_sum(nums)",
      "returns the sum of the last decimal digits of the integers in `nums` (the last digit of -37 is 7), "
      "but only counts digits greater than {k}",
      "def last_digit_sum(nums):\n    return sum(abs(x) % 10 for x in nums if abs(x) % 10 > {k})\n",
      lambda r: {"k": r.randint(0, 4)}, lambda r, p: _lists(r, -99, 99)),
    T("strings/longest_word", 2, "train", "longest_word(text)",
      "returns the longest word of the space-separated string `text` that has at most {k} letters "
      "(the first one on ties; '' if there is none)",
      "def longest_word(text):\n    best = ''\n    for w in text.split():\n        if len(w) <= {k} and len(w) > len(best):\n"
      "            best = w\n    return best\n",
      lambda r: {"k": r.randint(4, 5)}, lambda r, p: [[text(r, r.randint(1, 7))] for _ in range(6)] + [[""]]),
    T("numbers/count_multiples", 2, "train", "count_multiples(nums)",
      "returns how many numbers in `nums` are divisible by {k} but not by {m}",
      "def count_multiples(nums):\n    return sum(1 for x in nums if x % {k} == 0 and x % {m} != 0)\n",
      lambda r: (lambda k: {"k": k, "m": k * r.randint(2, 3)})(r.randint(2, 5)), lambda r, p: _lists(r, 0, 60)),
    T("strings/repeat_chars", 1, "train", "repeat_chars(s)",
      "returns the string `s` with every character repeated {k} times, except spaces, which are kept once",
      "def repeat_chars(s):\n    return ''.join(c if c == ' ' else c * {k} for c in s)\n",
      lambda r: {"k": r.randint(2, 3)}, lambda r, p: [[word(r, 0, 6, "abc ")] for _ in range(6)]),
    T("lists/product_of_odds", 1, "test", "product_of_odds(nums)",
      "returns the product of the odd numbers in `nums` that are smaller than {k} (1 if there are none)",
      "def product_of_odds(nums):\n    p = 1\n    for x in nums:\n        if x % 2 and x < {k}:\n            p *= x\n    return p\n",
      lambda r: {"k": r.randint(5, 12)}, lambda r, p: _lists(r, -9, 15)),
    T("strings/capitalize_words", 1, "test", "capitalize_words(text)",
      "returns `text` with each word capitalised and the words joined by '{sep}' (words are separated by spaces)",
      "def capitalize_words(text):\n    return '{sep}'.join(w.capitalize() for w in text.split())\n",
      lambda r: {"sep": r.choice(["-", "_", " "])}, lambda r, p: [[text(r, r.randint(0, 5)).upper() if r.random() < .3
                                                                    else text(r, r.randint(0, 5))] for _ in range(6)]),
    T("lists/range_span", 1, "test", "range_span(nums)",
      "returns the largest minus the smallest of the numbers in `nums` that are not equal to {k} (0 if none remain)",
      "def range_span(nums):\n    rest = [x for x in nums if x != {k}]\n    return max(rest) - min(rest) if rest else 0\n",
      lambda r: {"k": r.randint(0, 5)}, lambda r, p: _lists(r, 0, 9)),
    # ---------------------------------------------------------------- level 2
    T("strings/run_length", 2, "train", "run_length(s)",
      "returns the run-length encoding of `s`: each run of equal characters becomes the character followed by the "
      "run length, e.g. 'aaab' -> 'a3b1'",
      "def run_length(s):\n    out = []\n    i = 0\n    while i < len(s):\n        j = i\n        while j < len(s) and s[j] == s[i]:\n"
      "            j += 1\n        out.append(s[i] + str(j - i))\n        i = j\n    return ''.join(out)\n",
      _none, lambda r, p: [[word(r, 0, 10, "aab")] for _ in range(7)]),
    T("strings/caesar", 2, "train", "caesar(s)",
      "shifts every letter of `s` {k} places forward in the alphabet (wrapping from z to a), keeping upper/lower "
      "case; other characters stay unchanged",
      "def caesar(s):\n    out = []\n    for c in s:\n        if c.islower():\n            out.append(chr((ord(c) - 97 + {k}) % 26 + 97))\n"
      "        elif c.isupper():\n            out.append(chr((ord(c) - 65 + {k}) % 26 + 65))\n        else:\n            out.append(c)\n"
      "    return ''.join(out)\n",
      lambda r: {"k": r.randint(1, 25)}, lambda r, p: [[word(r, 0, 10, "abxyzXYZ !")] for _ in range(6)]),
    T("strings/clean_palindrome", 2, "train", "is_clean_palindrome(s)",
      "returns True when `s` reads the same backwards after removing every character that is not a letter or digit "
      "and ignoring case",
      "def is_clean_palindrome(s):\n    t = [c.lower() for c in s if c.isalnum()]\n    return t == t[::-1]\n",
      _none, lambda r, p: [[(lambda w: w + w[::-1] if r.random() < .5 else w)(word(r, 1, 5, "abA ,."))] for _ in range(7)]),
    T("numbers/fizz", 2, "train", "fizz(n)",
      "returns a list for the numbers 1..n: 'Fizz' for multiples of {a}, 'Buzz' for multiples of {b}, 'FizzBuzz' "
      "for multiples of both, otherwise the number itself (an int)",
      "def fizz(n):\n    out = []\n    for i in range(1, n + 1):\n        if i % {a} == 0 and i % {b} == 0:\n            out.append('FizzBuzz')\n"
      "        elif i % {a} == 0:\n            out.append('Fizz')\n        elif i % {b} == 0:\n            out.append('Buzz')\n"
      "        else:\n            out.append(i)\n    return out\n",
      lambda r: {"a": r.choice([2, 3, 4]), "b": r.choice([5, 7])}, lambda r, p: [[r.randint(0, 30)] for _ in range(6)] + [[0]]),
    T("lists/dedupe", 2, "train", "dedupe(items)",
      "returns the list `items` without duplicates, keeping the first occurrence of each value in order",
      "def dedupe(items):\n    seen = set()\n    out = []\n    for x in items:\n        if x not in seen:\n            seen.add(x)\n"
      "            out.append(x)\n    return out\n",
      _none, lambda r, p: [[ints(r, r.randint(0, 10), 0, 5)] for _ in range(6)]),
    T("strings/word_count", 2, "train", "word_count(text)",
      "returns a dict mapping each distinct lower-cased word of `text` (split on spaces) that has at least {k} "
      "letters to the number of times it occurs",
      "def word_count(text):\n    out = {{}}\n    for w in text.lower().split():\n        if len(w) >= {k}:\n"
      "            out[w] = out.get(w, 0) + 1\n    return out\n",
      lambda r: {"k": r.randint(2, 4)}, lambda r, p: [[text(r, r.randint(0, 9))] for _ in range(6)]),
    T("lists/running_max", 2, "train", "running_max(nums)",
      "returns a list whose i-th element is the largest of nums[0..i]",
      "def running_max(nums):\n    out = []\n    for x in nums:\n        out.append(x if not out else max(out[-1], x))\n    return out\n",
      _none, lambda r, p: _lists(r)),
    T("lists/pairs_sum", 2, "train", "pairs_sum(nums)",
      "returns how many index pairs i < j have nums[i] + nums[j] == {t}",
      "def pairs_sum(nums):\n    return sum(1 for i in range(len(nums)) for j in range(i + 1, len(nums)) if nums[i] + nums[j] == {t})\n",
      lambda r: {"t": r.randint(4, 10)}, lambda r, p: [[ints(r, r.randint(0, 9), 0, 10)] for _ in range(6)]),
    T("strings/alternate_case", 2, "test", "alternate_case(s)",
      "returns `s` with its letters alternating upper, lower, upper, … case, counting letters only (other characters "
      "are kept and do not advance the alternation)",
      "def alternate_case(s):\n    out, upper = [], True\n    for c in s:\n        if c.isalpha():\n"
      "            out.append(c.upper() if upper else c.lower())\n            upper = not upper\n        else:\n            out.append(c)\n"
      "    return ''.join(out)\n",
      _none, lambda r, p: [[word(r, 0, 10, "abcD 1!")] for _ in range(6)]),
    T("lists/chunk", 2, "test", "chunk(items)",
      "splits `items` into consecutive lists of {k} elements (the last one may be shorter) and returns the list of chunks",
      "def chunk(items):\n    return [items[i:i + {k}] for i in range(0, len(items), {k})]\n",
      lambda r: {"k": r.randint(2, 4)}, lambda r, p: [[ints(r, r.randint(0, 11), 0, 9)] for _ in range(6)]),
    T("numbers/largest_rearrangement", 2, "test", "largest_rearrangement(n)",
      "returns the largest integer that can be written with exactly the decimal digits of the non-negative integer n",
      "def largest_rearrangement(n):\n    return int(''.join(sorted(str(n), reverse=True)))\n",
      _none, lambda r, p: [[r.randint(0, 10 ** r.randint(1, 7))] for _ in range(6)] + [[0]]),
    # ---------------------------------------------------------------- level 3
    T("lists/merge_intervals", 3, "train", "merge_intervals(intervals)",
      "merges overlapping or touching [start, end] intervals and returns them sorted by start, e.g. "
      "[[1, 3], [2, 5], [7, 8]] -> [[1, 5], [7, 8]]",
      "def merge_intervals(intervals):\n    out = []\n    for s, e in sorted(intervals):\n        if out and s <= out[-1][1]:\n"
      "            out[-1][1] = max(out[-1][1], e)\n        else:\n            out.append([s, e])\n    return out\n",
      _none, lambda r, p: [[[sorted([r.randint(0, 20), r.randint(0, 20)]) for _ in range(r.randint(0, 6))]] for _ in range(7)]),
    T("strings/balanced", 3, "train", "balanced(s)",
      "returns True when the brackets (), [] and {{}} in `s` are balanced and properly nested (other characters are ignored)",
      "def balanced(s):\n    pairs = {{')': '(', ']': '[', '}}': '{{'}}\n    stack = []\n    for c in s:\n        if c in '([{{':\n"
      "            stack.append(c)\n        elif c in pairs:\n            if not stack or stack.pop() != pairs[c]:\n"
      "                return False\n    return not stack\n",
      _none, lambda r, p: [[word(r, 0, 10, "()[]{}x")] for _ in range(6)] + [["([]{})"], ["(]"]]),
    T("numbers/to_roman", 3, "train", "to_roman(n)",
      "returns the Roman numeral of 1 <= n <= 3999 using subtractive notation (4 -> 'IV', 90 -> 'XC')",
      "def to_roman(n):\n    vals = [(1000, 'M'), (900, 'CM'), (500, 'D'), (400, 'CD'), (100, 'C'), (90, 'XC'), (50, 'L'),\n"
      "            (40, 'XL'), (10, 'X'), (9, 'IX'), (5, 'V'), (4, 'IV'), (1, 'I')]\n    out = ''\n    for v, s in vals:\n"
      "        while n >= v:\n            out += s\n            n -= v\n    return out\n",
      _none, lambda r, p: [[r.randint(1, 3999)] for _ in range(6)] + [[4], [1994]]),
    T("strings/top_words", 3, "train", "top_words(text)",
      "returns the {k} most frequent words of the space-separated string `text` (case-insensitive, lower-cased), "
      "most frequent first, ties broken alphabetically; fewer if there are fewer distinct words",
      "def top_words(text):\n    counts = {{}}\n    for w in text.lower().split():\n        counts[w] = counts.get(w, 0) + 1\n"
      "    return sorted(counts, key=lambda w: (-counts[w], w))[:{k}]\n",
      lambda r: {"k": r.randint(2, 3)}, lambda r, p: [[text(r, r.randint(0, 12))] for _ in range(6)]),
    T("grids/rotate", 3, "train", "rotate(matrix)",
      "returns the square matrix (a list of rows) rotated {turns} quarter turn(s) clockwise",
      "def rotate(matrix):\n    m = [row[:] for row in matrix]\n    for _ in range({turns}):\n        m = [list(r) for r in zip(*m[::-1])]\n    return m\n",
      lambda r: {"turns": r.randint(1, 3)}, lambda r, p: [[(lambda n: [ints(r, n, 0, 9) for _ in range(n)])(r.randint(1, 4))]
                                                          for _ in range(6)]),
    T("lists/flatten", 3, "train", "flatten(nested)",
      "returns all integers of the arbitrarily nested list `nested` in order, as one flat list",
      "def flatten(nested):\n    out = []\n    for x in nested:\n        if isinstance(x, list):\n            out.extend(flatten(x))\n"
      "        else:\n            out.append(x)\n    return out\n",
      _none, lambda r, p: [[[1, [2, [3, [4]]], [], 5]], [[]], [[[[7]]]]] + [[[r.randint(0, 9), [r.randint(0, 9)] * r.randint(0, 2),
                                                                               [[r.randint(0, 9)]]]] for _ in range(4)]),
    T("lists/compress_ranges", 3, "train", "compress_ranges(nums)",
      "takes a list of integers and returns a string of its sorted distinct values where runs of consecutive "
      "numbers are written 'a-b', joined by commas, e.g. [5, 1, 2, 3, 7, 8] -> '1-3,5,7-8'",
      "def compress_ranges(nums):\n    vals = sorted(set(nums))\n    parts, i = [], 0\n    while i < len(vals):\n        j = i\n"
      "        while j + 1 < len(vals) and vals[j + 1] == vals[j] + 1:\n            j += 1\n"
      "        parts.append(str(vals[i]) if i == j else f'{{vals[i]}}-{{vals[j]}}')\n        i = j + 1\n    return ','.join(parts)\n",
      _none, lambda r, p: [[ints(r, r.randint(0, 10), 0, 15)] for _ in range(7)]),
    T("grids/spiral", 3, "train", "spiral(matrix)",
      "returns the elements of the rectangular matrix (a list of rows) in clockwise spiral order starting top-left",
      "def spiral(matrix):\n    m = [row[:] for row in matrix]\n    out = []\n    while m:\n        out.extend(m.pop(0))\n"
      "        m = [list(r) for r in zip(*m)][::-1]\n    return out\n",
      _none, lambda r, p: [[(lambda h, w: [ints(r, w, 0, 9) for _ in range(h)])(r.randint(1, 4), r.randint(1, 4))]
                           for _ in range(6)] + [[[]]]),
    T("numbers/from_roman", 3, "test", "from_roman(s)",
      "returns the integer value of the Roman numeral `s` (subtractive notation, e.g. 'MCMXCIV' -> 1994)",
      "def from_roman(s):\n    v = {{'I': 1, 'V': 5, 'X': 10, 'L': 50, 'C': 100, 'D': 500, 'M': 1000}}\n    total = 0\n"
      "    for i, c in enumerate(s):\n        if i + 1 < len(s) and v[c] < v[s[i + 1]]:\n            total -= v[c]\n"
      "        else:\n            total += v[c]\n    return total\n",
      _none, lambda r, p: [["MCMXCIV"], ["IV"], ["MMXXVI"], ["XLII"], ["CDXLIV"], ["III"], ["DCCCXC"]]),
    T("strings/group_anagrams", 3, "test", "group_anagrams(words)",
      "groups the words that are anagrams of each other: returns a list of groups, each group sorted "
      "alphabetically, and the groups sorted by their first word",
      "def group_anagrams(words):\n    groups = {{}}\n    for w in words:\n        groups.setdefault(''.join(sorted(w)), []).append(w)\n"
      "    return sorted(sorted(g) for g in groups.values())\n",
      _none, lambda r, p: [[[word(r, 2, 3, "abc") for _ in range(r.randint(0, 7))]] for _ in range(6)]),
    T("strings/max_depth", 3, "test", "max_depth(s)",
      "returns the maximum nesting depth of the parentheses in `s`, or -1 if they are unbalanced",
      "def max_depth(s):\n    depth = best = 0\n    for c in s:\n        if c == '(':\n            depth += 1\n            best = max(best, depth)\n"
      "        elif c == ')':\n            depth -= 1\n            if depth < 0:\n                return -1\n    return best if depth == 0 else -1\n",
      _none, lambda r, p: [[word(r, 0, 10, "(()x")] for _ in range(6)] + [["(a(b)(c(d)))"]]),
    # ---------------------------------------------------------------- level 4
    T("dp/lis_length", 4, "train", "lis_length(nums)",
      "returns the length of the longest strictly increasing subsequence of `nums`",
      "def lis_length(nums):\n    best = []\n    for x in nums:\n        import bisect\n        i = bisect.bisect_left(best, x)\n"
      "        if i == len(best):\n            best.append(x)\n        else:\n            best[i] = x\n    return len(best)\n",
      _none, lambda r, p: _lists(r, 0, 20)),
    T("dp/edit_distance", 4, "train", "edit_distance(a, b)",
      "returns the Levenshtein distance between strings `a` and `b` (insertions, deletions, substitutions cost 1)",
      "def edit_distance(a, b):\n    prev = list(range(len(b) + 1))\n    for i, ca in enumerate(a, 1):\n        cur = [i]\n"
      "        for j, cb in enumerate(b, 1):\n            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))\n"
      "        prev = cur\n    return prev[-1]\n",
      _none, lambda r, p: [[word(r, 0, 7), word(r, 0, 7)] for _ in range(7)]),
    T("dp/min_coins", 4, "train", "min_coins(amount)",
      "returns the fewest coins with values {coins} (unlimited supply) that sum to `amount`, or -1 if impossible",
      "def min_coins(amount):\n    coins = {coins}\n    best = [0] + [None] * amount\n    for a in range(1, amount + 1):\n"
      "        opts = [best[a - c] for c in coins if c <= a and best[a - c] is not None]\n"
      "        best[a] = min(opts) + 1 if opts else None\n    return -1 if best[amount] is None else best[amount]\n",
      lambda r: {"coins": sorted(r.sample([2, 3, 4, 5, 7, 9, 10], 3))}, lambda r, p: [[r.randint(0, 40)] for _ in range(7)]),
    T("grids/count_islands", 4, "train", "count_islands(grid)",
      "counts the islands in `grid`, a list of equal-length strings of '1' (land) and '0' (water); land cells "
      "connect up, down, left and right",
      "def count_islands(grid):\n    seen = set()\n    n = 0\n    for i in range(len(grid)):\n        for j in range(len(grid[0])):\n"
      "            if grid[i][j] == '1' and (i, j) not in seen:\n                n += 1\n                stack = [(i, j)]\n"
      "                while stack:\n                    a, b = stack.pop()\n"
      "                    if 0 <= a < len(grid) and 0 <= b < len(grid[0]) and grid[a][b] == '1' and (a, b) not in seen:\n"
      "                        seen.add((a, b))\n                        stack += [(a + 1, b), (a - 1, b), (a, b + 1), (a, b - 1)]\n"
      "    return n\n",
      _none, lambda r, p: [[(lambda h, w: [word(r, w, w, "01") for _ in range(h)])(r.randint(1, 5), r.randint(1, 5))]
                           for _ in range(7)]),
    T("parsing/eval_rpn", 4, "train", "eval_rpn(tokens)",
      "evaluates a list of tokens in reverse Polish notation with integers and the operators +, -, * and / "
      "(integer division truncating toward zero) and returns the result",
      "def eval_rpn(tokens):\n    st = []\n    for t in tokens:\n        if t in '+-*/' and len(t) == 1:\n            b, a = st.pop(), st.pop()\n"
      "            st.append(a + b if t == '+' else a - b if t == '-' else a * b if t == '*' else int(a / b))\n"
      "        else:\n            st.append(int(t))\n    return st[0]\n",
      _none, lambda r, p: [[["2", "1", "+", "3", "*"]], [["4", "13", "5", "/", "+"]], [["7"]], [["3", "-4", "*", "2", "-"]],
                           [["10", "6", "9", "3", "+", "-11", "*", "/", "*", "17", "+", "5", "+"]], [["-7", "2", "/"]]]),
    T("dp/lcs_length", 4, "train", "lcs_length(a, b)",
      "returns the length of the longest common subsequence of strings `a` and `b`",
      "def lcs_length(a, b):\n    dp = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]\n    for i in range(len(a)):\n"
      "        for j in range(len(b)):\n            dp[i + 1][j + 1] = dp[i][j] + 1 if a[i] == b[j] else max(dp[i][j + 1], dp[i + 1][j])\n"
      "    return dp[-1][-1]\n",
      _none, lambda r, p: [[word(r, 0, 8), word(r, 0, 8)] for _ in range(7)]),
    T("dp/knapsack", 4, "train", "knapsack(weights, values)",
      "returns the largest total value of items (each used at most once) whose total weight is at most {cap}",
      "def knapsack(weights, values):\n    best = [0] * ({cap} + 1)\n    for w, v in zip(weights, values):\n"
      "        for c in range({cap}, w - 1, -1):\n            best[c] = max(best[c], best[c - w] + v)\n    return best[{cap}]\n",
      lambda r: {"cap": r.randint(8, 20)}, lambda r, p: [(lambda n: [ints(r, n, 1, 9), ints(r, n, 1, 30)])(r.randint(0, 6))
                                                          for _ in range(7)]),
    T("dp/word_break", 4, "train", "word_break(s)",
      "returns True when `s` can be split into a sequence of words from {words} (words may repeat)",
      "def word_break(s):\n    words = {words}\n    ok = [True] + [False] * len(s)\n    for i in range(1, len(s) + 1):\n"
      "        ok[i] = any(ok[i - len(w)] and s[i - len(w):i] == w for w in words if len(w) <= i)\n    return ok[-1]\n",
      lambda r: {"words": r.sample(["ab", "abc", "cd", "b", "bca", "da", "c"], 3)},
      lambda r, p: [["".join(r.choice(p["words"] + ["x"]) for _ in range(r.randint(0, 4)))] for _ in range(7)]),
    T("parsing/eval_expr", 4, "test", "eval_expr(s)",
      "evaluates a string of non-negative integers joined by +, - and * (no parentheses, spaces allowed) with the "
      "usual precedence, without using eval",
      "def eval_expr(s):\n    import re\n    tokens = re.findall(r'\\d+|[+*-]', s)\n    total, sign, term = 0, 1, int(tokens[0])\n"
      "    for i in range(1, len(tokens), 2):\n        op, v = tokens[i], int(tokens[i + 1])\n        if op == '*':\n"
      "            term *= v\n        else:\n            total += sign * term\n            sign, term = (1 if op == '+' else -1), v\n"
      "    return total + sign * term\n",
      _none, lambda r, p: [["2+3*4"], ["10 - 2 * 3 - 1"], ["7"], ["2*3*4+1"], ["0*5+6-7*1"], ["12 + 30*2 - 4*4*2"]]),
    T("dp/max_subarray", 4, "test", "max_subarray(nums)",
      "returns the largest sum of a contiguous non-empty sub-list of `nums` (0 for an empty list)",
      "def max_subarray(nums):\n    if not nums:\n        return 0\n    best = cur = nums[0]\n    for x in nums[1:]:\n"
      "        cur = max(x, cur + x)\n        best = max(best, cur)\n    return best\n",
      _none, lambda r, p: _lists(r, -20, 15)),
    T("grids/unique_paths", 4, "test", "unique_paths(grid)",
      "counts the paths from the top-left to the bottom-right cell of `grid` (a list of strings, '.' free, '#' "
      "blocked) moving only right or down",
      "def unique_paths(grid):\n    h, w = len(grid), len(grid[0])\n    dp = [[0] * w for _ in range(h)]\n    for i in range(h):\n"
      "        for j in range(w):\n            if grid[i][j] == '#':\n                continue\n            if i == 0 and j == 0:\n"
      "                dp[i][j] = 1\n            else:\n                dp[i][j] = (dp[i - 1][j] if i else 0) + (dp[i][j - 1] if j else 0)\n"
      "    return dp[-1][-1]\n",
      _none, lambda r, p: [[(lambda h, w: [word(r, w, w, "...#") for _ in range(h)])(r.randint(1, 4), r.randint(1, 4))]
                           for _ in range(7)]),
]

assert len({t.key for t in TEMPLATES}) == len(TEMPLATES)

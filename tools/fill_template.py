"""Fill `${name}` placeholders in a Triton config.pbtxt (command line compatible with NVIDIA's).

    python tools/fill_template.py [-i|--in_place] FILE "key1:value1,key2:value2"

Pairs are split on unescaped `,`, then each pair on its first unescaped `:`; `\\,` and `\\:`
stand for a literal comma and colon (other backslashes are kept as they are). Substitution uses
`string.Template.safe_substitute`, so placeholders without a value stay in place. Naming a key
that the file does not contain is an error (it is almost always a typo). `max_queue_size` and
`max_queue_delay_microseconds` default to 0 when the file has them and no value is given.
Prints the result, or rewrites FILE with `-i`.

The functions `split_pairs`, `placeholders`, `with_defaults` and `fill` are reused by the model
repository builder.
"""

from __future__ import annotations

import argparse
import re
import string
import sys
from pathlib import Path

# Values NVIDIA's tool fills in when the caller does not: no queue limit, no queueing delay.
DEFAULTS: dict[str, str] = {"max_queue_size": "0", "max_queue_delay_microseconds": "0"}

_ESCAPABLE = ",:"


class MissingKeyError(ValueError):
    """Keys were given that the template has no placeholder for."""

    def __init__(self, keys: list[str]) -> None:
        super().__init__(", ".join(keys))
        self.keys = keys


def _split_unescaped(text: str, sep: str, maxsplit: int = -1) -> list[str]:
    """Split on `sep` not preceded by a backslash; escapes stay in the parts (removed later)."""
    parts: list[str] = []
    current: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text) and text[i + 1] in _ESCAPABLE:
            current.append(text[i:i + 2])
            i += 2
            continue
        if ch == sep and (maxsplit < 0 or len(parts) < maxsplit):
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
        i += 1
    parts.append("".join(current))
    return parts


def _unescape(text: str) -> str:
    return re.sub(r"\\([,:])", r"\1", text)


def split_pairs(text: str) -> dict[str, str]:
    """`"k1:v1,k2:v2"` → `{"k1": "v1", "k2": "v2"}`; empty pairs are ignored.

    Raises ValueError for a pair without an unescaped `:` or with an empty key.
    """
    values: dict[str, str] = {}
    for pair in _split_unescaped(text, ","):
        if not pair.strip():
            continue
        key_value = _split_unescaped(pair, ":", maxsplit=1)
        if len(key_value) != 2:
            raise ValueError(f"'{pair}' is not a key:value pair")
        key = _unescape(key_value[0]).strip()
        if not key:
            raise ValueError(f"'{pair}' has an empty key")
        values[key] = _unescape(key_value[1])
    return values


def placeholders(text: str) -> set[str]:
    """Names of the `${name}` / `$name` placeholders in `text` (`$$` is an escaped dollar)."""
    names = set()
    for match in string.Template.pattern.finditer(text):
        name = match.group("named") or match.group("braced")
        if name:
            names.add(name)
    return names


def with_defaults(text: str, values: dict[str, str]) -> dict[str, str]:
    """`values` plus `DEFAULTS` for the default keys that `text` has and `values` lacks."""
    present = placeholders(text)
    merged = {k: v for k, v in DEFAULTS.items() if k in present}
    merged.update(values)
    return merged


def fill(text: str, values: dict[str, str], strict: bool = True) -> str:
    """Substitute `values` into `text`; unknown placeholders are left untouched.

    With `strict`, raises MissingKeyError when a key of `values` has no placeholder in `text`.
    """
    if strict:
        missing = sorted(set(values) - placeholders(text))
        if missing:
            raise MissingKeyError(missing)
    return string.Template(text).safe_substitute(values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-i", "--in_place", action="store_true", help="rewrite FILE instead of printing")
    parser.add_argument("file_path", help="template file, e.g. a config.pbtxt")
    parser.add_argument("substitutions", help='"key1:value1,key2:value2" (escape , and : with a backslash)')
    args = parser.parse_args(argv)

    path = Path(args.file_path)
    text = path.read_text()
    try:
        values = split_pairs(args.substitutions)
        result = fill(text, with_defaults(text, values))
    except MissingKeyError as exc:
        for key in exc.keys:
            print(f"key '{key}' does not exist in the file {args.file_path}.", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"bad substitutions: {exc}", file=sys.stderr)
        return 2
    if args.in_place:
        path.write_text(result)
    else:
        sys.stdout.write(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

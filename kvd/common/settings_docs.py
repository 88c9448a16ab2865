"""The flag tables in docs/, written from the settings' declarations.

    python -m kvd.common.settings_docs           # rewrite the tables in docs/*.md (make docs)
    python -m kvd.common.settings_docs --check   # exit 1 naming each file whose tables are stale

A table stands between two markers in a docs page, the first naming what it
lists: a program (``kvd``, ``kvd-engine``, ``kvd-gateway``, ``kvd-gateway add-key``,
``kvd-serve``, ``kvd-cli``, ``kvd-health``) or ``variables`` (every ``KVD_*``
variable and the programs that read it)::

    <!-- settings: kvd -->
    ...generated...
    <!-- /settings -->

``tests/unit/test_settings.py`` fails when a table differs from what this writes.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from pathlib import Path

import click

from kvd.common.settings import Setting, settings

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

#: Each program (pyproject's scripts; add-key is the gateway's subcommand) and
#: its command, which lists its settings (those of its config object are
#: declared on that object's fields: ``kvd.common.config_fields``).
PROGRAMS = {
    "kvd": "kvd.cli:COMMAND",
    "kvd-engine": "inference.cli:COMMAND",
    "kvd-gateway": "gateway.cli:COMMAND",
    "kvd-gateway add-key": "gateway.cli:ADD_KEY",
    "kvd-serve": "inference.stack:COMMAND",
    "kvd-cli": "gateway.client_cli:cli",
    "kvd-health": "kvd.common.health_probe:COMMAND",
}

_BLOCK = re.compile(r"(<!-- settings: (?P<what>[\w -]+?) -->\n)(?P<body>.*?)(<!-- /settings -->)", re.DOTALL)


def command(program: str) -> click.Command:
    module, name = PROGRAMS[program].split(":")
    return getattr(importlib.import_module(module), name)


def readers() -> dict[str, list[tuple[str, Setting]]]:
    """Each ``KVD_*`` variable: the programs that read it, with the setting each reads it into."""
    found: dict[str, list[tuple[str, Setting]]] = {}
    for program in PROGRAMS:
        for setting in settings(command(program)):
            if setting.env:
                found.setdefault(setting.env, []).append((program, setting))
    return dict(sorted(found.items()))


_TYPE_NAMES = {"integer": "int", "float": "float", "size": "size", "text": "text"}
_HEADER = "| flag | variable | type | default | what it sets |\n|---|---|---|---|---|\n"


def _type(setting: Setting) -> str:
    if setting.is_flag:
        return "flag"
    if isinstance(setting.type, click.Choice):
        return " \\| ".join(setting.type.choices)
    return _TYPE_NAMES.get(setting.type.name, setting.type.name)


def _default(setting: Setting) -> str:
    if setting.default_text is not None:
        return f"`{setting.default_text}`"
    if setting.is_flag:
        return "off"
    if setting.required:
        return "required"
    if setting.default in (None, ""):
        return ""
    return f"`{setting.default}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def program_table(program: str) -> str:
    """The program's settings, a table per section (its ``--help`` order)."""
    sections: dict[str, list[str]] = {}
    for s in settings(command(program)):
        flags = ", ".join(f"`{flag}`" for flag in s.opts)
        env = f"`{s.env}`" if s.env else ""
        row = f"| {flags} | {env} | {_type(s)} | {_default(s)} | {_cell(s.help or '')} |"
        sections.setdefault(s.section, []).append(row)
    parts = []
    for title, rows in sections.items():
        head = f"*{title or 'general'}*\n\n" if len(sections) > 1 else ""
        parts.append(head + _HEADER + "\n".join(rows))
    return "\n\n".join(parts) + "\n"


def variables_table() -> str:
    rows = []
    for env, read in readers().items():
        by = "; ".join(f"`{program}` {setting.opts[0]}" for program, setting in read)
        rows.append(f"| `{env}` | {by} |")
    return "| variable | read by (program and flag) |\n|---|---|\n" + "\n".join(rows) + "\n"


def render(text: str) -> str:
    """``text`` with each marked table written anew."""

    def table(match: re.Match) -> str:
        what = match["what"]
        if what != "variables" and what not in PROGRAMS:
            raise ValueError(f"unknown settings table {what!r}: one of variables, {', '.join(PROGRAMS)}")
        body = variables_table() if what == "variables" else program_table(what)
        return f"{match[1]}\n{body}\n{match[4]}"

    return _BLOCK.sub(table, text)


def tables_in(text: str) -> list[str]:
    return [m["what"] for m in _BLOCK.finditer(text)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvd.common.settings_docs", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table is stale")
    args = p.parse_args(argv)
    stale = []
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text()
        new = render(text)
        if new != text:
            stale.append(page.relative_to(ROOT))
            if not args.check:
                page.write_text(new)
    if args.check and stale:
        print(f"stale settings tables in {', '.join(map(str, stale))}: run `make docs`", file=sys.stderr)
        return 1
    for page in stale:
        print(f"wrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Each setting of a kvd process declared once: flag, environment variable, type, default, help.

A process's settings are ``Setting`` options (click's ``Option``) gathered in
one ``click.Command``; those that set a field of its config object are declared
on that field (``kvd.common.config_fields``). From that one declaration come:

- the flag and the environment variable that sets it (for containers; a flag
  given on the command line wins over its variable, which wins over the default);
- the ``--help`` text, which names each variable and default;
- the error for a bad value, which names the flag and the variable
  (``Invalid value for '--block-size' (env var: 'KVD_BLOCK_SIZE'): ...``);
- the flag tables in docs/ (``python -m kvd.common.settings_docs``; a test fails when
  they drift) and the tests that every ``KVD_*`` variable deploy/ and the docs
  set is one the process reading it declares, with a valid value.

The entry point reads them once (``parse``) into its frozen config object
(``config_from``); nothing deeper reads the environment. docs/development.md
says how to add one.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from types import SimpleNamespace

import click

#: What every command's help ends with.
EPILOG = "Each flag's environment variable is named in its help; a flag given on the command line wins."

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str) -> int:
    """'512MiB' -> 536870912; '2GB' -> 2000000000; '4096' -> 4096.

    Raises:
        ValueError: not a size.
    """
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"not a size: {text!r} (e.g. 512MiB, 2GiB, 1000000)")
    unit = (match.group(2) or "").lower().removesuffix("b")
    return int(float(match.group(1)) * _UNITS[unit])


class ByteSize(click.ParamType):
    """A number of bytes, written with an optional unit: 4096, 2GB, 512MiB."""

    name = "size"

    def convert(self, value, param, ctx) -> int:
        if isinstance(value, int):
            return value
        try:
            return parse_size(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


SIZE = ByteSize()


class Setting(click.Option):
    """One setting: its flags (the first is its name; a last bare word is the
    key it is read under), its environment variable, type, default and help.

    Without a ``default`` a setting is text, empty when not given (unset).

    Args:
        env: the ``KVD_*`` variable that sets it; None for a flag of the
            command line only.
        section: the heading it is listed under in ``--help`` and the docs.
        default_text: how the docs and ``--help`` show a default computed at
            start (e.g. from the user id).
    """

    def __init__(
        self,
        *flags: str,
        env: str | None = None,
        section: str = "",
        default_text: str | None = None,
        **kwargs,
    ) -> None:
        if not (kwargs.get("is_flag") or kwargs.get("required") or "default" in kwargs):
            kwargs["default"] = ""  # a text setting left empty: unset
        default = kwargs.get("default")
        shown = not (default is None or default is False or default == "")
        show_default: bool | str = default_text if default_text is not None else shown
        super().__init__(list(flags), envvar=env, show_envvar=env is not None, show_default=show_default, **kwargs)
        self.section = section
        self.default_text = default_text

    @property
    def env(self) -> str | None:
        return self.envvar if isinstance(self.envvar, str) else None


def log_level() -> Setting:
    """The log level, the same setting in every server."""
    return Setting("--log-level", env="KVD_LOG_LEVEL", default="info", help="debug, info, warning or error")


class SettingsCommand(click.Command):
    """A command whose ``--help`` lists its settings under their sections, in declaration order."""

    def __init__(self, name: str, params: Sequence[click.Parameter], **kwargs) -> None:
        if any(isinstance(p, Setting) and p.env for p in params):
            kwargs.setdefault("epilog", EPILOG)
        kwargs.setdefault("context_settings", {"help_option_names": ["-h", "--help"], "max_content_width": 100})
        kwargs.setdefault("add_help_option", True)
        super().__init__(name, params=list(params), **kwargs)

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        sections: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            if not isinstance(param, click.Option):
                continue  # arguments: the usage line names them
            record = param.get_help_record(ctx)
            if record is not None:
                sections.setdefault(getattr(param, "section", ""), []).append(record)
        for title, records in sections.items():
            with formatter.section(title or "Options"):
                formatter.write_dl(records)


def settings(command: click.Command) -> list[Setting]:
    """The command's declared settings, in order."""
    return [p for p in command.params if isinstance(p, Setting)]


def parse(command: click.Command, argv: Sequence[str] | None = None) -> SimpleNamespace:
    """Reads the command's flags and environment variables, once.

    Returns:
        each setting's value by name (``values.block_size``), converted.

    Raises:
        SystemExit: 0 after ``--help``; 2 after printing the usage error
            (a bad value names its flag and variable).
    """
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        with command.make_context(command.name, args) as ctx:
            return SimpleNamespace(**ctx.params)
    except click.exceptions.Exit as done:  # --help was printed
        raise SystemExit(done.exit_code) from None
    except click.ClickException as exc:
        exc.show()
        raise SystemExit(exc.exit_code) from None


def default_socket() -> str:
    return f"/tmp/kvd-{os.getuid()}/kvd.sock"


#: How the docs write ``default_socket()``.
DEFAULT_SOCKET_TEXT = "/tmp/kvd-$UID/kvd.sock"


#: The daemon's unix socket: declared here because kvd-serve takes it too and passes
#: its own to the daemon it starts.
SOCKET = Setting(
    "--socket",
    env="KVD_SOCKET",
    default=default_socket,
    default_text=DEFAULT_SOCKET_TEXT,
    section="listening",
    help="the daemon's unix socket (mode 0600: only this user, who may call everything)",
)

# Variables no longer read, and what replaced them: a container started with
# one is refused rather than silently run with a default.
RETIRED_VARIABLES = {
    "KVD_DTYPE": (
        "KVD_DTYPE is no longer read: it meant the daemon's cache dtype and the engine's model dtype at once. "
        "Set KVD_CACHE_DTYPE (the daemon, with --num-layers) or KVD_MODEL_DTYPE (the engine) instead."
    ),
}


def refuse_retired_variables(prog: str) -> None:
    """Exits, printing a message that names the replacement, when a retired variable is set."""
    for name, message in RETIRED_VARIABLES.items():
        if name in os.environ:
            raise SystemExit(f"{prog}: {message}")

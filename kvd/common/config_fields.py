"""Config fields that declare their settings: each setting written once, where its value lives.

A process's frozen config dataclass (``DaemonConfig``, ``EngineSettings``,
``GatewaySettings``) declares each of its settings on the field it sets::

    @dataclass(frozen=True)
    class DaemonConfig:
        lease_s: float = setting(
            "--lease-s", env="KVD_LEASE_S", type=click.FLOAT, default=5.0, section=_CACHE,
            help="release a session not heard from for this long",
        )

The field's arguments are its ``Setting``'s (``kvd.common.settings``: flag,
``KVD_*`` variable, type, default, help, section). From that one declaration come:

- the field's default: the setting's, converted by its type (``"1GiB"`` -> 1073741824);
- the program's command (``settings_of``), and with it ``--help``, the errors for
  bad values and the tables in docs/;
- the config object from the parsed flags and variables (``config_from``).

Three shapes of field:

- ``setting(...)``: one setting; ``convert`` turns its value into the field's
  (``operator.not_`` for a ``--no-...`` flag, ``optional_path`` for a folder);
- ``nested(Config)``: another config dataclass whose fields declare settings
  (the gateway's ``RouterConfig``);
- ``from_settings(build, ...)``: a value built from several settings (the
  daemon's cache layout), ``build`` given all the parsed values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kvd.common.settings import Setting

#: Where a field keeps its declaration, in its ``dataclasses.field`` metadata.
_DECLARED = "kvd.settings"


@dataclasses.dataclass(frozen=True)
class _Declared:
    """What a field declares: its settings, and how its value is read from theirs."""

    settings: tuple[Setting, ...]
    read: Callable[[SimpleNamespace], Any]


def setting(
    *flags: str,
    convert: Callable[[Any], Any] | None = None,
    field_default: Any = dataclasses.MISSING,
    **options: Any,
) -> Any:
    """A config field set by one setting.

    Args:
        flags, options: the ``Setting``'s (``kvd.common.settings.Setting``).
        convert: the field's value from the setting's (default: the same).
        field_default: the default of a config built in code, only where it
            cannot be the setting's (the daemon's ``auto`` device is resolved on
            the machine that starts it); otherwise the setting's default, converted.
    """
    declared = Setting(*flags, **options)
    convert = convert or _same
    metadata = {_DECLARED: _Declared((declared,), lambda values: convert(getattr(values, declared.name)))}
    if field_default is not dataclasses.MISSING:
        return dataclasses.field(default=field_default, metadata=metadata)

    def default() -> Any:
        value = declared.default() if callable(declared.default) else declared.default
        return convert(None if value is None else declared.type.convert(value, declared, None))

    # NOTE: a default computed at start (the socket's path, from the user id)
    # or a mutable one (a list) must be made afresh for each config.
    if callable(declared.default) or type(default()).__hash__ is None:
        return dataclasses.field(default_factory=default, metadata=metadata)
    return dataclasses.field(default=default(), metadata=metadata)


def nested(config: type) -> Any:
    """A config field holding another config dataclass, whose fields declare its settings."""
    declared = _Declared(tuple(settings_of(config)), partial(config_from, config))
    return dataclasses.field(default_factory=config, metadata={_DECLARED: declared})


def from_settings(build: Callable[[SimpleNamespace], Any], *settings: Setting, default: Any = None) -> Any:
    """A config field built from several settings.

    Args:
        build: the field's value from every parsed value of the program (it may
            read settings declared on other fields, too).
        settings: those only this field reads.
        default: the default of a config built in code.
    """
    return dataclasses.field(default=default, metadata={_DECLARED: _Declared(settings, build)})


def settings_of(config: type) -> list[Setting]:
    """The settings ``config``'s fields declare, in field order: the order of ``--help``."""
    return [s for f in dataclasses.fields(config) if _DECLARED in f.metadata for s in f.metadata[_DECLARED].settings]


def setting_of(config: type, name: str) -> Setting:
    """The setting field ``name`` of ``config`` declares, for another command that takes it too."""
    (declared,) = next(f for f in dataclasses.fields(config) if f.name == name).metadata[_DECLARED].settings
    return declared


def config_from(config: type, values: SimpleNamespace) -> Any:
    """A ``config`` from a command's parsed values (``kvd.common.settings.parse``).

    Raises:
        ValueError: the values are invalid together (the config's ``__post_init__``).
    """
    declared = [f for f in dataclasses.fields(config) if f.init and _DECLARED in f.metadata]
    return config(**{f.name: f.metadata[_DECLARED].read(values) for f in declared})


def optional_path(text: str) -> Path | None:
    """A folder or file setting's path; None when empty (unset)."""
    return Path(text) if text else None


def optional_text(text: str) -> str | None:
    """A text setting's value; None when empty (unset)."""
    return text or None


def _same(value: Any) -> Any:
    return value

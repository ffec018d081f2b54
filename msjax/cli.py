"""The one command-line parser of every msjax script: `parse(argv, ScriptOptions)` -> (Config, options).

Every field of `msjax.config.Config` is a dotted flag (`--train.steps=200`, `--mesh.tensor 2`), defaults come
from the preset `--config=NAME` picks (or a preset, YAML or JSON file: `--config=PATH`, a run directory's
config.json included; `msjax.config.load_preset`), and a script adds its own flags as a frozen dataclass of options
(`--steps`, `--json`, ...). `--help` lists every flag with its type, default and the field's docstring.

Why tyro: it builds an argparse parser from (nested) dataclasses and their docstrings, which is what msjax's
typed frozen `Config` already is; torchtitan feeds its config dataclasses to `tyro.cli` the same way. draccus
(Levanter) parses the same dataclasses, but its help shows no field docstrings from class docstrings, and it
wants YAML config files we do not use. Values are converted by `msjax.config.coerce` through a tyro
constructor rule, so the command line accepts exactly what presets and `apply_overrides` accept
(`--train.progress=false`, `--model.attention.window=none`, `--data.paths=a.txt,b.txt`) and every bad flag is a
ConfigError naming the key and the allowed values, as notebook overrides are.

Scripts call `main_guard` (or catch ConfigError themselves) so a bad flag prints one `error: ...` line and exits
with status 2.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import types
import typing
from typing import Annotated, Any, Callable, Literal, Sequence, TypeVar

from msjax.config import (Config, ConfigError, apply_overrides, coerce, describe_type, flat_keys, load_preset,
                          preset_names)

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class CommonOptions:
    """Flags every script has.

    Attributes:
      config: the preset in configs/ whose values are the defaults of every other flag, or a path to a preset
        .py file, a YAML or a JSON file of keys (a run directory's config.json, or the directory, reproduces that
        run); flags still override it.
      resume: shorthand for --checkpoint.resume=true (continue from the latest checkpoint).
      log_level: messages at this level and above are shown (DEBUG, INFO, WARNING, ERROR).
      quiet: only warnings and errors (same as --log_level=WARNING).
      verbose: debug messages too (same as --log_level=DEBUG).
    """

    config: str = "gpt_tiny"
    resume: bool = False
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    quiet: bool = False
    verbose: bool = False


@dataclasses.dataclass(frozen=True)
class LoggingOptions:
    """Logging flags of a script without a training config.

    Attributes:
      log_level: messages at this level and above are shown (DEBUG, INFO, WARNING, ERROR).
      quiet: only warnings and errors (same as --log_level=WARNING).
      verbose: debug messages too (same as --log_level=DEBUG).
    """

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    quiet: bool = False
    verbose: bool = False


class _BadValue(Exception):
    """Raised inside tyro by our constructor rule; not a ValueError, so tyro lets it through unformatted."""

    def __init__(self, tp: Any, value: str):
        super().__init__(value)
        self.tp, self.value = tp, value


def _is_leaf(tp: Any) -> bool:
    origin = typing.get_origin(tp)
    return tp in (int, float, bool, str) or origin in (Literal, typing.Union, types.UnionType, tuple)


def _registry():
    from tyro.constructors import ConstructorRegistry, PrimitiveConstructorSpec, PrimitiveTypeInfo

    registry = ConstructorRegistry()

    @registry.primitive_rule
    def _coerced(info: PrimitiveTypeInfo):
        tp = info.type
        if not _is_leaf(tp):
            return None

        def from_str(args: list[str]) -> Any:
            try:
                return coerce("?", tp, args[0])
            except ConfigError:
                raise _BadValue(tp, args[0]) from None

        choices = None
        if typing.get_origin(tp) is Literal:
            choices = tuple(str(a) for a in typing.get_args(tp))
        metavar = {int: "INT", float: "FLOAT", bool: "BOOL", str: "STR"}.get(tp)
        if metavar is None:
            metavar = ("{" + ",".join(choices) + "}" if choices else "X,Y,..." if typing.get_origin(tp) is tuple
                       else describe_type(tp).upper().replace(" ", "_"))
        return PrimitiveConstructorSpec(
            nargs=1, metavar=metavar, instance_from_str=from_str, is_instance=lambda x: True,
            str_from_instance=lambda x: [",".join(x) if isinstance(x, tuple) else str(x)], choices=None)

    return registry


def _docs(cls: type) -> dict[str, str]:
    """Field -> description from a Google-style `Attributes:` section of `cls`'s docstring."""
    import docstring_parser  # a dependency of tyro

    return {p.arg_name: p.description or "" for p in docstring_parser.parse(cls.__doc__ or "").params}


def _flags_class(cfg: Config, options: Sequence[Any]) -> type:
    """A dataclass whose fields are Config's sections (defaults: `cfg`) followed by each options object's fields
    (defaults: that object's values), for tyro to parse."""
    import tyro

    fields: list[tuple[str, Any, Any]] = []
    hints = typing.get_type_hints(Config)
    for f in dataclasses.fields(Config):
        tp = hints[f.name]
        if f.name == "name":
            tp = Annotated[tp, tyro.conf.arg(help="the run's name (the preset's, unless set)")]
        fields.append((f.name, tp, dataclasses.field(default=getattr(cfg, f.name))))
    seen = {f.name for f in dataclasses.fields(Config)}
    for opts in options:
        docs, hints = _docs(type(opts)), typing.get_type_hints(type(opts))
        for f in dataclasses.fields(opts):
            if f.name in seen:
                raise TypeError(f"option --{f.name} of {type(opts).__name__} clashes with another flag")
            seen.add(f.name)
            help_ = docs.get(f.name, "")
            if f.name == "config":
                help_ += f" Presets: {', '.join(preset_names())}."
            fields.append((f.name, Annotated[hints[f.name], tyro.conf.arg(help=help_)],
                           dataclasses.field(default=getattr(opts, f.name))))
    return dataclasses.make_dataclass("Flags", fields, frozen=True)


def _known_flags(cfg: Config, options: Sequence[Any]) -> tuple[set[str], set[str], set[str]]:
    """(leaf flags, bool leaf flags, section names)."""
    leaves, bools = set(), set()
    for key, value in flat_keys(cfg).items():
        leaves.add(key)
        if isinstance(value, bool):
            bools.add(key)
    for opts in options:
        for f in dataclasses.fields(opts):
            leaves.add(f.name)
            if isinstance(getattr(opts, f.name), bool):
                bools.add(f.name)
    sections = {k.rsplit(".", 1)[0] for k in flat_keys(cfg) if "." in k}
    sections |= {s.rsplit(".", i)[0] for s in list(sections) for i in range(1, s.count(".") + 1)}
    return leaves, bools, sections


def _normalise(argv: Sequence[str], cfg: Config, options: Sequence[Any]) -> list[str]:
    """Checks flag names against the config (unknown keys and sections are ConfigErrors naming the allowed keys,
    with the same message `apply_overrides` gives) and lets a bool flag stand alone (`--resume`, `--search`)."""
    leaves, bools, sections = _known_flags(cfg, options)
    out: list[str] = []
    args = list(argv)
    for i, arg in enumerate(args):
        if not arg.startswith("--") or arg in ("--help",):
            out.append(arg)
            continue
        key, eq, _ = arg[2:].partition("=")
        has_value = bool(eq) or (i + 1 < len(args) and not args[i + 1].startswith("--"))
        if key not in leaves:
            if key in sections and not has_value:
                raise ConfigError(f"flag --{key} needs a value (--{key}=VALUE)")
            option_names = sorted({f.name for o in options for f in dataclasses.fields(o)})
            try:
                apply_overrides(cfg, {key: "0"})  # raises the config's own unknown-key / section message
            except ConfigError as e:
                if key in sections or "." in key:
                    raise
                raise ConfigError(f"{e}; script flags: {', '.join('--' + n for n in option_names)}") from None
        if key in bools and not has_value:
            arg = f"--{key}=true"
        elif not has_value:
            raise ConfigError(f"flag --{key} needs a value (--{key}=VALUE)")
        out.append(arg)
    return out


def explicit_keys(argv: Sequence[str]) -> set[str]:
    """The dotted config keys set on the command line `argv` (`--model.remat=full`, `--model.remat full`): what
    the user chose, as opposed to what the preset or the defaults say. A script that may adjust a preset's value
    (the planner's choice of remat policy) leaves these alone."""
    keys = (a[2:].partition("=")[0].replace("-", "_") for a in argv if a.startswith("--"))
    return {k for k in keys if "." in k}


def _preset_flag(argv: Sequence[str], default: str) -> str:
    """The last --config given (later flags win, as argparse does)."""
    preset = default
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            preset = arg.split("=", 1)[1]
        elif arg == "--config" and i + 1 < len(argv):
            preset = argv[i + 1]
    return preset


def _key_of(argv: Sequence[str], value: str) -> str:
    """The flag whose value is `value` (for naming a bad value: tyro does not tell a constructor its flag)."""
    for i, arg in enumerate(argv):
        if arg.startswith("--"):
            key, eq, v = arg[2:].partition("=")
            if (eq and v == value) or (not eq and i + 1 < len(argv) and argv[i + 1] == value):
                return key
    return "?"


def parse(argv: Sequence[str], *options: Any, prog: str | None = None, description: str | None = None,
          default_preset: str = "gpt_tiny", validate: bool = True) -> tuple[Config, tuple[Any, ...]]:
    """Parses a script's command line into a validated Config and the script's options.

    Args:
      argv: the arguments (without the program name).
      *options: default instances of the script's frozen option dataclasses (documented in an `Attributes:`
        section of their docstrings, which `--help` shows). `CommonOptions()` is added first when absent.
      prog, description: for `--help`'s usage line and text.
      default_preset: the preset used when no `--config` is given.
      validate: run `Config.validate()` (on by default).
    Returns:
      (config, options): options in the order given, with CommonOptions first when it was added. `--resume` is
      applied to the config (checkpoint.resume).
    Raises:
      ConfigError: an unknown preset or flag, a flag without a value, a bad value (the message names the key and
        what is allowed), or a config that does not validate.
      SystemExit: after printing `--help` (status 0).
    """
    import tyro

    if not any(isinstance(o, CommonOptions) for o in options):
        options = (CommonOptions(config=default_preset),) + tuple(options)
    argv = list(argv)
    preset = _preset_flag(argv, default_preset)
    cfg = load_preset(preset)
    options = tuple(dataclasses.replace(o, config=preset) if isinstance(o, CommonOptions) else o
                    for o in options)
    args = _normalise(argv, cfg, options)
    flags_cls = _flags_class(cfg, options)
    try:
        flags = tyro.cli(flags_cls, args=args, prog=prog, description=description, use_underscores=True,
                         registry=_registry(), config=(tyro.conf.FlagConversionOff,))
    except _BadValue as e:
        key = _key_of(argv, e.value)
        coerce(key, e.tp, e.value)  # raises the ConfigError naming the key and what is allowed
        raise ConfigError(f"--{key}={e.value!r}: allowed is {describe_type(e.tp)}") from None
    except SystemExit as e:
        if e.code not in (0, None):  # tyro already printed its own error box
            raise ConfigError("see the message above") from None
        raise
    cfg = Config(**{f.name: getattr(flags, f.name) for f in dataclasses.fields(Config)})
    parsed = tuple(type(o)(**{f.name: getattr(flags, f.name) for f in dataclasses.fields(o)}) for o in options)
    common = next(o for o in parsed if isinstance(o, CommonOptions))
    if common.resume:
        cfg = apply_overrides(cfg, {"checkpoint.resume": True})
    return (cfg.validate() if validate else cfg), parsed


def parse_options(argv: Sequence[str], *options: Any, prog: str | None = None,
                  description: str | None = None) -> tuple[Any, ...]:
    """`parse` for a script without a training config (e.g. bench_attention.py): only its option dataclasses,
    plus the logging flags of CommonOptions. Returns the parsed options, CommonOptions first. Raises ConfigError
    on an unknown flag or bad value (naming it and what is allowed); SystemExit after `--help`."""
    import tyro

    common = LoggingOptions()
    options = (common,) + tuple(options)
    seen: set[str] = set()
    fields: list[tuple[str, Any, Any]] = []
    names = {f.name for o in options for f in dataclasses.fields(o)}
    for i, arg in enumerate(argv):
        key = arg[2:].partition("=")[0].replace("-", "_") if arg.startswith("--") else None
        if key is not None and key not in names and key not in ("help",):
            raise ConfigError(f"unknown flag --{key}; allowed: {', '.join('--' + n for n in sorted(names))}")
    for opts in options:
        docs, hints = _docs(type(opts)), typing.get_type_hints(type(opts))
        for f in dataclasses.fields(opts):
            seen.add(f.name)
            fields.append((f.name, Annotated[hints[f.name], tyro.conf.arg(help=docs.get(f.name, ""))],
                           dataclasses.field(default=getattr(opts, f.name))))
    flags_cls = dataclasses.make_dataclass("Flags", fields, frozen=True)
    bools = {f.name for o in options for f in dataclasses.fields(o) if isinstance(getattr(o, f.name), bool)}
    args = []
    for i, arg in enumerate(argv):
        key, eq, _ = arg[2:].partition("=")
        standalone = arg.startswith("--") and not eq and (i + 1 == len(argv) or argv[i + 1].startswith("--"))
        args.append(f"{arg}=true" if standalone and key.replace("-", "_") in bools else arg)
    try:
        flags = tyro.cli(flags_cls, args=args, prog=prog, description=description, use_underscores=True,
                         registry=_registry(), config=(tyro.conf.FlagConversionOff,))
    except _BadValue as e:
        key = _key_of(argv, e.value)
        coerce(key, e.tp, e.value)
        raise ConfigError(f"--{key}={e.value!r}: allowed is {describe_type(e.tp)}") from None
    except SystemExit as e:
        if e.code not in (0, None):
            raise ConfigError("see the message above") from None
        raise
    return tuple(type(o)(**{f.name: getattr(flags, f.name) for f in dataclasses.fields(o)}) for o in options)


class _LevelFormatter(logging.Formatter):
    """The message alone, with `warning: ` or `error: ` before it from WARNING up: the words the scripts' own
    one-line errors start with, so a reader (or a launcher showing other ranks' warnings and errors, msjax.launch)
    tells them from progress."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if record.levelno >= logging.ERROR:
            return "error: " + text
        return "warning: " + text if record.levelno >= logging.WARNING else text


def setup_logging(options: CommonOptions | LoggingOptions) -> None:
    """Configures the root logger once for a script: one stream handler on stderr at the level the flags ask for
    (`--quiet` WARNING, `--verbose` DEBUG, else `--log_level`); warnings and errors start with `warning: ` and
    `error: `. The training loop routes these records around
    its progress bar (`tqdm.contrib.logging.logging_redirect_tqdm`)."""
    level = "WARNING" if options.quiet else "DEBUG" if options.verbose else options.log_level
    logging.basicConfig(level=level, stream=sys.stderr, force=True)
    logging.getLogger().handlers[0].setFormatter(_LevelFormatter())
    # Libraries that log chattily at INFO (orbax, absl) stay at WARNING unless debugging.
    for name in ("absl", "orbax", "jax", "tensorstore", "botocore", "aiobotocore", "s3fs", "gcsfs"):
        logging.getLogger(name).setLevel(logging.DEBUG if level == "DEBUG" else logging.WARNING)


def main_guard(fn: Callable[[], int]) -> int:
    """Runs a script's body; a ConfigError (or a DataError / OSError naming a path) becomes one `error: ...` line
    on stderr and exit status 2."""
    from msjax.data import DataError

    try:
        return fn()
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def check_writable(path: str, flag: str) -> None:
    """Raises ConfigError naming `flag`, `path` and the reason when a file cannot be created at `path` (its
    directory missing or not writable, or `path` a directory). Creates nothing that was not there."""
    from pathlib import Path

    p = Path(path).expanduser()
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        raise ConfigError(f"{flag}={path!r} is a directory; give a file path")
    if not parent.is_dir():
        raise ConfigError(f"{flag}={path!r}: directory {str(parent)!r} does not exist")
    try:
        existed = p.exists()
        with open(p, "a"):
            pass
        if not existed:
            p.unlink()
    except OSError as e:
        raise ConfigError(f"{flag}={path!r} is not writable ({e.strerror})") from None


def flag_value(value: Any) -> str:
    """A config value as a command-line string that `msjax.config.coerce` reads back as the same value."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)):
        return ",".join(str(v) for v in value)
    return str(value)


def config_flags(cfg: Config, base: Config) -> list[str]:
    """`--key=value` for every config key whose value in `cfg` differs from `base` (its preset): the flags that
    give `cfg` again on top of `--config=<base's preset>`."""
    before = flat_keys(base)
    return [f"--{key}={flag_value(value)}" for key, value in flat_keys(cfg).items() if value != before[key]]


def print_result(table: str, result: Any, json_path: str = "") -> None:
    """How every benchmark script ends: `table` (human-readable) and `result` as one JSON line on stdout, and
    `result` as indented JSON in `json_path` when given (check it first with `check_writable`)."""
    import json

    print(table)
    print(json.dumps(result))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)

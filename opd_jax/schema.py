"""Config value declarations: a `Field` holds a value's default, type and allowed range or
set, written once, side by side; `ConfigError` is the one error of a bad config.

    Int(200, lo=1)                     # an int >= 1, default 200
    Float(0.9, lo=0, hi=1, hi_open=True)
    Choice("cosine", ("cosine", "constant"))
    field.check("optim.b1", 1.5)       # ConfigError: optim.b1=1.5: expected a number in [0, 1)

Dataclasses declare option fields with `option(Field)` (the objectives in
opd_jax/trainers/objectives.py, `losses.Correction`) and check them in ``__post_init__``
with `check_options`. The trainer configs' sections and their validation live in
`opd_jax.trainers.config_schema`.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import ml_collections


class ConfigError(ValueError):
    """A config file, preset, override or value is wrong; the message says which and why."""


INT, FLOAT, BOOL, STR, SEQ, MAP = "int", "float", "bool", "str", "seq", "map"


@dataclasses.dataclass(frozen=True)
class Field:
    """One config value: its default, kind, and range (numbers) or choices (strings).

    `lo` / `hi` bound numbers (open ends with `lo_open` / `hi_open`); `choices` lists the
    allowed strings; `optional` admits None; `hint` is added to the error ("0: off")."""
    default: Any
    kind: str
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    choices: tuple = ()
    optional: bool = False
    hint: str = ""
    allow_inf: bool = False      # +inf admitted (a cap that may be off)
    item: Field | None = None    # a sequence's elements, each checked by it

    @property
    def numeric(self) -> bool:
        return self.kind in (INT, FLOAT)

    def expected(self) -> str:
        if self.choices:
            text = "one of " + ", ".join(repr(c) for c in self.choices)
        elif self.numeric:
            what = "an int" if self.kind == INT else "a number" \
                if (self.lo is not None and self.hi is not None) or self.allow_inf \
                else "a finite number"
            if self.lo is not None and self.hi is not None:
                text = (f"{what} in {'(' if self.lo_open else '['}{_num(self.lo)}, "
                        f"{_num(self.hi)}{')' if self.hi_open else ']'}")
            elif self.lo is not None:
                text = f"{what} {'>' if self.lo_open else '>='} {_num(self.lo)}"
            elif self.hi is not None:
                text = f"{what} {'<' if self.hi_open else '<='} {_num(self.hi)}"
            else:
                text = what
        else:
            text = {BOOL: "True or False", STR: "a string", SEQ: "a list or tuple",
                    MAP: "a dict"}[self.kind]
        if self.optional:
            text += " or None"
        return f"{text} ({self.hint})" if self.hint else text

    def ok(self, value) -> bool:
        if value is None:
            return self.optional
        if self.kind == BOOL:
            return isinstance(value, bool)
        if self.kind == STR:
            return isinstance(value, str) and (not self.choices or value in self.choices)
        if self.kind == SEQ:
            return isinstance(value, (list, tuple))
        if self.kind == MAP:
            return isinstance(value, (Mapping, ml_collections.ConfigDict))
        value = _python_number(value)
        if value is _TRACED:         # a traced hyperparameter: checked once concrete
            return True
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.kind == INT and not isinstance(value, int):
            return False
        if math.isnan(value) or (math.isinf(value) and not (self.allow_inf and value > 0)):
            return False
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)

    def check(self, key: str, value) -> None:
        if not self.ok(value):
            raise ConfigError(f"{key}={value!r}: expected {self.expected()}")
        if self.item is not None and value is not None:
            for i, v in enumerate(value):
                if not self.item.ok(v):
                    raise ConfigError(f"{key}={tuple(value)!r}: element {i} ({v!r}) expected "
                                      f"{self.item.expected()}")

    def out_of_range(self) -> list:
        """Values just outside the range (for the schema test): one past each bound."""
        if not self.numeric:
            return []
        step = 1 if self.kind == INT else 0.5
        out = []
        if self.lo is not None:
            out.append(self.lo if self.lo_open else self.lo - step)
        if self.hi is not None:
            out.append(self.hi if self.hi_open else self.hi + step)
        return [self._typed(v) for v in out]

    def _typed(self, v):
        return int(v) if self.kind == INT else float(v)


_TRACED = object()


def _python_number(value):
    """A numpy / concrete jax scalar as a Python number; _TRACED for a tracer."""
    if isinstance(value, (int, float)) or not hasattr(value, "dtype"):
        return value
    try:
        if getattr(value, "ndim", 0) != 0:
            return value
        kind = value.dtype.kind
        return int(value) if kind in "iu" else float(value) if kind == "f" else value
    except Exception:  # noqa: BLE001 - a tracer cannot be read at trace time
        return _TRACED


def _num(x) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def Int(default, lo=None, hi=None, *, optional=False, hint=""):  # noqa: N802 - declarations
    return Field(default, INT, lo, hi, optional=optional, hint=hint)


def Float(default, lo=None, hi=None, *, lo_open=False, hi_open=False, optional=False,  # noqa: N802
          hint="", allow_inf=False):
    return Field(default, FLOAT, lo, hi, lo_open, hi_open, optional=optional, hint=hint,
                 allow_inf=allow_inf)


def Choice(default, choices, *, optional=False, hint=""):  # noqa: N802
    return Field(default, STR, choices=tuple(choices), optional=optional, hint=hint)


def Str(default="", *, hint=""):  # noqa: N802
    return Field(default, STR, hint=hint)


def Bool(default, *, hint=""):  # noqa: N802
    return Field(default, BOOL, hint=hint)


def Seq(default, *, hint="", item: Field | None = None):  # noqa: N802
    return Field(tuple(default), SEQ, hint=hint, item=item)


def Map(default=None, *, hint=""):  # noqa: N802 - free-form: names the user picks -> values
    return Field(dict(default or {}), MAP, hint=hint)


# -- objectives: option fields declared on the dataclass ------------------------------------

def option(field: Field):
    """A dataclass field declared by `field`: its default and its config type and range."""
    return dataclasses.field(default=field.default, metadata={"schema": field})


def option_fields(cls) -> dict[str, Field]:
    """name -> Field of a dataclass's declared options (`option`)."""
    return {f.name: f.metadata["schema"] for f in dataclasses.fields(cls)
            if f.metadata.get("schema") is not None}


def check_options(obj, prefix: str = "") -> None:
    """Check a dataclass's declared options against their fields (its ``__post_init__``)."""
    for name, field in option_fields(type(obj)).items():
        field.check(prefix + name, getattr(obj, name))


@dataclasses.dataclass(frozen=True)
class Sub:
    """A nested section of a config schema, by its section name."""
    name: str

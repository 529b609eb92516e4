"""Precision pairs: which format stores the anchor and which the read copy, and the buffer length.

A pair is YAML data in ``configs/pairs/<name>.yaml``::

    name: tp4_hi16_sr
    read:   {format: nvfp4, rounding: nearest}   # omit `read` for a shared pair
    anchor: {format: fp16,  rounding: stochastic}
    buffer_len: 16

and a Python object::

    from replayquant import PrecisionPair
    pair = PrecisionPair.load("tp4_hi16_sr")            # a name in configs/pairs/
    pair = PrecisionPair.load("path/to/pair.yaml")      # or a file
    pair = PrecisionPair(read=FormatSpec("nvfp4"), anchor=FormatSpec("fp16", "stochastic"),
                         buffer_len=16)

* ``anchor``: the recurrence checkpoint, written only at a flush (every ``buffer_len`` steps).
* ``read``: the copy read by every non-flush step to compute outputs; never read back into the
  recurrence. ``read=None`` makes a *shared* pair: one copy (the anchor) serves both roles.
* ``buffer_len`` (L >= 1): steps buffered between flushes. A shared pair with L = 1 is the
  conventional read-modify-write recurrence.

Every validation problem raises one ValueError naming the problem and the fix.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

import yaml
from rich.table import Table

from replayquant.formats import FORMATS, Format, get_format
from replayquant.formats.constants import ROUNDINGS

__all__ = ["FormatSpec", "PrecisionPair", "PAIRS_DIR", "list_pairs", "pairs_table", "tidy_name",
           "name_key", "check_name", "check_shipped_name"]

def _pairs_dir():
    """The shipped pairs, read as package data: configs/pairs/ of the source tree, reached through
    the package's `configs` link in a checkout and copied into the package by a wheel build."""
    d = files("replayquant") / "configs" / "pairs"
    if not d.is_dir():
        raise RuntimeError(f"replayquant's shipped precision pairs are missing ({d}): the package "
                           "was installed without its data; reinstall it with `pip install replayquant`"
                           " or from a source checkout")
    return d


PAIRS_DIR = _pairs_dir()

# A pair or policy file holds tens of values; a file that is longer than MAX_YAML_BYTES or
# expands to more than MAX_YAML_VALUES values (aliases *a repeat what an anchor &a holds, so a few
# lines can expand to billions: "billion laughs") is refused at load instead of filling memory
# (or taking minutes) when its values are first used.
MAX_YAML_VALUES = 100_000
MAX_YAML_BYTES = 1 << 20


class _TooLarge(ValueError):
    pass


def _yaml_loader():
    """A safe YAML loader (libyaml's where installed) that refuses documents expanding to more
    than MAX_YAML_VALUES values or referring to themselves."""
    base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

    class Loader(base):
        def construct_document(self, node):
            sizes, open_ = {}, set()

            def size(n) -> int:             # values once aliases are expanded, memoised per node
                if id(n) in sizes:
                    return sizes[id(n)]
                if id(n) in open_:
                    raise _TooLarge("an alias refers to the value that holds it (a recursive "
                                    "YAML value)")
                open_.add(id(n))
                kids = (n.value if isinstance(n, yaml.SequenceNode) else
                        [x for kv in n.value for x in kv] if isinstance(n, yaml.MappingNode) else [])
                total = 1
                for k in kids:
                    total += size(k)
                    if total > MAX_YAML_VALUES:
                        raise _TooLarge(f"it holds more than {MAX_YAML_VALUES} values (counting "
                                        f"what its aliases *name repeat); a pair or policy file "
                                        f"holds a few dozen")
                open_.discard(id(n))
                sizes[id(n)] = total
                return total
            size(node)
            return super().construct_document(node)
    return Loader


def read_yaml(path, what: str):
    """The parsed contents of a YAML file (a Path or a package resource), or one error naming
    `what` the file should be when it is missing, not YAML, or larger than a pair or policy
    can be (MAX_YAML_VALUES)."""
    if not path.is_file():
        raise ValueError(f"{what} {str(path)!r} does not exist")
    size = path.stat().st_size if hasattr(path, "stat") else 0     # package data: ours, small
    if size > MAX_YAML_BYTES:
        raise ValueError(f"{path}: it is {size / 2 ** 20:.1f} MiB long, and a pair or policy "
                         f"file is a few hundred bytes (files over {MAX_YAML_BYTES // 2 ** 20} "
                         f"MiB are refused)")
    text = path.read_text()
    try:
        return yaml.load(text, Loader=_yaml_loader())
    except _TooLarge as e:
        raise ValueError(f"{path}: {e}") from None
    except RecursionError:
        raise ValueError(f"{path}: its values nest too deeply (a pair or policy nests three "
                         f"levels)") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML ({e})") from None


def check_mapping(data, keys, source: str, what: str, hint=lambda unknown: "") -> None:
    """`data` (a YAML mapping: a file's top level, an entry of a list) must be a mapping whose
    keys are among `keys`: one ValueError naming `source` and the keys `what` ("a precision
    pair") takes otherwise (hint(unknown): a clause after the unknown keys)."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: not {what} (expected a mapping with keys "
                         f"{', '.join(keys)}, got {type(data).__name__})")
    unknown = sorted(set(data) - set(keys))
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {unknown}{hint(unknown)}; {what} takes "
                         f"{', '.join(keys)}")


def tidy_name(s) -> str:
    """A name as tables, fronts and file names show it: the stem of a .yaml / .yml path, every
    run of characters other than letters, digits and . _ @ - replaced by "-", and "-" stripped
    at both ends (`tp4_hi16_sr!` -> `tp4_hi16_sr`)."""
    s = str(s)
    if s.endswith((".yaml", ".yml")):
        s = Path(s).stem
    return re.sub(r"[^A-Za-z0-9._@-]+", "-", s).strip("-")


def name_key(name) -> str:
    """What a pair or variant name says it stores, for comparing it with the shipped names: its
    tidy form (`tidy_name`) before any "@" (the sweep's `@L16`, a sensitivity run's `@layer3`
    name where and how long a pair is used), lower case, letters and digits only. Two names of
    one key look alike in a table: `tp4_hi16_sr`, `"tp4_hi16_sr "`, `TP4-HI16-SR@L8`."""
    return re.sub(r"[^a-z0-9]", "", tidy_name(name).split("@", 1)[0].lower())


@functools.cache
def _shipped() -> dict:
    """{name_key: (name, read FormatSpec or None, anchor FormatSpec)} of the shipped pairs, read
    from their YAML without making PrecisionPairs (whose construction checks against this)."""
    out = {}
    for name in list_pairs():
        data = read_yaml(PAIRS_DIR / f"{name}.yaml", "precision pair file")
        read = data.get("read")
        out[name_key(name)] = (name, None if read is None else FormatSpec.parse(read, "read"),
                               FormatSpec.parse(data["anchor"], "anchor"))
    return out


def shipped_like(name) -> tuple | None:
    """(shipped name, read, anchor) of the shipped pair `name` reads as (`name_key`), or None."""
    return None if name is None else _shipped().get(name_key(name))


def _roles(read, anchor) -> str:
    return f"read {read or '(shared)'} and anchor {anchor}"


def check_name(name) -> None:
    """One ValueError unless `name` (of a pair or layer policy) is None or a non-empty string:
    results are keyed, labelled and filed by it (YAML reads `name: 123` as a number)."""
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise ValueError(f"name must be a non-empty string, got {name!r} (quote a name YAML "
                         f"reads as something else: name: '123')")


def check_shipped_name(name, read, anchor) -> None:
    """One ValueError when `name` reads as a shipped pair's (`name_key`) but the roles it names
    (read FormatSpec or None, anchor FormatSpec) are not what that pair stores: results are
    keyed and shown by name, and would show these formats under the shipped pair's."""
    ship = shipped_like(name)
    if ship is None or (read, anchor) == ship[1:]:
        return
    named = (f"named {name}, as a shipped pair," if name == ship[0] else
             f"named {name!r}, which reads as the shipped pair {ship[0]},")
    raise ValueError(f"the pair is {named} but holds {_roles(read, anchor)} where the shipped "
                     f"{ship[0]} holds {_roles(*ship[1:])}; results would show it under the "
                     f"shipped pair's name: give it another name (its name: line, or the file's "
                     f"name)")


_PAIR_KEYS = ("name", "read", "anchor", "buffer_len", "description")
_SPEC_KEYS = ("format", "rounding")


@dataclass(frozen=True)
class FormatSpec:
    """One storage role: a format name (see `replayquant.formats.FORMATS`) and a rounding mode."""

    format: str
    rounding: str = "nearest"

    def __post_init__(self):
        if not isinstance(self.format, str) or self.format not in FORMATS:
            raise ValueError(f"unknown format {self.format!r}; known formats: {', '.join(FORMATS)}")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"unknown rounding {self.rounding!r} for format {self.format}; "
                             f"use one of {', '.join(ROUNDINGS)}")

    @property
    def fmt(self) -> Format:
        return get_format(self.format)

    def bytes_per_element(self, d_k: int = 128, d_v: int = 128) -> float:
        """Physical bytes per state element of a d_v x d_k matrix (payload + scales)."""
        return self.fmt.bytes_per_element(d=d_k, rows=d_v)

    def __str__(self) -> str:
        return self.format + ("+sr" if self.rounding == "stochastic" else "")

    @classmethod
    def parse(cls, value, role: str = "format") -> "FormatSpec":
        """A FormatSpec from a FormatSpec, a dict {format, rounding} or a format name."""
        if isinstance(value, FormatSpec):
            return value
        if isinstance(value, str):
            return cls(value)
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(_SPEC_KEYS))
            if unknown:
                raise ValueError(f"{role}: unknown key(s) {unknown}; a role takes only "
                                 f"{', '.join(_SPEC_KEYS)}")
            if "format" not in value:
                raise ValueError(f"{role}: missing 'format' (one of {', '.join(FORMATS)})")
            return cls(value["format"], value.get("rounding", "nearest"))
        raise ValueError(f"{role}: expected a mapping {{format: ..., rounding: ...}}, a format "
                         f"name or a FormatSpec, got {type(value).__name__}")


@dataclass(frozen=True)
class PrecisionPair:
    """Anchor format, read-copy format (None: shared) and buffer length L."""

    read: FormatSpec | None
    anchor: FormatSpec
    buffer_len: int = 16
    name: str | None = None
    description: str = ""

    def __post_init__(self):
        object.__setattr__(self, "anchor", FormatSpec.parse(self.anchor, "anchor"))
        if self.read is not None:
            object.__setattr__(self, "read", FormatSpec.parse(self.read, "read"))
        bl = self.buffer_len
        if isinstance(bl, bool) or not isinstance(bl, int) or bl < 1:
            raise ValueError(f"buffer_len must be an integer >= 1, got {bl!r}")
        check_name(self.name)
        check_shipped_name(self.name, self.read, self.anchor)

    # -- roles
    @property
    def shared(self) -> bool:
        """True when one copy (the anchor) serves as both anchor and read copy."""
        return self.read is None

    @property
    def read_spec(self) -> FormatSpec:
        """The format that non-flush steps read: `read`, or the anchor for a shared pair."""
        return self.anchor if self.read is None else self.read

    # -- sizes
    def read_bytes(self, d_k: int = 128, d_v: int = 128) -> float:
        """Bytes per state element of the copy read at every non-flush step."""
        return self.read_spec.bytes_per_element(d_k, d_v)

    def anchor_bytes(self, d_k: int = 128, d_v: int = 128) -> float:
        return self.anchor.bytes_per_element(d_k, d_v)

    def state_bytes(self, d_k: int = 128, d_v: int = 128) -> float:
        """Bytes per state element held in memory: anchor, plus the read copy if not shared."""
        return self.anchor_bytes(d_k, d_v) + (0.0 if self.shared else self.read_bytes(d_k, d_v))

    def label(self) -> str:
        return self.name or f"{'shared' if self.shared else str(self.read)}/{self.anchor}/L{self.buffer_len}"

    def with_buffer_len(self, buffer_len: int) -> "PrecisionPair":
        return PrecisionPair(self.read, self.anchor, buffer_len, self.name, self.description)

    # -- YAML
    @classmethod
    def from_dict(cls, data, source: str = "pair") -> "PrecisionPair":
        check_mapping(data, _PAIR_KEYS, source, "a precision pair")
        if "anchor" not in data:
            raise ValueError(f"{source}: not a precision pair: missing 'anchor' "
                             f"(e.g. anchor: {{format: fp32, rounding: nearest}})")
        try:
            return cls(read=data.get("read"), anchor=data["anchor"],
                       buffer_len=data.get("buffer_len", 16), name=data.get("name"),
                       description=data.get("description", "") or "")
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    @classmethod
    def load(cls, name_or_path) -> "PrecisionPair":
        """Load a pair by name (a file in configs/pairs/) or from a YAML path (named by its
        name: line, else by the file's name). A name that reads as a shipped pair's
        (`name_key`: as tables tidy it, any case and punctuation) must store what the shipped
        pair stores (read and anchor formats and roundings; every PrecisionPair checks this,
        `check_shipped_name`): results are keyed by pair name, and would show other formats
        under the shipped name."""
        p = Path(name_or_path)
        if p.suffix not in (".yaml", ".yml") and not p.exists():
            p = PAIRS_DIR / f"{name_or_path}.yaml"
            if not p.is_file():
                raise ValueError(f"unknown precision pair {str(name_or_path)!r}; shipped pairs: "
                                 f"{', '.join(list_pairs())} (or pass a path to a .yaml file)")
        data = read_yaml(p, "precision pair file")
        if isinstance(data, dict) and data.get("name") is None:
            data = {**data, "name": p.stem}
        return cls.from_dict(data, source=str(p))

    def to_dict(self) -> dict:
        out = {"name": self.name}
        if self.read is not None:
            out["read"] = {"format": self.read.format, "rounding": self.read.rounding}
        out["anchor"] = {"format": self.anchor.format, "rounding": self.anchor.rounding}
        out["buffer_len"] = self.buffer_len
        return out


def list_pairs() -> list[str]:
    """Names of the pairs shipped in configs/pairs/."""
    return sorted(p.name[:-len(".yaml")] for p in PAIRS_DIR.iterdir() if p.name.endswith(".yaml"))


def pairs_table(d_k: int = 128, d_v: int = 128):
    """A rich Table of the shipped pairs with bytes per state element (d_v x d_k matrix)."""
    t = Table(title=f"precision pairs (B: bytes per state element, {d_v}x{d_k} state)")
    for col in ("name", "read", "anchor", "L", "read B", "anchor B", "held B"):
        t.add_column(col, justify="right" if " B" in col or col == "L" else "left", no_wrap=True)
    for name in list_pairs():
        p = PrecisionPair.load(name)
        t.add_row(name, "(shared)" if p.shared else str(p.read), str(p.anchor), str(p.buffer_len),
                  f"{p.read_bytes(d_k, d_v):.4g}", f"{p.anchor_bytes(d_k, d_v):.4g}",
                  f"{p.state_bytes(d_k, d_v):.4g}")
    return t

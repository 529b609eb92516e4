"""Layer policies: a precision pair per recurrent layer.

Layers of one model are not equally sensitive to state rounding (`replayquant sensitivity`
measures it per layer), so a policy gives each recurrent layer its own pair. It is YAML::

    name: mixed                      # optional; default: the file name without .yaml
    default: tp4_hi32                # the pair of every layer no override names
    buffer_len: 16                   # optional: L of every pair in the policy
    overrides:                       # optional, applied to the layers they name
      - layers: [0, 4]               # decoder layer indices (the layer's `layer_idx`)
        pair: tp8_hi32
      - match: "model.layers.1*.linear_attn"   # fnmatch pattern on the module's qualified name
        pair: {read: {format: fp8}, anchor: {format: fp32}, buffer_len: 8}

A pair is a shipped pair name (`replayquant pairs`), the path of a pair YAML (relative paths
from the policy's folder), an inline pair mapping, or `exact`: the layer keeps exact FP32 state,
computed as the KL reference computes it (the shared FP32 pair with prefill="exact"; its decode
steps are the FP32 recurrence). A policy is accepted wherever a pair is (`replayquant kl`,
`sweep`, `gpqa`, the lm-eval model's `pair=`, `replayquant.patch`, `load_model`).

Validation: the YAML's structure is checked when it is loaded (`LayerPolicy.load`), the layers
it names when it meets a model (`LayerPolicy.assign`): an index that is not a recurrent layer,
a pattern that matches none, and a layer that two overrides name are errors, each one
ValueError that says what to change.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from replayquant.pairs import PrecisionPair, check_mapping, check_name, read_yaml, shipped_like

__all__ = ["EXACT", "LayerPolicy", "Override", "is_policy_file", "quantized_layers", "resolve_pair",
           "check_recorded"]

EXACT = "exact"
_POLICY_KEYS = ("name", "default", "buffer_len", "overrides", "description")
_OVERRIDE_KEYS = ("layers", "match", "pair")


def _parse_pair(value, where: str, base: Path | None, loaded: dict | None = None):
    """A PrecisionPair or EXACT from a policy's pair entry; `loaded` keeps the pairs read from
    files by name or path, so that a policy naming one pair in many overrides reads it once."""
    if isinstance(value, PrecisionPair) or value == EXACT:
        return value
    if isinstance(value, dict):
        return PrecisionPair.from_dict(value, source=where)
    if isinstance(value, str) and value.strip():
        v = value.strip()
        p = Path(v)
        if p.suffix in (".yaml", ".yml") and not p.is_absolute() and base is not None:
            p = base / p
        key = str(p) if p.suffix in (".yaml", ".yml") else v
        if loaded is not None and key in loaded:
            return loaded[key]
        try:
            pair = PrecisionPair.load(key)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        if loaded is not None:
            loaded[key] = pair
        return pair
    raise ValueError(f"{where}: expected a pair name, a pair YAML path, an inline pair mapping or "
                     f"'{EXACT}', got {value!r}")


def _pair_dict(p):
    return EXACT if p == EXACT else p.to_dict()


def _pair_label(p) -> str:
    return EXACT if p == EXACT else p.label()


def _with_L(p, L):
    return p if p == EXACT else p.with_buffer_len(L)


@dataclass(frozen=True)
class Override:
    """One override: the layers it names (indices, or an fnmatch pattern on qualified names)."""
    pair: object                     # PrecisionPair or EXACT
    layers: tuple = ()
    match: str | None = None

    def names(self, name: str, index: int) -> bool:
        if self.match is not None:
            return fnmatch.fnmatchcase(name, self.match)
        return index in self.layers

    def describe(self) -> str:
        return (f"match {self.match!r}" if self.match is not None
                else f"layers {list(self.layers)}")

    def to_dict(self) -> dict:
        key = {"match": self.match} if self.match is not None else {"layers": list(self.layers)}
        return {**key, "pair": _pair_dict(self.pair)}


@dataclass(frozen=True)
class LayerPolicy:
    """A default pair (or EXACT) and overrides by layer index or name pattern."""
    default: object
    overrides: tuple = ()
    name: str | None = None
    description: str = ""

    def __post_init__(self):
        object.__setattr__(self, "default", _parse_pair(self.default, "policy default", None))
        object.__setattr__(self, "overrides", tuple(self.overrides))
        for i, o in enumerate(self.overrides):
            if not isinstance(o, Override):
                raise ValueError(f"policy override {i + 1}: expected an Override, got "
                                 f"{type(o).__name__}")
        check_name(self.name)
        self._check_name()

    def _check_name(self) -> None:
        """A policy whose name reads as a shipped pair's (`pairs.name_key`) holds that pair on
        every layer it does not keep exact (a sensitivity run's `tp4_hi16_sr@layer3`), else one
        ValueError: results would show the policy under the shipped pair's name."""
        ship = shipped_like(self.name)
        held = [p for p in self.pairs() if p != EXACT]
        if ship is None or (held and all((p.read, p.anchor) == ship[1:] for p in held)):
            return
        raise ValueError(f"the layer policy is named {self.name!r}, which reads as the shipped "
                         f"pair {ship[0]}, but holds {', '.join(map(_pair_label, self.pairs()))}; "
                         f"results would show it under the shipped pair's name: give it another "
                         f"name (its name: line, or the file's name)")

    # -- like a PrecisionPair, for the code that records or relabels pairs
    def label(self) -> str:
        if self.name:
            return self.name
        return f"policy({_pair_label(self.default)}, {len(self.overrides)} override(s))"

    def pairs(self) -> list:
        """Every distinct pair the policy names (default first)."""
        return list(dict.fromkeys([self.default] + [o.pair for o in self.overrides]))

    @property
    def buffer_len(self) -> int | None:
        """The L every pair of the policy holds, or None when they differ."""
        Ls = {p.buffer_len for p in self.pairs() if p != EXACT}
        return Ls.pop() if len(Ls) == 1 else None

    def with_buffer_len(self, buffer_len: int, name: str | None = None) -> "LayerPolicy":
        """The same policy with L = buffer_len in every pair."""
        return LayerPolicy(_with_L(self.default, buffer_len),
                           tuple(Override(_with_L(o.pair, buffer_len), o.layers, o.match)
                                 for o in self.overrides),
                           name if name is not None else self.name, self.description)

    def renamed(self, name: str) -> "LayerPolicy":
        return LayerPolicy(self.default, self.overrides, name, self.description)

    def to_dict(self) -> dict:
        out = {"name": self.name, "default": _pair_dict(self.default)}
        if self.overrides:
            out["overrides"] = [o.to_dict() for o in self.overrides]
        if self.description:
            out["description"] = self.description
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    # -- meeting a model
    def assign(self, layers) -> list:
        """The pair (PrecisionPair or EXACT) of each layer; `layers` are (qualified name, layer
        index) pairs (or longer tuples starting so, e.g. `recurrent_layers` rows with the
        module's layer_idx). Raises ValueError for an index that is not a recurrent layer, a
        pattern that matches none, or a layer that two overrides name."""
        rows = [(str(t[0]), int(t[1])) for t in layers]
        if not rows:
            raise ValueError(f"layer policy {self.label()!r}: the model has no recurrent layer")
        indices = [i for _, i in rows]
        known = ", ".join(f"{i} ({n})" for n, i in rows)
        for k, o in enumerate(self.overrides):
            hit = [n for n, i in rows if o.names(n, i)]
            if o.match is None:
                missing = [i for i in o.layers if i not in indices]
                if missing:
                    raise ValueError(f"layer policy {self.label()!r}: override {k + 1} ({o.describe()}) names "
                                     f"layer(s) {missing}, which are not recurrent layers of this "
                                     f"model; its recurrent layers are {known}")
            elif not hit:
                raise ValueError(f"layer policy {self.label()!r}: override {k + 1} ({o.describe()}) matches "
                                 f"no recurrent layer of this model; its recurrent layers are {known}")
        out = []
        for n, i in rows:
            hits = [k for k, o in enumerate(self.overrides) if o.names(n, i)]
            if len(hits) > 1:
                a, b = (self.overrides[h].describe() for h in hits[:2])
                raise ValueError(f"layer policy {self.label()!r}: layer {i} ({n}) is named by override "
                                 f"{hits[0] + 1} ({a}) and override {hits[1] + 1} ({b}); name each "
                                 f"layer in one override only")
            out.append(self.overrides[hits[0]].pair if hits else self.default)
        return out

    # -- YAML
    @classmethod
    def from_dict(cls, data, source: str = "policy", base: Path | None = None) -> "LayerPolicy":
        check_mapping(data, _POLICY_KEYS, source, "a layer policy",
                      hint=lambda unknown: " (a pair's keys: this file mixes a pair and a policy)"
                      if set(unknown) & {"anchor", "read"} else "")
        if "default" not in data:
            raise ValueError(f"{source}: missing 'default' (the pair of every layer no override "
                             f"names, e.g. default: tp4_hi32)")
        L = data.get("buffer_len")
        if L is not None and (isinstance(L, bool) or not isinstance(L, int) or L < 1):
            raise ValueError(f"{source}: buffer_len must be an integer >= 1, got {L!r}")
        loaded = {}
        default = _parse_pair(data["default"], f"{source}: default", base, loaded)
        raw = data.get("overrides") or []
        if not isinstance(raw, list):
            raise ValueError(f"{source}: overrides must be a list of mappings "
                             f"{{layers: [...] | match: PATTERN, pair: ...}}, got {type(raw).__name__}")
        overrides, seen = [], {}
        for k, o in enumerate(raw):
            where = f"{source}: override {k + 1}"
            check_mapping(o, _OVERRIDE_KEYS, where, "an override")
            if "pair" not in o:
                raise ValueError(f"{where}: missing 'pair'")
            if ("layers" in o) == ("match" in o):
                raise ValueError(f"{where}: give exactly one of 'layers' (indices) or 'match' "
                                 f"(a name pattern)")
            pair = _parse_pair(o["pair"], f"{where}: pair", base, loaded)
            if "match" in o:
                if not isinstance(o["match"], str) or not o["match"].strip():
                    raise ValueError(f"{where}: match must be a non-empty name pattern, got "
                                     f"{o['match']!r}")
                overrides.append(Override(pair, (), o["match"].strip()))
                continue
            idx = o["layers"]
            idx = [idx] if isinstance(idx, int) and not isinstance(idx, bool) else idx
            if not isinstance(idx, list) or not idx or any(
                    isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in idx):
                raise ValueError(f"{where}: layers must be a non-empty list of layer indices "
                                 f"(integers >= 0), got {o['layers']!r}")
            for i in idx:
                if i in seen:
                    raise ValueError(f"{where}: layer {i} is already named by override {seen[i]}; "
                                     f"name each layer once")
                seen[i] = k + 1
            overrides.append(Override(pair, tuple(idx), None))
        name = data.get("name")
        try:
            pol = cls(default, tuple(overrides), name, data.get("description", "") or "")
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None
        return pol if L is None else pol.with_buffer_len(L)

    @classmethod
    def load(cls, path) -> "LayerPolicy":
        """A policy from its YAML file, named by its name: line, else by the file's name."""
        p = Path(path)
        data = read_yaml(p, "layer policy file")
        if isinstance(data, dict) and data.get("name") is None:
            data = {**data, "name": p.stem}
        return cls.from_dict(data, source=str(p), base=p.parent)


def _held(record, where: str, name=None):
    """The pair or layer policy a results file's record holds (as `to_dict` wrote it: a mapping
    with an `anchor` role, or with a `default`), named `name` where given; None for anything
    else. A record that does not hold what its name says is one ValueError (`where: ...`)."""
    if not isinstance(record, dict):
        return None
    if name is not None:
        record = {**record, "name": name}
    if isinstance(record.get("anchor"), dict):
        return PrecisionPair.from_dict(record, source=where)
    if "default" in record and set(record) <= set(_POLICY_KEYS):
        return LayerPolicy.from_dict(record, source=where)
    return None


def check_recorded(obj, source, where: str = "") -> None:
    """Every pair and layer-policy record of a results file read back (`obj`, from `source`)
    holds what its name says: a record's own name, and the name or label it is filed under (a
    sweep's variant `tp4_hi16_sr@L16`, a GPQA summary's pair label), must not read as a shipped
    pair's unless the record stores that pair's formats (`pairs.check_shipped_name`). One
    ValueError naming the file and the record otherwise; results under a shipped name would show
    another pair's numbers."""
    if isinstance(obj, list):
        for i, x in enumerate(obj):
            check_recorded(x, source, f"{where}[{i}]")
        return
    if not isinstance(obj, dict):
        return
    at = f"{source}: {where or 'the file'}"
    if _held(obj, at) is not None:
        return
    label = obj.get("name", obj.get("label"))
    if isinstance(label, str):
        _held(obj.get("pair"), f"{at} ({label})", label)
    for k, v in obj.items():
        check_recorded(v, source, f"{where}.{k}" if where else str(k))


def quantized_layers(variant, layers) -> list[tuple]:
    """(layer, pair) for each of `layers` that `variant` quantizes: a pair quantizes every layer,
    a layer policy those it does not leave EXACT. `layers` have the layer's qualified `name` and
    `index` (`models.shapes.LayerShape`)."""
    if not isinstance(variant, LayerPolicy):
        return [(s, variant) for s in layers]
    pairs = variant.assign([(s.name, s.index) for s in layers])
    return [(s, p) for s, p in zip(layers, pairs) if p != EXACT]


def _yaml_mapping(p: Path):
    try:
        return read_yaml(p, "pair or layer policy file")
    except (OSError, ValueError):
        return None                 # loading it as a pair says what is wrong


def is_policy_file(spec) -> bool:
    """True for the path of a YAML file holding a layer policy (a mapping with `default` or
    `overrides`, which no pair has: loading it says what is missing)."""
    if not isinstance(spec, (str, Path)):
        return False
    p = Path(spec)
    if p.suffix not in (".yaml", ".yml") or not p.is_file():
        return False
    data = _yaml_mapping(p)
    return isinstance(data, dict) and bool({"default", "overrides"} & set(data))


def resolve_pair(spec, buffer_len=None, *, policy: bool = True):
    """The one place where what a user names as a pair becomes an object: a PrecisionPair (a
    shipped name, a pair YAML path, or a PrecisionPair) or, where `policy` allows one, a
    LayerPolicy (a layer policy YAML path, or a LayerPolicy). buffer_len (an int, or a string of
    one from a command line or lm-eval's model_args; None or "" keeps the pair's) overrides L of
    the pair, or of every pair of a policy. Everything below the edges (patching, the states,
    the stores, the KL and GPQA runs) takes the object. One ValueError for anything else, naming
    what to give."""
    what = ("a pair name (see `replayquant pairs`), a pair YAML path or a layer policy YAML path"
            if policy else "a pair name (see `replayquant pairs`) or a pair YAML path")
    kinds = (PrecisionPair, LayerPolicy) if policy else (PrecisionPair,)
    if isinstance(spec, kinds):
        pair = spec
    elif isinstance(spec, LayerPolicy):
        raise ValueError(f"layer policy {spec.label()}: a policy gives each layer of a model its "
                         f"pair; this takes one precision pair: give {what}")
    elif isinstance(spec, (str, Path)) and str(spec).strip():
        text = str(spec).strip()
        try:
            pair = LayerPolicy.load(text) if policy and is_policy_file(text) \
                else PrecisionPair.load(text)
        except (FileNotFoundError, KeyError, OSError) as e:
            raise ValueError(f"unknown precision pair {text!r} ({e}); give {what}") from None
        if not policy and isinstance(pair, LayerPolicy):
            raise ValueError(f"{text}: a layer policy; this takes one precision pair: give {what}")
    else:
        raise ValueError(f"pair {spec!r} ({type(spec).__name__}): give {what}")
    if buffer_len not in (None, ""):
        try:
            L = int(buffer_len)
        except (TypeError, ValueError):
            raise ValueError(f"buffer_len={buffer_len!r}: must be an integer >= 1") from None
        pair = _overridden(pair, L)
    return pair


def _overridden(pair, L: int):
    """`pair` (or policy) with L = `L`, named NAME@LL where that is not its own L, as a sweep names
    its variants, so every label (tables, `patch_info`, lm-eval's results) says what ran. An
    unnamed pair's label already holds its L."""
    if L == pair.buffer_len:
        return pair
    if isinstance(pair, LayerPolicy):             # each layer's pair says its L too
        def member(p):
            return p if p == EXACT else _overridden(p, L)
        return LayerPolicy(member(pair.default),
                           tuple(Override(member(o.pair), o.layers, o.match)
                                 for o in pair.overrides),
                           f"{re.sub(r'@L[0-9]+$', '', pair.label())}@L{L}", pair.description)
    name = pair.name and f"{re.sub(r'@L[0-9]+$', '', pair.name)}@L{L}"
    return PrecisionPair(pair.read, pair.anchor, L, name, pair.description)

"""Parse and validate Karta descriptions (``run.ai`` Karta and ``optimization.nvidia.com``
ResourceInterface) from files, folders and API objects.

A description is either fully valid or rejected with one precise error naming its source,
its name and the offending field path: a half-loaded description would attribute pods
wrongly, which is worse than not attributing them. Loading never raises for bad input in
files, so one broken document does not stop the others.
"""

from __future__ import annotations

import difflib
import io
import json
import logging
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from proxy.karta.files import folder_files
from proxy.karta.jqexpr import JqCompileError, JqExpr, to_text
from proxy.karta.model import (
    GVK,
    UPSTREAM_STATUS_ORDER,
    Component,
    ConditionMatch,
    Description,
    GroupKind,
    Matcher,
    PodSelector,
    ScaleDefinition,
    StatusDefinition,
    TypeSelector,
)
from proxy.karta.yamltext import Refused, iter_documents, yaml_error

log = logging.getLogger(__name__)

KARTA_GROUP = "run.ai"
KARTA_KIND = "Karta"
RI_GROUP = "optimization.nvidia.com"
RI_KIND = "ResourceInterface"
FORM_KARTA = "Karta"
FORM_RI = "ResourceInterface"

#: lowercase statusMappings key -> generic status name
STATUS_KEYS: dict[str, str] = {s.lower(): s for s in UPSTREAM_STATUS_ORDER}
#: files larger than this are refused: descriptions are a few KiB
MAX_FILE_BYTES = 8 * 1024 * 1024
FILE_SUFFIXES = (".yaml", ".yml", ".json")

#: a Kind as Kubernetes spells one: CamelCase, an uppercase letter first (``deployment``
#: matches no object's kind: descriptions match the kind case-sensitively, as the API)
_KIND_RE = re.compile(r"[A-Z][A-Za-z0-9]*\Z")
_GROUP_RE = re.compile(r"[a-z0-9]([a-z0-9.-]*[a-z0-9])?\Z")
_VERSION_RE = re.compile(r"[a-z0-9]+\Z")
_ROOT = "spec.structureDefinition.rootComponent"
_CHILDREN = "spec.structureDefinition.childComponents"
_SPEC_VARIANTS = ("podTemplateSpecPath", "podSpecPath", "fragmentedPodSpecDefinition")
#: the fields of each mapping of the CRDs (both forms; ``wm-run.ai_kartas.yaml``): a key
#: that is none of them but close to one is a misspelling (:func:`_misspelt`)
_GVK_FIELDS = frozenset(("group", "version", "kind"))
_COMPONENT_FIELDS = frozenset((
    "name", "kind", "ownerRef", "specDefinition", "scaleDefinition", "instanceIdPath",
    "podSelector", "statusDefinition", "suspendDefinition"))
_SPEC_FIELDS = frozenset((*_SPEC_VARIANTS, "metadataPath"))
_SCALE_FIELDS = frozenset(("replicasPath", "minReplicasPath", "maxReplicasPath"))
_SELECTOR_FIELDS = frozenset((
    "componentTypeSelector", "componentInstanceSelector", "replicaSelector"))
_TYPE_SELECTOR_FIELDS = frozenset(("keyPath", "value", "matchLabels"))
_STATUS_FIELDS = frozenset(("phaseDefinition", "conditionsDefinition", "statusMappings"))
_CONDITIONS_FIELDS = frozenset((
    "path", "typeFieldName", "statusFieldName", "messageFieldName", "reasonFieldName"))
_MATCHER_FIELDS = frozenset(("byPhase", "byConditions", "byExpression"))
_CONDITION_FIELDS = frozenset(("type", "status", "reason"))
_EXPRESSION_FIELDS = frozenset(("expression", "expectedResult"))


def _misspelt(key: Any, fields: frozenset[str]) -> str | None:
    """The field ``key`` most likely meant, when it is none of ``fields`` but a letter
    swapped, dropped, doubled or in another case away from one (``statusDefiniton``,
    ``instanceIDPath``, ``replicas`` for ``replicasPath``).

    Other unknown keys stay ignored, as upstream's newer fields are. A misspelt one was
    too, without a word: a ``statusDefiniton`` gave every workload of the kind the
    phase ``Undefined``, a ``podSelecter`` put every pod in the first component."""
    if not fields or not isinstance(key, str) or key in fields:
        return None
    folded = {f.casefold(): f for f in fields}
    if key.casefold() in folded:
        return folded[key.casefold()]
    close = difflib.get_close_matches(key, sorted(fields), n=1, cutoff=0.8)
    return close[0] if close else None

class DescriptionError(Exception):
    """One reason a description (or a file of them) was rejected.

    Also used as a plain value in error lists, so it compares and hashes by its fields.
    """

    def __init__(self, source: str, name: str, path: str, reason: str) -> None:
        super().__init__(source, name, path, reason)
        self.source = source
        self.name = name
        self.path = path
        self.reason = reason
        #: the root kind of the description object that failed, as written (None when
        #: unknown, or the error is no description's: not YAML, not a description); the
        #: engine treats that kind as described by an invalid description
        #: (``description_error``), whatever source it came from. Not part of equality.
        self.kind: GroupKind | None = None

    def __str__(self) -> str:
        where = f"{self.path}: " if self.path else ""
        return f"{self.source} ({self.name}): {where}{self.reason}"

    def __repr__(self) -> str:
        return (
            f"DescriptionError(source={self.source!r}, name={self.name!r}, "
            f"path={self.path!r}, reason={self.reason!r})"
        )

    def _key(self) -> tuple[str, str, str, str]:
        return (self.source, self.name, self.path, self.reason)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DescriptionError):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


def is_description_object(obj: Mapping[str, Any]) -> bool:
    """True for a ``run.ai/*`` Karta or an ``optimization.nvidia.com/*`` ResourceInterface."""
    if not isinstance(obj, Mapping):
        return False
    api_version = obj.get("apiVersion")
    kind = obj.get("kind")
    if not isinstance(api_version, str) or not isinstance(kind, str):
        return False
    group = api_version.partition("/")[0] if "/" in api_version else ""
    return (group == KARTA_GROUP and kind == KARTA_KIND) or (group == RI_GROUP and kind == RI_KIND)


class _Parser:
    """One description being parsed: carries source and name into every error."""

    def __init__(self, source: str, name: str) -> None:
        self.source = source
        self.name = name
        #: a Karta object read from the API server: its fields were checked against the
        #: CRD installed there, which may be newer than the proxy (a field it added
        #: within a letter of one the proxy knows is no typo)
        self.from_api = source.startswith("api:")

    def fail(self, path: str, reason: str) -> DescriptionError:
        return DescriptionError(self.source, self.name, path, reason)

    # -- typed field access -------------------------------------------------------------

    def mapping(self, value: Any, path: str, *, required: bool = False,
                fields: frozenset[str] = frozenset()) -> Mapping[str, Any]:
        """``value`` as a mapping; with ``fields`` (the CRD's fields there), a key that is
        none of them but a misspelling of one is refused (:func:`_misspelt`)."""
        if value is None:
            if required:
                raise self.fail(path, "required")
            return {}
        if not isinstance(value, Mapping):
            raise self.fail(path, f"must be a mapping, got {_type_name(value)}")
        for key in value:
            meant = _misspelt(key, fields)
            if meant is None:
                continue
            if self.from_api:
                log.warning("description %s (%s): unknown field %s%s, ignored (did you mean "
                            "%r? the CRD installed may be newer than this proxy)", self.name,
                            self.source, path, _field(key), meant)
                continue
            raise self.fail(f"{path}{_field(key)}", f"unknown field {key!r}: did you "
                            f"mean {meant!r}? (a field the proxy does not know is "
                            "ignored, so a misspelt one would leave its part out)")
        return value

    def sequence(self, value: Any, path: str) -> Sequence[Any]:
        if value is None:
            return ()
        if isinstance(value, str | bytes) or not isinstance(value, Sequence):
            raise self.fail(path, f"must be a list, got {_type_name(value)}")
        return value

    def string(self, value: Any, path: str, *, required: bool = False) -> str | None:
        if value is None:
            if required:
                raise self.fail(path, "required")
            return None
        if not isinstance(value, str):
            raise self.fail(path, f"must be a string, got {_type_name(value)}")
        if required and not value:
            raise self.fail(path, "must not be empty")
        return value

    def section_jq(self, m: Mapping[str, Any], section: str, key: str,
                   path: str) -> JqExpr | None:
        """The jq field ``key`` of an optional section (``componentInstanceSelector``,
        ``replicaSelector``, ``phaseDefinition``): None without the section, required in
        it."""
        if m.get(section) is None:
            return None
        p = f"{path}.{section}"
        section_map = self.mapping(m[section], p, fields=frozenset((key,)))
        return self.jq(section_map.get(key), f"{p}.{key}", required=True)

    def jq(self, value: Any, path: str, *, required: bool = False) -> JqExpr | None:
        """Compile one jq field. Bare numbers are accepted as the literal they spell."""
        if isinstance(value, int | float) and not isinstance(value, bool):
            value = to_text(value)
        text = self.string(value, path, required=required)
        if text is None:
            return None
        if not text.strip():
            raise self.fail(path, "empty jq expression")
        banned = unsafe_jq_name(text)
        if banned is not None:
            raise self.fail(
                path, f"jq {banned!r} is not allowed in descriptions ({_BANNED[banned]})"
            )
        try:
            return _compile(text)
        except JqCompileError as exc:
            raise self.fail(path, _short(str(exc.__cause__ or exc))) from None

    # -- structure ----------------------------------------------------------------------

    def gvk(self, value: Any, path: str) -> GVK:
        m = self.mapping(value, path, required=True, fields=_GVK_FIELDS)
        group = self.string(m.get("group"), f"{path}.group") or ""
        version = self.string(m.get("version"), f"{path}.version", required=True)
        kind = self.string(m.get("kind"), f"{path}.kind", required=True)
        assert version is not None and kind is not None
        if not _KIND_RE.match(kind):
            hint = ""
            if re.fullmatch(r"[a-z][A-Za-z0-9]*", kind):
                camel = kind[0].upper() + kind[1:]
                hint = f" (kinds are CamelCase, an uppercase letter first: {camel!r}?)"
            raise self.fail(f"{path}.kind",
                            f"not a Kubernetes kind: {_short(repr(kind), 80)}{hint}")
        if group and not _GROUP_RE.match(group):
            raise self.fail(f"{path}.group", f"not an API group: {_short(repr(group), 80)}")
        if not _VERSION_RE.match(version):
            raise self.fail(f"{path}.version", f"not an API version: {_short(repr(version), 80)}")
        return GVK(group, version, kind)

    def component(self, raw: Any, path: str, *, root: bool) -> Component:
        m = self.mapping(raw, path, required=True, fields=_COMPONENT_FIELDS)
        name = self.string(m.get("name"), f"{path}.name", required=True)
        assert name is not None
        kind = None
        if root or m.get("kind") is not None:  # a child without a kind groups others
            kind = self.gvk(m.get("kind"), f"{path}.kind")
        owner_ref = self.string(m.get("ownerRef"), f"{path}.ownerRef")
        if root and owner_ref:
            raise self.fail(f"{path}.ownerRef", "the root component has no owner")
        pod_bearing = self.spec_definition(m.get("specDefinition"), f"{path}.specDefinition")
        scale = self.scale(m.get("scaleDefinition"), f"{path}.scaleDefinition")
        instance_id_path = self.jq(m.get("instanceIdPath"), f"{path}.instanceIdPath")
        pod_selector = self.pod_selector(m.get("podSelector"), f"{path}.podSelector")
        has_instance_selector = (
            pod_selector is not None and pod_selector.instance_id_path is not None
        )
        if instance_id_path is not None and not has_instance_selector:
            raise self.fail(
                f"{path}.instanceIdPath",
                "instanceIdPath needs podSelector.componentInstanceSelector",
            )
        if has_instance_selector and instance_id_path is None:
            raise self.fail(
                f"{path}.podSelector.componentInstanceSelector",
                "componentInstanceSelector needs instanceIdPath",
            )
        return Component(
            name=name,
            kind=kind,
            owner_ref=owner_ref or None,
            pod_bearing=pod_bearing,
            scale=scale,
            instance_id_path=instance_id_path,
            pod_selector=pod_selector,
        )

    def spec_definition(self, raw: Any, path: str) -> bool:
        """Validate the pod spec paths; the engine only needs to know one is present."""
        m = self.mapping(raw, path, fields=_SPEC_FIELDS)
        present = [v for v in _SPEC_VARIANTS if m.get(v) is not None]
        if len(present) > 1:
            raise self.fail(path, f"only one of {', '.join(_SPEC_VARIANTS)} may be set")
        self.jq(m.get("podTemplateSpecPath"), f"{path}.podTemplateSpecPath")
        self.jq(m.get("podSpecPath"), f"{path}.podSpecPath")
        if self.jq(m.get("metadataPath"), f"{path}.metadataPath") is not None and (
            m.get("podSpecPath") is None
        ):
            raise self.fail(f"{path}.metadataPath", "metadataPath is used only with podSpecPath")
        frag_path = f"{path}.fragmentedPodSpecDefinition"
        fragmented = self.mapping(m.get("fragmentedPodSpecDefinition"), frag_path)
        for key, value in fragmented.items():
            if isinstance(key, str) and key.endswith("Path"):  # other fields: not ours
                self.jq(value, f"{frag_path}{_field(key)}")
        return bool(present)

    def scale(self, raw: Any, path: str) -> ScaleDefinition | None:
        m = self.mapping(raw, path, fields=_SCALE_FIELDS)
        if not m:
            return None
        return ScaleDefinition(
            replicas=self.jq(m.get("replicasPath"), f"{path}.replicasPath"),
            min_replicas=self.jq(m.get("minReplicasPath"), f"{path}.minReplicasPath"),
            max_replicas=self.jq(m.get("maxReplicasPath"), f"{path}.maxReplicasPath"),
        )

    def pod_selector(self, raw: Any, path: str) -> PodSelector | None:
        m = self.mapping(raw, path, fields=_SELECTOR_FIELDS)
        if not m:
            return None
        type_selector = None
        if m.get("componentTypeSelector") is not None:
            type_selector = self.type_selector(
                m["componentTypeSelector"], f"{path}.componentTypeSelector"
            )
        instance_id_path = self.section_jq(m, "componentInstanceSelector", "idPath", path)
        replica_key_path = self.section_jq(m, "replicaSelector", "keyPath", path)
        if type_selector is None and instance_id_path is None and replica_key_path is None:
            return None
        return PodSelector(
            type_selector=type_selector,
            instance_id_path=instance_id_path,
            replica_key_path=replica_key_path,
        )

    def type_selector(self, raw: Any, path: str) -> TypeSelector:
        m = self.mapping(raw, path, fields=_TYPE_SELECTOR_FIELDS)
        key_path = self.jq(m.get("keyPath"), f"{path}.keyPath")
        value = m.get("value")
        if isinstance(value, int | float) and not isinstance(value, bool):
            value = to_text(value)  # YAML `value: 0` means the label text "0"
        value = self.string(value, f"{path}.value")
        labels_raw = self.mapping(m.get("matchLabels"), f"{path}.matchLabels")
        labels: list[tuple[str, str]] = []
        for key, label_value in labels_raw.items():
            if not isinstance(key, str) or not isinstance(label_value, str):
                raise self.fail(
                    f"{path}.matchLabels",
                    f"label {key!r}: keys and values must be strings",
                )
            labels.append((key, label_value))
        if key_path is None and not labels:
            raise self.fail(path, "needs keyPath or matchLabels")
        if value is not None and key_path is None:
            raise self.fail(f"{path}.value", "value needs keyPath")
        return TypeSelector(key_path=key_path, value=value, match_labels=tuple(sorted(labels)))

    def status(self, raw: Any, path: str) -> StatusDefinition | None:
        if raw is None:
            return None
        m = self.mapping(raw, path, fields=_STATUS_FIELDS)
        phase_path = self.section_jq(m, "phaseDefinition", "path", path)
        conditions_path = None
        fields: dict[str, str] = {}
        if m.get("conditionsDefinition") is not None:
            p = f"{path}.conditionsDefinition"
            cond = self.mapping(m["conditionsDefinition"], p, fields=_CONDITIONS_FIELDS)
            conditions_path = self.jq(cond.get("path"), f"{p}.path", required=True)
            for key, attr in (
                ("typeFieldName", "type_field"),
                ("statusFieldName", "status_field"),
                ("messageFieldName", None),  # checked, not kept: no matcher reads a message
                ("reasonFieldName", "reason_field"),
            ):
                value = self.string(cond.get(key), f"{p}.{key}")
                if value and attr is not None:  # null or "" -> the CRD default
                    fields[attr] = value
        mappings_path = f"{path}.statusMappings"
        raw_mappings = self.mapping(m.get("statusMappings"), mappings_path, required=True)
        mappings: dict[str, tuple[Matcher, ...]] = {}
        for key, matchers_raw in raw_mappings.items():
            key_path = f"{mappings_path}{_field(key)}"
            generic = STATUS_KEYS.get(key) if isinstance(key, str) else None
            if generic is None:
                raise self.fail(
                    key_path,
                    f"unknown status {key!r} (expected one of {', '.join(STATUS_KEYS)})",
                )
            matchers = self.sequence(matchers_raw, key_path)
            mappings[generic] = tuple(
                self.matcher(item, f"{key_path}[{i}]") for i, item in enumerate(matchers)
            )
        ordered = tuple((s, mappings[s]) for s in UPSTREAM_STATUS_ORDER if s in mappings)
        return StatusDefinition(
            phase_path=phase_path, conditions_path=conditions_path, mappings=ordered, **fields
        )

    def matcher(self, raw: Any, path: str) -> Matcher:
        m = self.mapping(raw, path, fields=_MATCHER_FIELDS)
        # "" is not given: upstream (Go) cannot tell an empty string from an absent one,
        # so a matcher with ``byPhase: ""`` matches any phase there, not only ""
        by_phase = _given(self.string(m.get("byPhase"), f"{path}.byPhase"))
        conditions: list[ConditionMatch] = []
        for i, item in enumerate(self.sequence(m.get("byConditions"), f"{path}.byConditions")):
            p = f"{path}.byConditions[{i}]"
            c = self.mapping(item, p, required=True, fields=_CONDITION_FIELDS)
            ctype = self.string(c.get("type"), f"{p}.type", required=True)
            assert ctype is not None
            conditions.append(
                ConditionMatch(
                    type=ctype,
                    status=_given(self.condition_status(c.get("status"), f"{p}.status")),
                    reason=_given(self.string(c.get("reason"), f"{p}.reason")),
                )
            )
        expression = None
        expected = None
        if m.get("byExpression") is not None:
            p = f"{path}.byExpression"
            e = self.mapping(m["byExpression"], p, fields=_EXPRESSION_FIELDS)
            expression = self.jq(e.get("expression"), f"{p}.expression", required=True)
            expected = self.scalar_text(e.get("expectedResult"), f"{p}.expectedResult")
            if expected is None:
                raise self.fail(f"{p}.expectedResult", "required")
        return Matcher(
            by_phase=by_phase,
            by_conditions=tuple(conditions),
            by_expression=expression,
            expected_result=expected,
        )

    def condition_status(self, value: Any, path: str) -> str | None:
        """A condition's status as the API spells it: an unquoted YAML ``True`` or
        ``False`` (a boolean) means "True" or "False" (read as jq's ``tostring``, "true",
        it could never match a condition); anything else as :meth:`scalar_text`."""
        if isinstance(value, bool):
            return "True" if value else "False"
        return self.scalar_text(value, path)

    def scalar_text(self, value: Any, path: str) -> str | None:
        """Strings as they are; an unquoted YAML ``true`` or ``1`` as jq's ``tostring``."""
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, bool | int | float):
            return to_text(value)
        raise self.fail(path, f"must be a string, got {_type_name(value)}")


_UNBOUNDED = "may never end"
_OUTSIDE = "reads outside the object"
_GROWS = "its cost can grow without bound"
_QUADRATIC = "costs the square of the object's depth"
#: jq names a description may not use: evaluation runs in the engine's thread, and libjq
#: can be neither interrupted nor bounded there, so an expression that never ends (or
#: exhausts memory: libjq then aborts the process) would stop attribution for the whole
#: cluster, and one reading the environment could leak it into label values. None of
#: them is needed to read fields of one object (no sample or built-in uses one); ``..``
#: and ``limit`` remain available. A scan of names narrows the ways a description can
#: cost without bound, it does not close them (docs/karta.md, "What bounds an
#: expression": the sandbox child bounds them in the proxy): descriptions are code the
#: proxy runs.
_BANNED: dict[str, str] = {
    "def": "recursive definitions " + _UNBOUNDED,
    # loops: a state doubled per step of a generator as long as a string ("ab"; .+.)
    # exhausted the memory (libjq aborts the process), a count over two 1e5-long ones
    # stalled the engine for seconds per event (an audit's bypasses of the list below)
    "reduce": "a loop whose state can grow without bound",
    "foreach": "a loop whose state can grow without bound",
    "explode": "makes a generator as long as a string (" + _GROWS + ")",
    "implode": "builds strings from code points (" + _GROWS + ")",
    "fromjson": "builds values, 10,000 levels deep, from text an object's author wrote",
    "path": "path(..) " + _QUADRATIC,
    "paths": _QUADRATIC,
    "leaf_paths": _QUADRATIC,
    "tostream": _QUADRATIC,
    "fromstream": "builds values from a stream of paths (" + _GROWS + ")",
    "*": "a string literal beside '*' is string repetition, which builds a string of any "
         "length; '*' multiplies numbers",
    "recurse": _UNBOUNDED + " (use ..)",
    "repeat": _UNBOUNDED,
    "while": _UNBOUNDED,
    "until": _UNBOUNDED,
    "range": "can generate without bound",
    "combinations": "grows exponentially",
    "env": _OUTSIDE,
    "$ENV": _OUTSIDE,
    "input": _OUTSIDE,
    "inputs": _OUTSIDE,
    "import": _OUTSIDE,
    "include": _OUTSIDE,
    "get_search_list": _OUTSIDE,
    "input_filename": _OUTSIDE,
    "debug": "writes to stderr",
    "stderr": "writes to stderr",
    "halt": "stops the program",
    "halt_error": "stops the program",
}
_IDENT_START = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_$")
_IDENT_CHARS = _IDENT_START | frozenset("0123456789:")


def unsafe_jq_name(source: str) -> str | None:
    """The first banned name used as code in a jq program (not a field, key or string).

    A small scanner rather than a regex: string literals may hold code again through
    ``\\(...)`` interpolation, and ``.range`` or ``"range"`` are harmless.
    """
    # stack of open interpolation depths; each entry is the paren depth inside it
    interp: list[int] = []
    in_string = False
    i, n = 0, len(source)
    while i < n:
        c = source[i]
        if in_string:
            if c == "\\" and i + 1 < n:
                if source[i + 1] == "(":
                    interp.append(0)
                    in_string = False
                i += 2
                continue
            if c == '"':
                in_string = False
            i += 1
            continue
        if c == '"':
            in_string = True
        elif c == "#":
            while i < n and source[i] != "\n":
                i += 1
            continue
        elif c == "(" and interp:
            interp[-1] += 1
        elif c == ")" and interp:
            if interp[-1] == 0:
                interp.pop()
                in_string = True
            else:
                interp[-1] -= 1
        elif c == "*" and _beside_string(source, i):
            return "*"
        elif c in _IDENT_START:
            j = i + 1
            while j < n and source[j] in _IDENT_CHARS:
                j += 1
            word = source[i:j]
            prev = source[i - 1] if i else ""
            if prev != "." and (word in _BANNED) and (not word.startswith("$") or word == "$ENV"):
                return word
            i = j
            continue
        i += 1
    return None


def _beside_string(source: str, i: int) -> bool:
    """Whether the ``*`` (or ``*=``) at ``i``, in code, has a string literal on either side
    (``"x" * 1e7``, ``.a *= "x"``, a format string ``@text "x"`` too): the first thing
    before it ends a string (a ``"`` in code closes one), or the first after it opens one.
    A string reaching ``*`` otherwise (``("x")``, a field, a variable) is not seen."""
    k = i - 1
    while k >= 0 and source[k].isspace():
        k -= 1
    if k >= 0 and source[k] == '"':
        return True
    k = i + 1
    if source[k : k + 1] == "=":
        k += 1
    n = len(source)
    while k < n and source[k].isspace():
        k += 1
    if source[k : k + 1] == "@":  # a format: @text "..."
        k += 1
        while k < n and (source[k].isalnum() or source[k] == "_"):
            k += 1
        while k < n and source[k].isspace():
            k += 1
    return source[k : k + 1] == '"'


def _given(value: str | None) -> str | None:
    """A matcher field as upstream reads it: "" is the same as absent."""
    return value or None


@lru_cache(maxsize=4096)
def _compile(text: str) -> JqExpr:
    """libjq spends ~5 ms compiling its builtins with every program; descriptions repeat
    expressions (and API descriptions are re-parsed on every watch event), so compiled
    programs are shared. A ``JqExpr`` holds no per-evaluation state."""
    return JqExpr(text)


def _field(key: Any) -> str:
    """A mapping key as a path step: ``.name``, or ``["odd key"]`` when it is not plain."""
    if isinstance(key, str) and key.isidentifier():
        return f".{key}"
    return f"[{json.dumps(key if isinstance(key, str) else str(key))}]"


def _type_name(value: Any) -> str:
    if isinstance(value, Mapping):
        return "mapping"
    if isinstance(value, list | tuple):
        return "list"
    if value is None:
        return "null"
    return type(value).__name__


def _short(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _plain_name(name: str) -> bool:
    return 0 < len(name) <= 253 and all(c.isprintable() and not c.isspace() for c in name)


def _derived_name(form: str, root_kind: Any) -> str:
    """A stable name for a description without ``metadata.name`` (file-only samples)."""
    prefix = "ri" if form == FORM_RI else "karta"
    if isinstance(root_kind, Mapping):
        kind = root_kind.get("kind")
        group = root_kind.get("group")
        if isinstance(kind, str) and kind:
            suffix = f".{group}" if isinstance(group, str) and group else ""
            return f"{prefix}-{kind.lower()}{suffix}"
    return ""


def _find_root_kind(obj: Mapping[str, Any]) -> Any:
    spec = obj.get("spec")
    structure = spec.get("structureDefinition") if isinstance(spec, Mapping) else None
    root = structure.get("rootComponent") if isinstance(structure, Mapping) else None
    return root.get("kind") if isinstance(root, Mapping) else None


def parse_description(obj: Mapping[str, Any], source: str, *, builtin: bool = False) -> Description:
    """Parse one description object; raises ``DescriptionError`` on the first problem,
    carrying the object's root kind as written (``DescriptionError.kind``) when it is a
    description object."""
    try:
        return _parse_description(obj, source, builtin)
    except DescriptionError as exc:
        if is_description_object(obj):
            exc.kind = raw_root_kind(obj)
        raise


def raw_root_kind(obj: Mapping[str, Any]) -> GroupKind | None:
    """Best-effort root kind of a description object that may not parse."""
    k = _find_root_kind(obj)
    if not isinstance(k, Mapping):
        return None
    group, kind = k.get("group") or "", k.get("kind")
    if isinstance(group, str) and isinstance(kind, str) and kind:
        return GroupKind(group, kind)
    return None


def _parse_description(obj: Mapping[str, Any], source: str, builtin: bool) -> Description:
    if not isinstance(obj, Mapping):
        several = (" (several descriptions go in documents separated by ---, or in the "
                   "items of a kind: List)" if isinstance(obj, list) else "")
        raise DescriptionError(source, "", "", f"not a mapping but {_type_name(obj)}{several}")
    if not is_description_object(obj):
        raise DescriptionError(
            source,
            "",
            "",
            f"not a description: apiVersion {obj.get('apiVersion')!r} kind {obj.get('kind')!r}"
            f" (expected {KARTA_GROUP}/* {KARTA_KIND} or {RI_GROUP}/* {RI_KIND})",
        )
    form = FORM_KARTA if obj.get("kind") == KARTA_KIND else FORM_RI
    metadata = obj.get("metadata")
    given = metadata.get("name") if isinstance(metadata, Mapping) else None
    derived = _derived_name(form, _find_root_kind(obj))
    name = given if isinstance(given, str) and _plain_name(given) else derived
    p = _Parser(source, name)
    if metadata is not None and not isinstance(metadata, Mapping):
        raise p.fail("metadata", f"must be a mapping, got {_type_name(metadata)}")
    if given is not None and given != "" and name != given:
        # the name ends up in errors, logs and facts: one printable token
        raise p.fail(
            "metadata.name", f"must be a name without spaces, got {_short(repr(given), 80)}"
        )
    if not _plain_name(name):
        name = p.name = ""  # the root kind is no usable name either; its own check will say why
    spec = p.mapping(obj.get("spec"), "spec", required=True,
                     fields=frozenset(("structureDefinition", "optimizationInstructions")))
    structure = p.mapping(
        spec.get("structureDefinition"), "spec.structureDefinition", required=True,
        fields=frozenset(("rootComponent", "childComponents", "additionalChildKinds")),
    )
    if structure.get("rootComponent") is None:
        raise p.fail(_ROOT, "required")
    root = p.component(structure.get("rootComponent"), _ROOT, root=True)
    root_raw = structure["rootComponent"]
    status = p.status(root_raw.get("statusDefinition"), f"{_ROOT}.statusDefinition")

    children: list[Component] = []
    positions: dict[str, str] = {root.name: _ROOT}
    for i, raw in enumerate(p.sequence(structure.get("childComponents"), _CHILDREN)):
        path = f"{_CHILDREN}[{i}]"
        child = p.component(raw, path, root=False)
        if child.name in positions:
            raise p.fail(
                f"{path}.name",
                f"duplicate component name {child.name!r} (also at {positions[child.name]})",
            )
        positions[child.name] = path
        children.append(child)
    _check_owner_refs(p, root, children)
    # a child without ownerRef hangs under the root: say so, so no reader has to know
    children = [c if c.owner_ref else replace(c, owner_ref=root.name) for c in children]

    additional: list[GVK] = []
    add_path = "spec.structureDefinition.additionalChildKinds"
    for i, raw in enumerate(p.sequence(structure.get("additionalChildKinds"), add_path)):
        additional.append(p.gvk(raw, f"{add_path}[{i}]"))

    pod_components = tuple(c for c in (root, *children) if c.pod_bearing)
    return Description(
        name=name,
        source=source,
        form=form,
        root=root,
        children=tuple(children),
        additional_child_kinds=tuple(additional),
        status=status,
        builtin=builtin,
        pod_components=pod_components,
    )


def _check_owner_refs(p: _Parser, root: Component, children: Sequence[Component]) -> None:
    """Every child hangs under the root through known names, without cycles.

    A child without ``ownerRef`` hangs directly under the root (the CRD allows leaving it
    out; the root is the only sensible parent).
    """
    parent: dict[str, str] = {}
    index = {c.name: i for i, c in enumerate(children)}
    for i, child in enumerate(children):
        ref = child.owner_ref if child.owner_ref is not None else root.name
        if ref != root.name and ref not in index:
            raise p.fail(
                f"{_CHILDREN}[{i}].ownerRef",
                f"unknown component {ref!r}",
            )
        parent[child.name] = ref
    for i, child in enumerate(children):
        chain = [child.name]
        seen = {child.name}
        current = parent[child.name]
        while current != root.name:
            chain.append(current)
            if current in seen:
                raise p.fail(
                    f"{_CHILDREN}[{i}].ownerRef",
                    f"ownerRef cycle: {' -> '.join(chain)}",
                )
            seen.add(current)
            current = parent[current]


# -- files ---------------------------------------------------------------------------------


def _documents(obj: Any) -> Iterator[tuple[str, Any]]:
    """Flatten Kubernetes ``List`` objects (``kind: List`` or ``<Kind>List``)."""
    if (
        isinstance(obj, Mapping)
        and isinstance(obj.get("kind"), str)
        and obj["kind"].endswith("List")
        and isinstance(obj.get("items"), list)
    ):
        for i, item in enumerate(obj["items"]):
            yield f"items[{i}]", item
    else:
        yield "", obj


def load_description_file(path: str | Path) -> tuple[list[Description], list[DescriptionError]]:
    """Every description in one YAML (multi-document) or JSON file; never raises.

    YAML is read as Kubernetes reads it (``proxy.karta.yamltext``): timestamps are
    strings, and a document with an alias or a key given twice is reported (the field
    path, the line) and skipped. Documents before a YAML syntax error are kept; the error
    is reported once.
    Documents that are not descriptions are reported too: a description folder should
    hold only descriptions.
    """
    descs, errors, _ = _load_file(path)
    return descs, errors


def _load_file(path: str | Path) -> tuple[list[Description], list[DescriptionError], bool]:
    """:func:`load_description_file`, and whether the file is empty (nothing but
    whitespace): what a save caught midway, or ``> file``, leaves (see
    :func:`read_description_paths`)."""
    source = str(path)
    descs: list[Description] = []
    errors: list[DescriptionError] = []
    try:
        p = Path(path)
        size = p.stat().st_size
        if size > MAX_FILE_BYTES:
            return [], [
                DescriptionError(source, "", "", f"file too large ({size} > {MAX_FILE_BYTES})")
            ], False
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return [], [DescriptionError(source, "", "", f"cannot read: {_short(str(exc))}")], False
    if not text.strip():
        return [], [], True

    docs: list[Any] = []
    if p.suffix.lower() == ".json":
        try:
            docs.append(json.loads(text))
        except ValueError as exc:
            return [], [DescriptionError(source, "", "", f"invalid JSON: {_short(str(exc))}")
                        ], False
    else:
        try:  # as Kubernetes reads YAML: timestamps as strings, no alias, no key twice
            for part in iter_documents(io.StringIO(text)):
                if isinstance(part, Refused):  # that document only
                    errors.append(DescriptionError(source, "", part.path, part.reason))
                else:
                    docs.append(part.value)
        except yaml.YAMLError as exc:
            errors.append(DescriptionError(source, "", "", yaml_error(exc)))
        except RecursionError:
            errors.append(DescriptionError(source, "", "", "invalid YAML: nested too deeply"))

    for doc in docs:
        if doc is None:
            continue  # an empty document (e.g. a trailing ---)
        for where, item in _documents(doc):
            try:
                descs.append(parse_description(item, source))
            except DescriptionError as exc:
                if where and not exc.path.startswith(where):
                    exc.path = f"{where}.{exc.path}" if exc.path else where
                errors.append(exc)
            except RecursionError:
                errors.append(DescriptionError(source, "", where, "nested too deeply"))
    return descs, errors, False


@dataclass
class DescriptionFiles:
    """Description paths as read, file by file: what a later read keeps from this one
    for a file it finds empty (:func:`read_description_paths`)."""

    #: the valid descriptions of each file read, in the order read (a file found empty
    #: holds those kept from the previous read)
    by_file: dict[str, list[Description]] = field(default_factory=dict)
    errors: list[DescriptionError] = field(default_factory=list)
    #: the files found empty, each with how many descriptions of the previous read it
    #: keeps (0: it had none, or there was no previous read)
    empty: dict[str, int] = field(default_factory=dict)
    #: by folder given, the files below it not read for their names (no ``.yaml``,
    #: ``.yml`` or ``.json``: a ConfigMap key named ``raycluster`` is such a file), for the
    #: log to say: they were passed over without a word
    unread: dict[str, list[str]] = field(default_factory=dict)

    def descriptions(self) -> list[Description]:
        return [d for descs in self.by_file.values() for d in descs]

    def kept(self) -> list[str]:
        """The files found empty that keep the previous read's descriptions."""
        return [f for f, n in self.empty.items() if n]


def read_description_paths(
    paths: Iterable[str | Path], previous: DescriptionFiles | None = None,
) -> DescriptionFiles:
    """Files, or folders of ``*.yaml``, ``*.yml``, ``*.json`` (recursively, sorted; hidden
    files and folders left out, as a mounted ConfigMap's ``..data``: see ``folder_files``).

    A file found empty (nothing but whitespace) keeps the descriptions ``previous`` read
    from it: a save caught between the truncation and the write, or ``> file``, dropped
    them at a reload otherwise, and the kinds they described fell back to the built-in
    descriptions or to none (as an emptied snapshot file keeps its objects). Removing a
    file, or leaving anything but whitespace in it (a comment), is how its descriptions
    are taken away. A folder (the path, or one below it that is not hidden) that cannot
    be listed is an error: read as holding nothing, its descriptions were dropped."""
    out = DescriptionFiles()
    for entry in paths:
        p = Path(entry)
        if p.is_dir():
            try:
                found = folder_files(p)
            except OSError as exc:
                where = f" {exc.filename}" if exc.filename is not None else ""
                out.errors.append(DescriptionError(
                    str(entry), "", "",
                    f"cannot read the folder{where}: {exc.strerror or _short(str(exc))}"))
                continue
            files = [f for f in found if f.suffix.lower() in FILE_SUFFIXES]
            unread = [str(f) for f in found if f.suffix.lower() not in FILE_SUFFIXES]
            if unread:
                out.unread[str(entry)] = unread
        elif p.exists():
            files = [p]
        else:
            out.errors.append(DescriptionError(str(entry), "", "", "no such file or folder"))
            continue
        for f in files:
            d, e, empty = _load_file(f)
            source = str(f)
            if empty:
                kept = previous.by_file.get(source, []) if previous is not None else []
                out.empty[source] = len(kept)
                d = list(kept)
            out.by_file.setdefault(source, []).extend(d)
            out.errors.extend(e)
    return out


def load_description_paths(
    paths: Iterable[str | Path],
) -> tuple[list[Description], list[DescriptionError]]:
    """:func:`read_description_paths` without a previous read: the descriptions and the
    errors."""
    read = read_description_paths(paths)
    return read.descriptions(), read.errors


# -- which description wins ------------------------------------------------------------------


def _rank(desc: Description) -> tuple[bool, bool, str, str]:
    """Lower wins: a user description, then the Karta form, then the name, then source."""
    return (desc.builtin, desc.form != FORM_KARTA, desc.name, desc.source)


def select_descriptions(
    descs: Iterable[Description],
) -> tuple[dict[GroupKind, Description], list[DescriptionError]]:
    """One description per GroupKind (versions are ignored, as for owners).

    A user description silently replaces a built-in one: that is what overriding means.
    Every other loser is reported, naming the winner.
    """
    by_kind: dict[GroupKind, list[Description]] = {}
    for d in descs:
        by_kind.setdefault(d.group_kind, []).append(d)
    winners: dict[GroupKind, Description] = {}
    errors: list[DescriptionError] = []
    for gk, candidates in by_kind.items():
        ordered = sorted(candidates, key=_rank)
        winner = ordered[0]
        winners[gk] = winner
        for loser in ordered[1:]:
            if loser.builtin and not winner.builtin:
                continue
            errors.append(
                DescriptionError(
                    loser.source,
                    loser.name,
                    f"{_ROOT}.kind",
                    f"another description of {gk} wins: {winner.name!r} from "
                    f"{winner.source} ({_why(winner, loser)})",
                )
            )
    return winners, errors


def _why(winner: Description, loser: Description) -> str:
    if winner.builtin != loser.builtin:
        return "a user description beats a built-in"
    if winner.form != loser.form:
        return "the Karta form beats ResourceInterface"
    if winner.name != loser.name:
        return "the name sorting first wins"
    return "same name: the source sorting first wins"

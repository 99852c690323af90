"""What one structured-output constraint may cost before it is compiled: its size and shape are checked first
(a 400 naming the limit, in microseconds), then the compile itself runs under a deadline and a memory cap
(isolated_worker.py). Compile time grows fast with a JSON schema's properties and alternatives (4,000 optional
properties took 28 s; 20,000 took more than 7 minutes and 9 GiB), so both are bounded."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.errors import InvalidParameterError

# The flags that set each limit (the errors name them).
FLAGS = {
    "max_spec_bytes": "--structured-outputs-max-bytes",
    "max_properties": "--structured-outputs-max-properties",
    "max_alternatives": "--structured-outputs-max-alternatives",
    "max_depth": "--structured-outputs-max-depth",
    "compile_timeout_s": "--structured-outputs-compile-timeout",
    "compile_memory_bytes": "--structured-outputs-compile-memory",
}


@dataclass(frozen=True)
class StructuredOutputLimits:
    """Limits on one constraint. `compile_timeout_s` None: compiled in this process with no deadline (the offline
    default: the caller's own input); a number: compiled in a worker process that is killed at the deadline (the
    server's default), its address space capped at `compile_memory_bytes` more than it starts with."""

    max_spec_bytes: int = 64 << 10  # a schema's JSON text, a regex, a grammar, a choice list
    max_properties: int = 512  # object properties in the whole schema
    max_alternatives: int = 128  # members of one anyOf / oneOf, values of one enum, strings of one choice
    max_depth: int = 32  # nesting of objects, arrays and combinators
    compile_timeout_s: float | None = None
    compile_memory_bytes: int = 2 << 30

    def __post_init__(self) -> None:
        for name in ("max_spec_bytes", "max_properties", "max_alternatives", "max_depth", "compile_memory_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{FLAGS[name]} must be an integer >= 1, got {value!r}.")
        timeout = self.compile_timeout_s
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"{FLAGS['compile_timeout_s']} must be a number of seconds > 0, got {timeout!r}.")

    @property
    def worker_bytes(self) -> int:
        """Host memory the compile worker may hold: its start and what its cap lets a compile take (0: no worker,
        compiles run in the engine's process)."""
        from pagedllm.isolated_worker import GRAMMAR_WORKER_START_BYTES

        return 0 if self.compile_timeout_s is None else GRAMMAR_WORKER_START_BYTES + self.compile_memory_bytes

    def check(self, param: str, kind: str, spec: str, schema: Any = None) -> None:
        """Refuse a constraint over a limit, before any work on it. `spec`: its text as compiled; `schema`: the
        parsed JSON schema (kind json)."""
        size = len(spec.encode("utf-8", "surrogatepass"))
        if size > self.max_spec_bytes:
            self._refuse(param, "max_spec_bytes", f"is {size} bytes")
        if schema is not None:
            properties, alternatives, depth = _schema_shape(schema, self.max_depth)
            if depth > self.max_depth:
                self._refuse(param, "max_depth", f"nests more than {self.max_depth} levels deep")
            if properties > self.max_properties:
                self._refuse(param, "max_properties", f"has {properties} object properties")
            if alternatives > self.max_alternatives:
                self._refuse(param, "max_alternatives", f"has an anyOf / oneOf / enum of {alternatives} members")

    def check_choice(self, param: str, choices) -> None:
        if len(choices) > self.max_alternatives:
            self._refuse(param, "max_alternatives", f"has {len(choices)} choices")

    def _refuse(self, param: str, limit: str, what: str) -> None:
        raise InvalidParameterError(param, f"{param}: the constraint {what}, over this server's limit of "
                                           f"{getattr(self, limit)} ({FLAGS[limit]}).")


_COMBINATORS = ("anyOf", "oneOf", "allOf")
_SUBSCHEMA_LISTS = _COMBINATORS + ("prefixItems",)
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
               "unevaluatedProperties", "unevaluatedItems", "additionalItems")


def _schema_shape(schema: Any, max_depth: int) -> tuple[int, int, int]:
    """(object properties in all, the widest anyOf/oneOf/allOf/enum, the deepest nesting) of a JSON schema,
    walked without recursion (a schema nested 100,000 deep must not overflow the stack); the walk stops going
    deeper once past max_depth."""
    properties = alternatives = depth = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, level = stack.pop()
        if not isinstance(node, dict):
            continue
        depth = max(depth, level)
        if level > max_depth:
            continue
        for key in _SUBSCHEMA_MAPS:
            children = node.get(key)
            if isinstance(children, dict):
                if key == "properties":
                    properties += len(children)
                stack.extend((child, level + 1) for child in children.values())
        for key in _SUBSCHEMA_LISTS:
            children = node.get(key)
            if isinstance(children, list):
                if key in _COMBINATORS:
                    alternatives = max(alternatives, len(children))
                stack.extend((child, level + 1) for child in children)
        for key in _SUBSCHEMAS:
            if key in node:
                child = node[key]
                stack.extend((c, level + 1) for c in (child if isinstance(child, list) else [child]))
        if isinstance(node.get("enum"), list):
            alternatives = max(alternatives, len(node["enum"]))
    return properties, alternatives, depth

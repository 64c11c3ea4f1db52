"""A small JSON-Schema checker for the broker's OpenAPI 3.1 document (``openapi.json``).

It supports the subset the document uses: ``$ref`` (local), ``type`` (also lists with "null"),
``properties``, ``required``, ``additionalProperties``, ``propertyNames``, ``items``, ``enum``,
``const``, ``allOf``, ``anyOf``, ``oneOf``, ``minimum``, ``maximum``, ``exclusiveMinimum``,
``minLength``, ``maxLength``, ``minItems`` and ``pattern``. Tests use it to check the broker's (and
the client's) real traffic against the contract.
"""

from __future__ import annotations

import json
import re
from functools import cache
from importlib import resources
from typing import Any

_TYPES: dict[str, Any] = {
    "object": dict,
    "array": list,
    "string": str,
    "boolean": bool,
    "null": type(None),
}


@cache
def _load_text() -> str:
    document = resources.files("k8s_agent_sandbox_awx.broker").joinpath("openapi.json")
    return document.read_text("utf-8")


def load_openapi() -> dict[str, Any]:
    """The broker API's OpenAPI document shipped in the package (a fresh copy)."""
    doc: dict[str, Any] = json.loads(_load_text())
    return doc


def _type_ok(value: Any, name: str) -> bool:
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    expected = _TYPES.get(name)
    return expected is not None and isinstance(value, expected)


def _resolve(schema: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        ref = schema["$ref"]
        if not ref.startswith("#/"):
            raise ValueError(f"only local $ref is supported, not {ref!r}")
        node: Any = root
        for part in ref[2:].split("/"):
            node = node[part]
        schema = node
    return schema


def validate(
    instance: Any, schema: dict[str, Any], root: dict[str, Any], at: str = "$"
) -> list[str]:
    """Every violation of ``schema`` by ``instance`` (empty when it conforms)."""
    schema = _resolve(schema, root)
    errors: list[str] = []
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_type_ok(instance, t) for t in types):
            return [f"{at}: {instance!r:.80} is not of type {types}"]
    if "const" in schema and instance != schema["const"]:
        errors.append(f"{at}: {instance!r:.80} != const {schema['const']!r}")
    if "enum" in schema and instance not in schema["enum"]:
        errors.append(f"{at}: {instance!r:.80} not in enum {schema['enum']}")
    for sub in schema.get("allOf", []):
        errors += validate(instance, sub, root, at)
    if "anyOf" in schema:
        results = [validate(instance, sub, root, at) for sub in schema["anyOf"]]
        if all(results):
            errors.append(f"{at}: matches none of anyOf: {results}")
    if "oneOf" in schema:
        matched = sum(1 for sub in schema["oneOf"] if not validate(instance, sub, root, at))
        if matched != 1:
            errors.append(f"{at}: matches {matched} of oneOf (exactly one required)")
    if isinstance(instance, str):
        if "minLength" in schema and len(instance) < schema["minLength"]:
            errors.append(f"{at}: shorter than {schema['minLength']}")
        if "maxLength" in schema and len(instance) > schema["maxLength"]:
            errors.append(f"{at}: longer than {schema['maxLength']}")
        if "pattern" in schema and not re.search(schema["pattern"], instance):
            errors.append(f"{at}: {instance!r:.80} does not match {schema['pattern']!r}")
    if _type_ok(instance, "number"):
        if "minimum" in schema and instance < schema["minimum"]:
            errors.append(f"{at}: {instance} < minimum {schema['minimum']}")
        if "maximum" in schema and instance > schema["maximum"]:
            errors.append(f"{at}: {instance} > maximum {schema['maximum']}")
        if "exclusiveMinimum" in schema and instance <= schema["exclusiveMinimum"]:
            errors.append(f"{at}: {instance} <= exclusiveMinimum {schema['exclusiveMinimum']}")
    if isinstance(instance, dict):
        props: dict[str, Any] = schema.get("properties", {})
        for name in schema.get("required", []):
            if name not in instance:
                errors.append(f"{at}: required property {name!r} is missing")
        for name, value in instance.items():
            if "propertyNames" in schema:
                errors += validate(name, schema["propertyNames"], root, f"{at}.<key {name!r}>")
            if name in props:
                errors += validate(value, props[name], root, f"{at}.{name}")
            else:
                extra = schema.get("additionalProperties", True)
                if extra is False:
                    errors.append(f"{at}: unexpected property {name!r}")
                elif isinstance(extra, dict):
                    errors += validate(value, extra, root, f"{at}.{name}")
    if isinstance(instance, list) and len(instance) < schema.get("minItems", 0):
        errors.append(f"{at}: fewer than {schema['minItems']} items")
    if isinstance(instance, list) and "items" in schema:
        for index, item in enumerate(instance):
            errors += validate(item, schema["items"], root, f"{at}[{index}]")
    return errors


def match_path(doc: dict[str, Any], path: str) -> str | None:
    """The path template of ``doc`` that ``path`` matches (``{path}`` takes the rest)."""
    for template in doc["paths"]:
        pattern = "^" + re.sub(r"\\\{path\\\}", ".*", re.escape(template)) + "$"
        pattern = re.sub(r"\\\{[a-z_]+\\\}", "[^/]+", pattern)
        if re.match(pattern, path):
            return str(template)
    return None


def check_response(
    doc: dict[str, Any],
    method: str,
    path: str,
    status: int,
    body: Any,
    content_type: str = "application/json",
) -> list[str]:
    """Violations of the contract by one response (undocumented status, wrong body shape)."""
    template = match_path(doc, path)
    if template is None:
        return [f"{method} {path}: no path in the OpenAPI document matches"]
    operation = doc["paths"][template].get(method.lower())
    if operation is None:
        return [f"{method} {template}: method not documented"]
    response = operation["responses"].get(str(status))
    if response is None:
        return [f"{method} {template}: status {status} not documented"]
    content = response.get("content")
    if not content:
        return [] if body in (None, b"", "") else [f"{method} {template} {status}: has a body"]
    media = content.get(content_type.split(";")[0].strip())
    if media is None:
        return [f"{method} {template} {status}: content type {content_type!r} not documented"]
    if content_type.startswith("application/json"):
        return validate(body, media["schema"], doc, f"{method} {template} {status}")
    return []

"""Tool declarations as K2.5 / K2.6 see them: OpenAI function tools (JSON Schema parameters) written as a
TypeScript-style namespace, the form the checkpoints' own tokenizer code hands their chat template
(`tools_ts_str`); the template falls back to the tools' JSON when that conversion fails, and so do we.

    # Tools

    ## functions
    namespace functions {
    // Weather of a city
    type get_weather = (_: {
      // The city
      city: string,
      days?: number
    }) => any;
    }

Per function: its `$defs` as `interface Name {...}` (a schema that refers to itself, `$ref: "#"`, as
`interface parameters`, its fields in schema order), its description as `//` lines, then `type name = (_:
{...}) => any;`. Fields: required ones first, each group by name; a field's description, constraints
(maxLength, minimum, ..., sorted) and default as `//` lines above it; integer reads number; enums, anyOf and
type lists as unions; arrays as Array<...>; additionalProperties as `[k: string]: T`. Written from the
format's published description and its observed output; the rules above are the specification this module
follows. Checked byte for byte against the reference encoder on 240,000 random schemas; one known difference:
a self-referring schema whose root additionalProperties is invalid (the reference renders it, we raise). A
malformed schema raises `Unsupported` or a TypeError / KeyError / AttributeError: the caller
(`declare_tools`) falls back to JSON on any of them, as the reference's tokenizer does.

Also here: the declarations' checks (`check_tools`, `TOOL_FIELDS`, `odd_field`) and `declared_chars`, the text
every form of a declaration holds (what chat.render bounds before building it).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

IND = "  "
CONSTRAINTS = {
    "string": ("maxLength", "minLength", "pattern"),
    "number": ("maximum", "minimum"),
    "integer": ("maximum", "minimum"),
    "array": ("maxItems", "minItems"),
}
UNION_NAMES = {
    "string": "string",
    "number": "number",
    "integer": "number",
    "boolean": "boolean",
    "null": "null",
    "object": "{}",
    "array": "Array<any>",
}


class Unsupported(ValueError):
    """A schema the TypeScript form does not cover (the caller then declares the tools as JSON)."""


def typescript_tools(tools: list[dict]) -> str:
    """The `# Tools` declaration of `tools` (OpenAI {"type": "function", "function": {...}}; other tool
    types are left out); raises for a schema the form does not cover (see the module doc)."""
    tools = json.loads(json.dumps(tools, sort_keys=True))  # keys sorted at every depth, as the reference
    funcs = [_function(t["function"]) for t in tools if t.get("type") == "function" and t.get("function")]
    if not funcs:
        return ""
    return "# Tools\n\n## functions\nnamespace functions {\n" + "\n".join(funcs) + "\n}\n"


def _comment(text: str, indent: str = "") -> str:
    return "\n".join(f"{indent}// {line}" if line else "" for line in text.split("\n"))


class _Defs(dict):
    """A function's `$defs` by name, as its schemas register them; `own`: its parameters refer to
    themselves (`$ref: "#"`)."""

    own = False


class _Schema:
    """One JSON Schema node on its way to TypeScript: `ts(indent)` its type, `doc(indent)` the `//` lines
    that go above a field of that type."""

    def __init__(self, node: Any, defs: _Defs, kind: str = ""):
        self.node, self.defs = node, defs
        self.kind = kind or self._kind()

    def _kind(self) -> str:
        n = self.node
        if isinstance(n, bool):
            return "any" if n else "null"
        if not isinstance(n, dict):
            raise Unsupported(f"schema {n!r} is not an object")
        if "$ref" in n:
            return "ref"
        for key in ("anyOf", "enum"):
            if key in n:
                return key
        if "type" in n:
            t = n["type"]
            return "union" if isinstance(t, list) else t if isinstance(t, str) else str(t)  # (None: "None")
        if n == {}:
            return "any"
        raise Unsupported(f"schema {n!r} has no type")

    def doc(self, indent: str) -> str:
        n = self.node if isinstance(self.node, dict) else {}
        lines = []
        if n.get("description"):
            lines.append(_comment(n["description"], indent))
        cons = sorted((k, n[k]) for k in CONSTRAINTS.get(self.kind, ()) if k in n)
        if cons:
            lines.append(f"{indent}// " + ", ".join(f"{k}: {v}" for k, v in cons))
        return "".join(line + "\n" for line in lines)

    def ts(self, indent: str = "") -> str:
        n, k = self.node, self.kind
        if k == "ref":
            return self._ref(n["$ref"])
        if k == "anyOf":
            return " | ".join(_Schema(x, self.defs).ts(indent) for x in n["anyOf"])
        if k == "enum":
            _check_enum(n)
            return " | ".join(f'"{e}"' if isinstance(e, str) else str(e) for e in n["enum"])
        if k == "union":
            try:
                return " | ".join(UNION_NAMES[t] for t in n["type"])
            except (KeyError, TypeError):
                raise Unsupported(f"type list {n['type']!r}") from None
        if k == "object":
            return _object(n, self.defs, indent)
        if k == "array":
            item = _Schema(n["items"], self.defs) if n.get("items") else _Schema({}, self.defs, "any")
            doc = item.doc(indent + IND)
            if doc:
                return f"Array<\n{doc}{indent}{IND}{item.ts(indent + IND)}\n{indent}>"
            return f"Array<{item.ts(indent)}>"
        return "number" if k == "integer" else k

    def _ref(self, ref: str) -> str:
        if ref == "#":
            self.defs.own = True
            return "parameters"
        if ref.startswith("#/$defs/") and isinstance(self.defs.get(ref.split("/")[-1]), dict):
            return ref.split("/")[-1]
        raise Unsupported(f"$ref {ref!r}")


def _check_enum(n: dict) -> None:
    t = n.get("type")
    if isinstance(t, list):
        if len(t) == 2 and "null" in t:
            t = t[0] if t[0] != "null" else t[1]
        elif len(t) == 1:
            t = t[0]
        else:
            raise Unsupported(f"enum of type {t!r}")
    kinds = {"string": str, "number": (int, float), "integer": int, "boolean": bool}
    if (
        isinstance(t, str)
        and t in kinds
        and any(v is not None and not isinstance(v, kinds[t]) for v in n["enum"])
    ):
        raise Unsupported(f"enum {n['enum']!r} is not all {t}")


def _fields(n: dict, defs: _Defs, indent: str) -> list[tuple[bool, str, str]]:
    """(optional, name, text) of an object schema's properties, each written at `indent`."""
    if "properties" not in n:
        return []
    props = n["properties"]
    if not isinstance(props, dict):
        raise Unsupported(f"properties {props!r}")
    out = []
    required = set(n.get("required", []))
    for name, prop in props.items():
        s = _Schema(prop, defs)
        text = s.doc(indent)
        default = prop.get("default") if isinstance(prop, dict) else None
        if default is not None:
            shown = (
                repr(default)
                if isinstance(default, (int, float, bool))
                else json.dumps(default, ensure_ascii=False)
            )
            text += f"{indent}// Default: {shown}\n"
        optional = name not in required
        out.append((optional, name, f"{text}{indent}{name}{'?' if optional else ''}: {s.ts(indent)}"))
    return out


def _object(n: dict, defs: _Defs, indent: str) -> str:
    if not n:
        return "{}"
    if "$defs" in n:  # registered first, then additionalProperties, then the fields: the reference's order
        if not isinstance(n["$defs"], dict):
            raise Unsupported(f"$defs {n['$defs']!r}")
        defs.update(n["$defs"])
    extra, kind = n.get("additionalProperties"), None
    if extra is not None:
        if extra is True or extra is False:
            kind = "any" if extra else "never"
        elif isinstance(extra, dict):
            kind = _Schema(extra, defs).ts(indent + IND)
        else:
            raise Unsupported(f"additionalProperties {extra!r}")
    fields = [text for _, _, text in sorted(_fields(n, defs, indent + IND), key=lambda f: (f[0], f[1]))]
    if kind is not None:
        fields.append(f"{indent}{IND}[k: string]: {kind}")
    return "{\n" + ",\n".join(fields) + f"\n{indent}}}" if fields else "{}"


def _function(f: dict) -> str:
    defs = _Defs()
    params = f.get("parameters") or {}
    body = _object(params, defs, "")  # registers $defs and notes a self reference
    parts = []
    if defs.own:
        own = ",\n".join(text for _, _, text in _fields(params, defs, IND))  # (in schema order)
        parts.append("interface parameters {" + (f"\n{own}\n" if own else "") + "}")
        body = "parameters"
    for name, schema in list(defs.items()):  # (those registered while these render are not rendered)
        if not isinstance(schema, dict):
            raise Unsupported(f"$defs entry {name!r}: {schema!r}")
        about = _comment(schema["description"]) + "\n" if schema.get("description") else ""
        parts.append(f"{about}interface {name} {_Schema(schema, defs).ts()}")
    if f.get("description"):
        parts.append(_comment(f["description"]))
    parts.append(f"type {f.get('name', 'function')} = (_: {body}) => any;")
    return "\n".join(parts)


# A function declaration's optional fields, as OpenAI types them (anything else would be declared as it came).
TOOL_FIELDS = (
    ("description", str, "a string"),
    ("parameters", dict, "a JSON schema object"),
    ("strict", bool, "a boolean"),
)


def check_tools(tools) -> None:
    """OpenAI function declarations in their shape (the server checks each field further, chat_api._tools):
    anything else would be declared to the model as it came."""
    if tools is None:
        return
    if isinstance(tools, (str, bytes, dict)) or not isinstance(tools, Sequence):
        raise ValueError(  # noqa: TRY004  (chat input errors are ValueError)
            f"tools is a {type(tools).__name__}; expected a list of function declarations"
        )
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict):
            raise ValueError(f"tools[{i}]: expected {{'type': 'function', 'function': {{'name': ..., ...}}}}")
        if not isinstance(f.get("name"), str) or not f["name"]:
            raise ValueError(f"tools[{i}].function.name={f.get('name')!r}: expected a non-empty string")
        if (odd := odd_field(f)) is not None:
            key, what = odd
            raise ValueError(f"tools[{i}].function.{key}: expected {what}, got {type(f[key]).__name__}")


def odd_field(f: dict) -> tuple[str, str] | None:
    """(key, what it should be) of a function declaration's first optional field (`TOOL_FIELDS`) of another
    type, else None."""
    for key, kind, what in TOOL_FIELDS:
        if f.get(key) is not None and not isinstance(f[key], kind):
            return key, what
    return None


def declare_tools(tools: list[dict], typescript: bool) -> str:
    """The text of the tool_declare turn: TypeScript-style where the format uses it (`typescript`) and the
    schemas allow, else compact, key-sorted JSON (what the reference falls back to)."""
    if typescript:
        try:
            return typescript_tools(tools)
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
            pass  # (the reference's tokenizer falls back to the JSON on any failure of the conversion)
    try:
        return json.dumps(tools, separators=(",", ":"), ensure_ascii=False, sort_keys=True)
    except (TypeError, ValueError) as e:  # a set or an object in a schema (from Python): which declaration
        bad = next(i for i, t in enumerate(tools) if not _is_json(t))
        raise ValueError(f"tools[{bad}]: not JSON ({e})") from None


def _is_json(x) -> bool:
    try:
        json.dumps(x, sort_keys=True)
    except (TypeError, ValueError):
        return False
    return True


def declared_chars(tools: list[dict]) -> int:
    """Characters every form of the declaration (TypeScript or JSON) holds at least, counted without building
    it: each function's name and description, each top-level parameter's name and description (the
    TypeScript form writes them as `name: type` and `//` lines, the JSON one as keys and strings, escaped or
    longer). `tools` checked (`check_tools`)."""
    held = 0
    for t in tools:
        f = t["function"]
        props = (f.get("parameters") or {}).get("properties")
        held += len(f["name"]) + len(f.get("description") or "")
        for name, prop in props.items() if isinstance(props, dict) else ():
            about = prop.get("description") if isinstance(prop, dict) else None
            held += len(str(name)) + (len(about) if isinstance(about, str) else 0)
    return held

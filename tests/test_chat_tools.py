"""K2.5 / K2.6 tool declarations (k26/chat_tools.py): the TypeScript-style form their tokenizer code writes,
exactly (outputs checked against the public reference encoder, run locally as an oracle), and the cases
it does not cover raised (the chat format then declares the tools as JSON)."""

import pytest

from k26.chat_tools import Unsupported, typescript_tools

SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.\n\nReturns links.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {
                    "type": "string",
                    "description": "What to look for",
                    "maxLength": 200,
                    "minLength": 1,
                },
                "mode": {"type": "string", "enum": ["fast", "deep"], "default": "fast"},
                "limit": {"type": "integer", "default": 10, "minimum": 1, "maximum": 50},
                "tags": {"type": "array", "items": {"type": "string", "description": "a tag"}, "maxItems": 5},
                "filters": {
                    "type": "object",
                    "properties": {"site": {"type": ["string", "null"]}},
                    "additionalProperties": False,
                },
                "near": {"anyOf": [{"$ref": "#/$defs/Point"}, {"type": "null"}]},
            },
            "required": ["query"],
            "$defs": {
                "Point": {
                    "type": "object",
                    "description": "A place",
                    "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                    "required": ["lat", "lon"],
                }
            },
        },
    },
}


def test_a_rich_schema_reads_as_the_reference_writes_it():
    assert typescript_tools([SEARCH]) == (
        "# Tools\n\n## functions\nnamespace functions {\n"
        "// A place\ninterface Point {\n  lat: number,\n  lon: number\n}\n"
        "// Search the web.\n\n// Returns links.\n"
        "type search = (_: {\n"
        "  // What to look for\n  // maxLength: 200, minLength: 1\n  query: string,\n"
        "  filters?: {\n    site?: string | null,\n    [k: string]: never\n  },\n"
        "  // maximum: 50, minimum: 1\n  // Default: 10\n  limit?: number,\n"
        '  // Default: "fast"\n  mode?: "fast" | "deep",\n'
        "  near?: Point | null,\n"
        "  // maxItems: 5\n  tags?: Array<\n    // a tag\n    string\n  >\n"
        "}) => any;\n}\n"
    )


def test_a_self_referring_schema_becomes_interface_parameters():
    walk = {
        "type": "function",
        "function": {
            "name": "walk",
            "parameters": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "children": {"type": "array", "items": {"$ref": "#"}},
                },
                "required": ["name"],
            },
        },
    }
    assert typescript_tools([walk, {"type": "function", "function": {"name": "ping"}}]) == (
        "# Tools\n\n## functions\nnamespace functions {\n"
        "interface parameters {\n  children?: Array<parameters>,\n  name: string\n}\n"
        "type walk = (_: parameters) => any;\n"
        "type ping = (_: {}) => any;\n}\n"
    )


@pytest.mark.parametrize(
    "params",
    [
        {"type": "object", "properties": {"x": {"$ref": "#/$defs/Missing"}}},
        {"type": "object", "properties": {"x": {"type": ["string", "date"]}}},
        {"type": "object", "properties": {"x": {"type": "string", "enum": ["a", 1]}}},
        {"type": "object", "properties": {"x": {"description": "no type"}}},
        {"type": "object", "additionalProperties": "yes"},
    ],
)
def test_what_the_form_does_not_cover_is_raised(params):
    with pytest.raises(Unsupported):
        typescript_tools([{"type": "function", "function": {"name": "f", "parameters": params}}])

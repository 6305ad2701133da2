"""Model outputs in the shapes the models emit (the formats their chat templates teach), each with
the content, reasoning and tool calls a correct parser must return. Written by hand: code in
arguments, JSON with nested braces and tags inside strings, multi-line values, unicode, several
calls, reasoning before (or instead of closing before) calls, and outputs cut off mid-call."""
from __future__ import annotations

from dataclasses import dataclass

from sparkpack.runtime.server.output import ToolSyntax

QWEN, HERMES, LAGUNA = ToolSyntax.QWEN_XML, ToolSyntax.HERMES_JSON, ToolSyntax.LAGUNA


def _fn(name: str, properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "function", "function": {"name": name, "description": f"{name} tool",
                                             "parameters": {"type": "object", "properties": properties,
                                                            "required": required or list(properties)}}}


S, I, N, B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
TOOLS = [
    _fn("read_file", {"path": S, "offset": I, "limit": I}, ["path"]),
    _fn("write_file", {"path": S, "content": S}),
    _fn("edit_file", {"path": S, "old_string": S, "new_string": S, "replace_all": B}, ["path", "old_string", "new_string"]),
    _fn("bash", {"command": S, "timeout": N}, ["command"]),
    _fn("search", {"query": S, "paths": {"type": "array", "items": S},
                   "options": {"type": "object", "properties": {"depth": I}},
                   "max_results": {"type": ["integer", "null"]}}, ["query"]),
    _fn("get_weather", {"city": S, "unit": {"type": "string", "enum": ["c", "f"]}}, ["city"]),
    _fn("todo", {"items": {"type": "array"}, "note": {"anyOf": [{"type": "string"}, {"type": "number"}]}}),
    {"type": "function", "function": {"name": "no_schema"}},
]


@dataclass(frozen=True)
class Case:
    name: str
    syntax: ToolSyntax
    in_reasoning: bool
    text: str
    content: str
    reasoning: str
    calls: tuple[tuple[str, dict], ...]


PY_WITH_TAGS = '''def render(call):
    """Qwen writes calls as <tool_call><function=NAME>...</function></tool_call>."""
    out = "<parameter=" + call.key + ">\\n" + call.value + "\\n</parameter>\\n"
    if not call.args:
        return {"empty": {}}
    return out
'''

JS_CODE = '''export function merge(a, b) {
  const out = { ...a, nested: { deep: [1, 2, { x: "}" }] } };
  for (const k of Object.keys(b)) {
    if (typeof b[k] === "object") out[k] = merge(a[k] ?? {}, b[k]);
    else out[k] = b[k];
  }
  return out; // "</tool_call>" is just text here
}'''

CASES = [
    # --- Qwen3.5/3.6 (prompt opened <think>), XML calls -------------------------------------------
    Case("qwen35 reasoning then one read", QWEN, True,
         "The user wants the entry point. I should read main.py first.\n</think>\n\n"
         "<tool_call>\n<function=read_file>\n<parameter=path>\nsrc/main.py\n</parameter>\n</function>\n</tool_call>",
         "", "The user wants the entry point. I should read main.py first.",
         (("read_file", {"path": "src/main.py"}),)),
    Case("qwen35 write code holding parameter tags and braces", QWEN, True,
         "Writing the renderer.\n</think>\n\n"
         "<tool_call>\n<function=write_file>\n<parameter=path>\npkg/render.py\n</parameter>\n"
         "<parameter=content>\n" + PY_WITH_TAGS + "\n</parameter>\n</function>\n</tool_call>",
         "", "Writing the renderer.",
         (("write_file", {"path": "pkg/render.py", "content": PY_WITH_TAGS}),)),
    Case("qwen35 value quotes a whole call of an unknown parameter", QWEN, True,
         "Add the example to the docs.\n</think>\n\n"
         "<tool_call>\n<function=edit_file>\n<parameter=path>\ndocs/format.md\n</parameter>\n"
         "<parameter=old_string>\nTODO: example\n</parameter>\n"
         "<parameter=new_string>\nExample:\n<tool_call>\n<function=get_weather>\n<parameter=example_parameter_1>\n"
         "value_1\n</parameter>\n<parameter=example_parameter_2>\nvalue_2\n</parameter>\n</function>\n"
         "(end of example)\n</parameter>\n<parameter=replace_all>\nfalse\n</parameter>\n</function>\n</tool_call>",
         "", "Add the example to the docs.",
         (("edit_file", {"path": "docs/format.md", "old_string": "TODO: example",
                         "new_string": "Example:\n<tool_call>\n<function=get_weather>\n<parameter=example_parameter_1>\n"
                                       "value_1\n</parameter>\n<parameter=example_parameter_2>\nvalue_2\n</parameter>\n"
                                       "</function>\n(end of example)",
                         "replace_all": False}),)),
    Case("qwen35 three calls in one turn", QWEN, True,
         "Run the three checks in parallel.\n</think>\n\n"
         "<tool_call>\n<function=bash>\n<parameter=command>\npytest -q tests/test_a.py\n</parameter>\n"
         "<parameter=timeout>\n120\n</parameter>\n</function>\n</tool_call>\n"
         "<tool_call>\n<function=bash>\n<parameter=command>\ngrep -rn \"TODO\" src/ | head -20\n</parameter>\n</function>\n</tool_call>\n"
         "<tool_call>\n<function=read_file>\n<parameter=path>\nsetup.cfg\n</parameter>\n<parameter=offset>\n10\n</parameter>\n"
         "<parameter=limit>\n40\n</parameter>\n</function>\n</tool_call>",
         "", "Run the three checks in parallel.",
         (("bash", {"command": "pytest -q tests/test_a.py", "timeout": 120}),
          ("bash", {"command": 'grep -rn "TODO" src/ | head -20'}),
          ("read_file", {"path": "setup.cfg", "offset": 10, "limit": 40}))),
    Case("qwen35 text before the call", QWEN, True,
         "Need the failing test.\n</think>\n\nI'll look at the failing test first.\n\n"
         "<tool_call>\n<function=read_file>\n<parameter=path>\ntests/test_parser.py\n</parameter>\n</function>\n</tool_call>",
         "I'll look at the failing test first.", "Need the failing test.",
         (("read_file", {"path": "tests/test_parser.py"}),)),
    Case("qwen35 typed parameters", QWEN, True,
         "Search with options.\n</think>\n\n"
         "<tool_call>\n<function=search>\n<parameter=query>\nfn main() {\n</parameter>\n"
         "<parameter=paths>\n[\"src\", \"crates/core/src\"]\n</parameter>\n"
         "<parameter=options>\n{\"depth\": 3, \"filters\": {\"lang\": [\"rust\", \"toml\"], \"skip\": {}}}\n</parameter>\n"
         "<parameter=max_results>\nnull\n</parameter>\n</function>\n</tool_call>",
         "", "Search with options.",
         (("search", {"query": "fn main() {", "paths": ["src", "crates/core/src"],
                      "options": {"depth": 3, "filters": {"lang": ["rust", "toml"], "skip": {}}},
                      "max_results": None}),)),
    Case("qwen35 python-style literals from the template's rendering", QWEN, True,
         "Replace everywhere.\n</think>\n\n"
         "<tool_call>\n<function=edit_file>\n<parameter=path>\na.py\n</parameter>\n<parameter=old_string>\nx = 1\n</parameter>\n"
         "<parameter=new_string>\nx = 2\n</parameter>\n<parameter=replace_all>\nTrue\n</parameter>\n</function>\n</tool_call>",
         "", "Replace everywhere.",
         (("edit_file", {"path": "a.py", "old_string": "x = 1", "new_string": "x = 2", "replace_all": True}),)),
    Case("qwen35 unicode everywhere", QWEN, True,
         "Der Nutzer fragt nach dem Wetter in Zürich — 天气 ☀️.\n</think>\n\n"
         "Ich schaue nach 🌦️…\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n</parameter>\n"
         "<parameter=unit>\nc\n</parameter>\n</function>\n</tool_call>",
         "Ich schaue nach 🌦️…", "Der Nutzer fragt nach dem Wetter in Zürich — 天气 ☀️.",
         (("get_weather", {"city": "Zürich", "unit": "c"}),)),
    Case("qwen35 file content keeps its own trailing newline", QWEN, True,
         "Create the file.\n</think>\n\n"
         "<tool_call>\n<function=write_file>\n<parameter=path>\nREADME.md\n</parameter>\n<parameter=content>\n"
         "# Title\n\nSome text.\n\n</parameter>\n</function>\n</tool_call>",
         "", "Create the file.",
         (("write_file", {"path": "README.md", "content": "# Title\n\nSome text.\n"}),)),
    Case("qwen35 javascript with braces and a closing call tag in a comment", QWEN, True,
         "Implement merge.\n</think>\n\n"
         "<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/merge.js\n</parameter>\n<parameter=content>\n"
         + JS_CODE + "\n</parameter>\n</function>\n</tool_call>",
         "", "Implement merge.",
         (("write_file", {"path": "src/merge.js", "content": JS_CODE}),)),
    Case("qwen35 reasoning mentions the tag without calling", QWEN, True,
         "I must not emit a <tool_call> block here; the answer is direct.\n</think>\n\n"
         "The answer is 42. Use `<tool_call>` tags only when calling tools.",
         "The answer is 42. Use `<tool_call>` tags only when calling tools.",
         "I must not emit a <tool_call> block here; the answer is direct.", ()),
    Case("qwen35 call without closing the reasoning", QWEN, True,
         "Let me list the directory.\n\n<tool_call>\n<function=bash>\n<parameter=command>\nls -la\n</parameter>\n"
         "</function>\n</tool_call>",
         "", "Let me list the directory.", (("bash", {"command": "ls -la"}),)),
    Case("qwen35 checkpoint repeats the opening think tag", QWEN, True,
         "<think>\nShort answer.\n</think>\n\nParis.",
         "Paris.", "Short answer.", ()),
    Case("qwen35 cut off inside a call", QWEN, True,
         "Write it.\n</think>\n\nSure.\n<tool_call>\n<function=write_file>\n<parameter=path>\nx.py\n</parameter>\n"
         "<parameter=content>\nprint('hi')\n",
         "Sure.\n<tool_call>\n<function=write_file>\n<parameter=path>\nx.py\n</parameter>\n"
         "<parameter=content>\nprint('hi')\n", "Write it.", ()),
    Case("qwen35 json body inside tool_call", QWEN, True,
         "Use JSON.\n</think>\n\n<tool_call>\n{\"name\": \"read_file\", \"arguments\": {\"path\": \"a {b}.txt\"}}\n</tool_call>",
         "", "Use JSON.", (("read_file", {"path": "a {b}.txt"}),)),
    Case("qwen35 no thinking: html with angle brackets, no call", QWEN, False,
         "Here is the markup:\n\n```html\n<tool_calling-widget>\n  <div class=\"a\">{x}</div>\n</tool_calling-widget>\n```\n"
         "Use <tool_call with care.",
         "Here is the markup:\n\n```html\n<tool_calling-widget>\n  <div class=\"a\">{x}</div>\n</tool_calling-widget>\n```\n"
         "Use <tool_call with care.", "", ()),
    Case("qwen3-coder call with a JSON string and an untyped tool", QWEN, False,
         "I'll store the config.\n<tool_call>\n<function=no_schema>\n<parameter=payload>\n{\"a\": {\"b\": \"}\"}}\n</parameter>\n"
         "<parameter=count>\n3\n</parameter>\n</function>\n</tool_call>",
         "I'll store the config.",
         "", (("no_schema", {"payload": "{\"a\": {\"b\": \"}\"}}", "count": "3"}),)),
    Case("qwen35 anyOf and array parameters, no parameters call", QWEN, True,
         "Track it.\n</think>\n\n<tool_call>\n<function=todo>\n<parameter=items>\n[{\"task\": \"a\", \"done\": false}]\n"
         "</parameter>\n<parameter=note>\n7.5\n</parameter>\n</function>\n</tool_call>\n"
         "<tool_call>\n<function=no_schema>\n</function>\n</tool_call>",
         "", "Track it.",
         (("todo", {"items": [{"task": "a", "done": False}], "note": 7.5}), ("no_schema", {}))),

    # --- Qwen3 (hermes JSON); reasoning opened by the model itself ---------------------------------
    Case("qwen3 think then weather call", HERMES, False,
         "<think>\nThe user asks about weather in Zürich.\n</think>\n\n"
         "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\", \"unit\": \"c\"}}\n</tool_call>",
         "", "The user asks about weather in Zürich.", (("get_weather", {"city": "Zürich", "unit": "c"}),)),
    Case("qwen3 arguments with braces, escapes and tags in strings", HERMES, False,
         "<think>\n\n</think>\n\nWriting the file now.\n<tool_call>\n"
         "{\"name\": \"write_file\", \"arguments\": {\"path\": \"t.py\", \"content\": \"x = {\\\"a\\\": [1, {\\\"b\\\": \\\"}\\\"}]}\\n"
         "s = '</tool_call>'\\n# \\\\ backslash \\u00e9\\n\"}}\n</tool_call>",
         "Writing the file now.", "",
         (("write_file", {"path": "t.py", "content": "x = {\"a\": [1, {\"b\": \"}\"}]}\ns = '</tool_call>'\n# \\ backslash é\n"}),)),
    Case("qwen3 two calls", HERMES, False,
         "<tool_call>\n{\"name\": \"read_file\", \"arguments\": {\"path\": \"a.py\"}}\n</tool_call>\n"
         "<tool_call>\n{\"name\": \"read_file\", \"arguments\": {\"path\": \"b.py\", \"limit\": 5}}\n</tool_call>",
         "", "", (("read_file", {"path": "a.py"}), ("read_file", {"path": "b.py", "limit": 5}))),
    Case("qwen3 arguments given as a string, name last", HERMES, False,
         "<tool_call>\n{\"arguments\": \"{\\\"command\\\": \\\"make test\\\"}\", \"name\": \"bash\"}\n</tool_call>",
         "", "", (("bash", {"command": "make test"}),)),
    Case("qwen3 plain answer with a JSON code block", HERMES, False,
         "<think>\nJust format it.\n</think>\n\n```json\n{\"name\": \"x\", \"arguments\": {}}\n```",
         "```json\n{\"name\": \"x\", \"arguments\": {}}\n```", "Just format it.", ()),
    Case("qwen3 broken json stays text", HERMES, False,
         "Calling.\n<tool_call>\n{\"name\": \"bash\", \"arguments\": {\"command\": \"ls\"}\n</tool_call> and more",
         "Calling.\n<tool_call>\n{\"name\": \"bash\", \"arguments\": {\"command\": \"ls\"}\n</tool_call> and more", "", ()),

    # --- Laguna --------------------------------------------------------------------------------------
    Case("laguna thinking off, one call", LAGUNA, False,
         "\nI'll read the module first.\n<tool_call>read_file\n<arg_key>path</arg_key>\n<arg_value>src/app.py</arg_value>\n"
         "<arg_key>limit</arg_key>\n<arg_value>200</arg_value>\n</tool_call>\n",
         "I'll read the module first.", "", (("read_file", {"path": "src/app.py", "limit": 200}),)),
    Case("laguna thinking on, value holds its own closing tag", LAGUNA, True,
         "\nFind where values end.\n</think>\n<tool_call>bash\n<arg_key>command</arg_key>\n"
         "<arg_value>grep -n '</arg_value>' parser.go | head</arg_value>\n</tool_call>\n",
         "", "Find where values end.", (("bash", {"command": "grep -n '</arg_value>' parser.go | head"}),)),
    Case("laguna typed values rendered by tojson", LAGUNA, False,
         "<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>def parse(</arg_value>\n<arg_key>paths</arg_key>\n"
         "<arg_value>[\"runtime\", \"tests\"]</arg_value>\n<arg_key>options</arg_key>\n<arg_value>{\"depth\": 2}</arg_value>\n"
         "</tool_call>\n",
         "", "", (("search", {"query": "def parse(", "paths": ["runtime", "tests"], "options": {"depth": 2}}),)),
    Case("laguna tight layout (S-2.1 / synthetic template), two calls", LAGUNA, False,
         "Two files.<tool_call>read_file<arg_key>path</arg_key><arg_value>a.py</arg_value></tool_call>"
         "<tool_call>write_file<arg_key>path</arg_key><arg_value>b.py</arg_value><arg_key>content</arg_key>"
         "<arg_value>x = \"<arg_key>\"\n</arg_value></tool_call>",
         "Two files.", "",
         (("read_file", {"path": "a.py"}), ("write_file", {"path": "b.py", "content": "x = \"<arg_key>\"\n"}))),
    Case("laguna multi-line code value with markup", LAGUNA, True,
         "Edit the template.</think>\n<tool_call>edit_file\n<arg_key>path</arg_key>\n<arg_value>t.html</arg_value>\n"
         "<arg_key>old_string</arg_key>\n<arg_value><p>\n  {{ name }}\n</p></arg_value>\n<arg_key>new_string</arg_key>\n"
         "<arg_value><p class=\"n\">\n  {{ name | e }}\n</p>\n</arg_value>\n</tool_call>\n",
         "", "Edit the template.",
         (("edit_file", {"path": "t.html", "old_string": "<p>\n  {{ name }}\n</p>",
                         "new_string": "<p class=\"n\">\n  {{ name | e }}\n</p>\n"}),)),
    Case("laguna no-argument call and text after", LAGUNA, False,
         "<tool_call>no_schema</tool_call>\nDone.",
         "Done.", "", (("no_schema", {}),)),
]

CASES += [
    Case("qwen3-coder call without its <tool_call> opener", QWEN, False,
         "Checking the status.\n<function=bash>\n<parameter=command>\ngit status --short\n</parameter>\n</function>\n</tool_call>\n"
         "<function=unknown_tool>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>",
         "Checking the status.<function=unknown_tool>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>", "",
         (("bash", {"command": "git status --short"}),)),
]

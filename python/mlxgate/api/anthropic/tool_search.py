"""Tool search on the Messages API: deferred tools kept out of the prompt's tool list, the
`tool_reference` blocks that load them (rendered as the tools' definitions, callable from then
on), and the server-side search tools, shown to the model as a function whose calls the stream
core answers itself (`rust/events/tool_search.rs`)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from mlxgate import prompts
from mlxgate.api.errors import invalid

# The declared types of the server-side search tools, and the search each one runs.
SEARCH_KINDS: dict[str, Literal["regex", "bm25"]] = {
    "tool_search_tool_regex_20251119": "regex",
    "tool_search_tool_regex": "regex",
    "tool_search_tool_bm25_20251119": "bm25",
    "tool_search_tool_bm25": "bm25",
}
# The names Anthropic's search tools are called by.
SEARCH_NAMES = frozenset({"tool_search_tool_regex", "tool_search_tool_bm25"})
# Anthropic's: a search loads at most this many tools (the stream core's limit too).
MAX_RESULTS = 5

SEARCH_DESCRIPTIONS = {
    "regex": (
        "Finds deferred tools by a regular expression (Python `re.search` syntax, at most 200 "
        "characters; `(?i)` for a case-insensitive search) matched against each tool's name, "
        "description and argument names and descriptions."
    ),
    "bm25": (
        "Finds deferred tools by a natural-language query, ranked by BM25 over each tool's "
        "name, description and argument names and descriptions."
    ),
}
QUERY_DESCRIPTIONS = {
    "regex": "The regular expression to search for.",
    "bm25": "What the tool should do, in a few words.",
}


class DeclaredTool(Protocol):
    """A tool as the request declares it (`requests.ToolSpec`)."""

    @property
    def name(self) -> str: ...
    @property
    def description(self) -> str | None: ...
    @property
    def input_schema(self) -> dict[str, Any] | None: ...
    @property
    def type(self) -> str | None: ...
    @property
    def defer_loading(self) -> bool: ...


def function(tool: DeclaredTool) -> prompts.Tool:
    body = {
        "name": tool.name,
        "description": tool.description or "",
        "parameters": tool.input_schema,
    }
    return {"type": "function", "function": body}


def definition(tool: prompts.Tool) -> str:
    """One tool as a tool search returns it to the model: the line Claude Code's ToolSearch
    description promises, `<function>{"description", "name", "parameters"}</function>`."""
    body = tool["function"]
    shown = {
        "description": body.get("description") or "",
        "name": body["name"],
        "parameters": body.get("parameters") or {},
    }
    return f"<function>{json.dumps(shown, ensure_ascii=False)}</function>"


def _document(tool: prompts.Tool) -> str:
    """What a search matches a tool by: its name, description, and its arguments' names and
    descriptions, one per line."""
    body = tool["function"]
    properties = (body.get("parameters") or {}).get("properties") or {}
    arguments = [
        f"{name} {spec.get('description') or ''}".rstrip() if isinstance(spec, dict) else name
        for name, spec in properties.items()
    ]
    return "\n".join([body["name"], body.get("description") or "", *arguments])


@dataclass(frozen=True)
class SearchTool:
    """A declared server-side search tool over the request's deferred tools."""

    name: str
    kind: Literal["regex", "bm25"]
    deferred: list[prompts.Tool]

    def function(self) -> prompts.Tool:
        """The search as the model sees it: a function of one `query`, its description naming
        the deferred tools it can load (their names only: their schemas come with a result)."""
        names = "\n".join(f"- {tool['function']['name']}" for tool in self.deferred)
        description = (
            f"{SEARCH_DESCRIPTIONS[self.kind]} Returns the definitions of up to {MAX_RESULTS} "
            "matching tools; a tool found is callable from then on like any other.\n\n"
            f"Deferred tools:\n{names or '(none)'}"
        )
        query = {"type": "string", "description": QUERY_DESCRIPTIONS[self.kind]}
        parameters = {"type": "object", "properties": {"query": query}, "required": ["query"]}
        return {
            "type": "function",
            "function": {"name": self.name, "description": description, "parameters": parameters},
        }

    def stream_params(self) -> tuple[str, str, list[tuple[str, str]]]:
        """What the stream core searches with: the tool's name, the search, and each deferred
        tool's name and document."""
        return self.name, self.kind, [(t["function"]["name"], _document(t)) for t in self.deferred]


@dataclass
class Toolset:
    """A request's tools as the prompt has them: those listed, those deferred (listed only once
    a search loads them), every function tool by name, and the server-side search if declared."""

    listed: list[prompts.Tool] = field(default_factory=list)
    defined: dict[str, prompts.Tool] = field(default_factory=dict)
    deferred: set[str] = field(default_factory=set)
    search: SearchTool | None = None

    @classmethod
    def of(cls, declared: Sequence[DeclaredTool]) -> Toolset:
        toolset = cls()
        searches: list[tuple[int, DeclaredTool]] = []  # (place in the list, tool)
        for tool in declared:
            if tool.type in SEARCH_KINDS:
                searches.append((len(toolset.listed), tool))
            elif tool.input_schema is not None:  # other server tools: none a local model runs
                toolset.defined[tool.name] = function(tool)
                if tool.defer_loading:
                    toolset.deferred.add(tool.name)
                else:
                    toolset.listed.append(toolset.defined[tool.name])
        if len(searches) > 1:
            raise invalid("tools: declare one tool search tool (regex or bm25), not both")
        if searches:
            [(place, search)] = searches
            deferred = [tool for name, tool in toolset.defined.items() if name in toolset.deferred]
            toolset.search = SearchTool(search.name, SEARCH_KINDS[search.type or ""], deferred)
            toolset.listed.insert(place, toolset.search.function())
        return toolset

    def is_search(self, name: str | None) -> bool:
        """Whether a `server_tool_use` of `name` is a tool search's call (replayed as a call of
        it also when this request no longer declares the search)."""
        return name in SEARCH_NAMES or (self.search is not None and name == self.search.name)

    def loaded(self, names: Iterable[str]) -> list[prompts.Tool]:
        """The deferred tools among `names` (each once, in order): callable, not listed."""
        seen: dict[str, prompts.Tool] = {}
        for name in names:
            if name in self.deferred and name not in seen:
                seen[name] = self.defined[name]
        return list(seen.values())

    def found(self, names: list[str]) -> str:
        """Tools a search found, as the model reads them: their definitions in a `<functions>`
        block, and a sentence for each name the request's tools do not define."""
        lines = [definition(self.defined[name]) for name in names if name in self.defined]
        if lines:
            lines = ["<functions>", *lines, "</functions>"]
        lines += [
            f"No tool named {name!r} is available: the request's tools do not define it."
            for name in names
            if name not in self.defined
        ]
        return "\n".join(lines)

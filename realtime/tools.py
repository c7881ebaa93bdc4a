"""Function tools a client offers (`session.tools` / `tool_choice`, and the same in `response.create`).

OpusLM has no function calling: it never calls a tool. That is exactly what `tool_choice: "auto"`
allows (the model may answer without calling any), and what `"none"` asks for, so both are accepted
and the tools are echoed as listed: agent frameworks register their tools on every session, and a
refusal there would break them for nothing (docs/protocol.md, "Every session field"). A choice that
demands a call (`"required"`, or one named function or MCP tool) is refused: the client would wait
for a call that never comes. MCP tools are refused too: OpenAI's server connects to the MCP server
and lists its tools (`mcp_list_tools.*`), which this server does not do.
"""

from __future__ import annotations

from realtime.wire_fields import ClientError, get_field, unsupported

TOOL_CHOICES = ("auto", "none")  # the choices OpusLM honours: it calls no tool
MAX_TOOLS = 128  # OpenAI's limit on function tools per request
_FUNCTION_KEYS = {"type", "name", "description", "parameters"}
NO_CALLS = "OpusLM has no function calling: it never calls a tool"


def parse_tools(value: object, param: str) -> tuple[dict, ...]:
    """The function tools as they will be echoed (`{"type": "function", "name", "description", "parameters"}`);
    ClientError naming the first bad one."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ClientError("invalid_type", f"'{param}' must be a list of tools", param)
    if len(value) > MAX_TOOLS:
        raise ClientError("invalid_value", f"'{param}' holds at most {MAX_TOOLS} tools", param)
    tools, names = [], set()
    for i, tool in enumerate(value):
        tp = f"{param}[{i}]"
        if not isinstance(tool, dict):
            raise ClientError("invalid_type", f"'{tp}' must be an object", tp)
        kind = get_field(tool, "type", str, prefix=tp + ".") or "function"
        if kind == "mcp":
            raise unsupported(tp + ".type", "no MCP tools: the server connects to no MCP server (offer function tools)")
        if kind != "function":
            raise ClientError("invalid_value", f"'{tp}.type' must be \"function\"", tp + ".type")
        for key in tool:
            if key not in _FUNCTION_KEYS:
                raise ClientError("unknown_parameter", f"unknown parameter '{tp}.{key}'", f"{tp}.{key}")
        name = get_field(tool, "name", str, required=True, prefix=tp + ".")
        if not name or name in names:
            raise ClientError("invalid_value", f"'{tp}.name' must be a non-empty name, once per list", tp + ".name")
        names.add(name)
        description = get_field(tool, "description", str, prefix=tp + ".")
        parameters = get_field(tool, "parameters", dict, prefix=tp + ".")
        tools.append({"type": "function", "name": name, "description": description, "parameters": parameters})
    return tuple(tools)


def parse_tool_choice(value: object, param: str) -> str | None:
    """"auto" or "none" (None when not sent); a choice that forces a call: ClientError naming it."""
    if value is None:
        return None
    if isinstance(value, str) and value in TOOL_CHOICES:
        return value
    if value == "required" or isinstance(value, dict) and value.get("type") in ("function", "mcp"):
        raise unsupported(param, f"{NO_CALLS}, so it cannot be made to call one (use \"auto\" or \"none\")")
    raise ClientError("invalid_value", f"'{param}' must be \"auto\", \"none\", \"required\" or a tool to call", param)

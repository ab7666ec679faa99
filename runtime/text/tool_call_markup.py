"""The Qwen XML tool-call markup (the format: tool_calls.py): its tag texts, and the whitespace and
header length that the block parser and its value-end scanner share."""

FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAM_OPEN = "<parameter="
PARAM_CLOSE = "</parameter>"
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
WHITESPACE = " \t\r\n"
MAX_HEADER = 256  # longest `<function=NAME>` / `<parameter=KEY>` header we wait for

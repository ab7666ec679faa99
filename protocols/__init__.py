"""`infernix-serve`: the asyncio + uvloop + h11 HTTP server, SSE, the OpenAI Chat, OpenAI
Responses and Anthropic Messages APIs, errors, request log and metrics. Never touches token
tensors: it talks to the engine through request records and token increments."""

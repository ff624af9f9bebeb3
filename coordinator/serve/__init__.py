"""`sparseinfer serve`: the OpenAI-compatible HTTP server over the continuous-batching
Scheduler (coordinator/batching.py), its request bodies (api_schema.py), its Prometheus
metrics (metrics.py), tool calls (tool_calls.py) and the chat page (web/chat.html)."""

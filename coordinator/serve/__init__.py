"""`sparseinfer serve`: the OpenAI-compatible HTTP server over the continuous-batching
Scheduler (coordinator/runtime/batching.py, which the terminal chat drives too).

    server.py            serve(): bind, load the engine on a thread, run uvicorn, restart or stop
    app.py               the FastAPI app: routes, API key, errors, the chat page (web/chat.html)
    completion.py        one request from its token ids to its reply
    chat_request.py      a chat request for every API that chats: prompt, tools, thinking, the reply's parts
    anthropic_api.py     POST /v1/messages (Anthropic's Messages API); responses_api.py POST /v1/responses
    reasoning.py         a reply's thinking apart from its answer (<think>, gpt-oss's harmony channels)
    thinking.py          a request's thinking options and the budget held while decoding
    streaming.py         a reply as server-sent events
    responses.py         OpenAI's response objects
    api_schema.py        the request bodies (pydantic)
    tool_use.py          a chat request's tools; tool_calls.py the call formats and their grammar
    metrics.py           GET /metrics (Prometheus)
    limits.py            body size and time, connections; uvicorn_protocol.py the header deadline
    state.py             ServerState, ApiError, off_loop
"""

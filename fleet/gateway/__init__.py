"""``fleet gateway``: the fleet over HTTP, for tools that speak the OpenAI API and producers
without a Celery client (docs/gateway.md).

    auth.py        per-project API keys (digests in the settings), reloaded on change or SIGHUP
    wire.py        the OpenAI/vLLM request, chunk and error shapes
    admission.py   pending item + grant handed over by the dispatcher; lease claim and release
    upstream.py    one stream from vLLM on its own thread, with the loop watcher
    chat.py        POST /v1/chat/completions from key to released lease
    tasks.py       fleet jobs over HTTP (/v1/tasks); events.py one shared reader for their events
    files.py       OpenAI files (/v1/files) kept in Redis; fileroutes.py their routes
    batchrecord.py an OpenAI batch's record in Redis: state, load, commit, the Redis clock
    batches.py     OpenAI batches (/v1/batches) onto fleet jobs: lifecycle, routes, result files
    metrics.py     Prometheus figures; app.py the ASGI app; server.py ``fleet gateway``
    connections.py what a client may hold open before any key: caps, header timeout, summaries;
                   guarded.py the uvicorn protocol that applies them
"""

"""The HTTP server (FastAPI on uvicorn), in the tokenizer process: routes, protocol, errors, SSE, metrics."""

"""The OpenAI-compatible HTTP server: api_server (app, routes, start-up), protocol (bodies),
completions, chat, tokenization (endpoints), serving (shared context), streaming (SSE and
deltas), logprobs (response shapes), errors (OpenAI's error body)."""

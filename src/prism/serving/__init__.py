"""OpenAI-compatible HTTP/SSE serving (issue 5: not built yet)."""

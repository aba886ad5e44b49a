"""The OpenAI-compatible HTTP server: every registered adapter is a model a client can name."""

"""The HTTP server behind `spark-run MODEL --serve`: OpenAI and Anthropic dialects over one model."""

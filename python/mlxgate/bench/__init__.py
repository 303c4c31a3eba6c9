"""`mlxgate bench`: load against any server speaking the Anthropic, OpenAI or Responses API, one
record per request."""

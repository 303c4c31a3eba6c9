"""HTTP API dialects served over the one engine."""

"""The tests' helpers: real servers, SSE frames, the in-process app, tiny random-weight models,
scripted (forced) models and the coding agents' drivers. Importable as `support.*` from tests
(pytest puts `tests/` on the path) and from the benches that reuse them (run with
`PYTHONPATH=tests`)."""

# Convenience wrappers; the two README commands are ./scripts/run.sh and ./scripts/test.sh.
.PHONY: setup run test test-fast bench lint
setup:
	./scripts/setup.sh
run:
	./scripts/run.sh
test:
	./scripts/test.sh
# The unit tier: no server, no engine, no transformers oracle (~1 min on 2 cores); docs/testing.md
test-fast:
	.venv/bin/python -m pytest -q -p no:cacheprovider -m "not oracle" tests/unit
bench: setup
	.venv/bin/lmcache-kv-fast bench
lint: setup
	.venv/bin/ruff check lmcache_kv_fast tests benches examples testbed

-include mk/*.mk

# Convenience wrappers; the two README commands are ./scripts/run.sh and ./scripts/test.sh.
.PHONY: setup run test bench lint
setup:
	./scripts/setup.sh
run:
	./scripts/run.sh
test:
	./scripts/test.sh
bench: setup
	.venv/bin/lmcache-kv-fast bench
lint: setup
	.venv/bin/ruff check lmcache_kv_fast tests benches examples

-include mk/*.mk

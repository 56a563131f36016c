# Compatibility matrix against every real LMCache MP server 0.5.1 .. 0.5.7rc2 (tests/compat,
# docs/protocol.md Appendix C, docs/compatibility.md). Included from the Makefile.
#
#   make test-compat   create/reuse one cached venv per old server version under
#                      .venv-compat/<ver> (scripts/compat-venvs.sh; ~1.5 min and 1.3 GB each
#                      the first time, instant afterwards), then run the whole matrix:
#                      version x {SHM, pickle} x {ours->ours, theirs->ours, ours->theirs}.
#
# The 0.5.6 and 0.5.7rc2 rows are unmarked and also run in the default suite
# (`pytest -m "not compat"`; scripts/test.sh makes the 0.5.7rc2 venv); the 0.5.1 .. 0.5.5
# rows carry the `compat` marker (`pytest -m compat tests/compat`).
COMPAT_VERSIONS ?= 0.5.1 0.5.2 0.5.3 0.5.4 0.5.5 0.5.7rc2
COMPAT_PYTEST_ARGS ?= -q

.PHONY: compat-venvs test-compat

compat-venvs:
	./scripts/compat-venvs.sh $(COMPAT_VERSIONS)

test-compat: compat-venvs
	test -x .venv/bin/python || ./scripts/setup.sh
	LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 LMCACHE_DISABLE_BANNER=1 \
	  .venv/bin/python -m pytest -p no:cacheprovider tests/compat $(COMPAT_PYTEST_ARGS)

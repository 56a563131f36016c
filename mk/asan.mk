# ASan/UBSan build and test of the native core (included by the top-level Makefile).
#
#   make native-asan   # build csrc/ with -fsanitize=address,undefined into build/asan
#   make test-asan     # run the native unit tests against that build
#
# The sanitized extension is staged with a copy of the Python package in
# build/asan/stage and the tests run from there with the stage on PYTHONPATH; the
# stage's sitecustomize.py (mk/asan_sitecustomize.py) drops the editable install's
# finder, which would otherwise import the source tree's unsanitized extension, and the
# target checks that the sanitized one is the one imported. Python itself is not
# sanitized, so libasan is preloaded; leak checking is off (CPython and torch keep
# allocations until exit).

ASAN_PYTHON ?= $(abspath .venv/bin/python)
ASAN_BUILD  ?= build/asan
ASAN_STAGE  := $(ASAN_BUILD)/stage
ASAN_TESTS  ?= tests/unit/test_copy_parity.py tests/unit/test_native_safety.py \
               tests/unit/test_tensor_checks.py \
               tests/unit/test_native_cold.py tests/unit/test_edit_kernels.py \
               tests/unit/test_fused_rows.py tests/unit/test_fused_blocks.py
ASAN_LIBS    = $(shell g++ -print-file-name=libasan.so) $(shell g++ -print-file-name=libubsan.so)

.PHONY: native-asan test-asan

native-asan:
	cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DLMCKV_SANITIZE=ON \
	  -DPython_EXECUTABLE=$(ASAN_PYTHON) \
	  -Dpybind11_DIR=$$($(ASAN_PYTHON) -m pybind11 --cmakedir)
	cmake --build $(ASAN_BUILD) -j
	rm -rf $(ASAN_STAGE) && mkdir -p $(ASAN_STAGE)
	cp -r lmcache_kv_fast $(ASAN_STAGE)/
	rm -f $(ASAN_STAGE)/lmcache_kv_fast/_native*.so
	cp $(ASAN_BUILD)/_native*.so $(ASAN_STAGE)/lmcache_kv_fast/
	cp mk/asan_sitecustomize.py $(ASAN_STAGE)/sitecustomize.py

ASAN_ENV = PYTHONPATH=$(abspath $(ASAN_STAGE)) LD_PRELOAD="$(ASAN_LIBS)"

test-asan: native-asan
	cd $(ASAN_STAGE) && $(ASAN_ENV) ASAN_OPTIONS=detect_leaks=0 $(ASAN_PYTHON) -c \
	  "import sys, lmcache_kv_fast._native as n; print('sanitized core:', n.__file__); \
	  sys.exit(0 if n.__file__.startswith('$(abspath $(ASAN_STAGE))/') else 'not staged')"
	cd $(ASAN_STAGE) && \
	  $(ASAN_ENV) \
	  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:allow_user_segv_handler=1 \
	  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  $(ASAN_PYTHON) -m pytest -q -p no:cacheprovider $(addprefix $(CURDIR)/,$(ASAN_TESTS))

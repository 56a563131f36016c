"""The test bed: the real parts the suite, the benchmark and the demo drive beside the SDK.

A real vLLM CPU engine (:mod:`.engine`, in children of ``.venv-engine``), a transformers
oracle (:mod:`.oracle`), a tiny random-weight Llama (:mod:`.tiny_model`), query export
through LMCache's own classes (:mod:`.query_export`), upstream 0.5.6 on a CPU engine
(:mod:`.upstream_cpu`) and other LMCache releases in their own venvs (:mod:`.compat`).
It lives in the checkout, not in the wheel; ``engine_side/`` holds the scripts those
children run in the other venvs.
"""

"""The benchmark harness behind ``lmcache-kv-fast bench`` (see ``benches/README.md``).

It lives outside the installed package. Importing it imports nothing: worker interpreters
(``python -m benches.harness.worker``) load only the modules they need, so the upstream
worker never imports ``lmcache_kv_fast``.
"""

"""Benchmarks of lmcache-kv-fast (a checkout's, not the wheel's): see README.md."""

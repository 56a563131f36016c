"""A CPU "vLLM worker" that stores through lmcache's own lmcache-driven path.

Its stores are what a real GPU engine's look like to the server (docs/protocol.md §10.3):
announced as ``stored`` KV events (SDK stores are not). Used by the events tests and the
fleet's events index test; it needs ``lmcache`` (a test dependency), imported on use. A
server from another venv (``LMCACHE_KV_FAST_TEST_SERVER``, e.g. 0.5.7rc2) gets a writer
running that venv's ``lmcache`` in a child process (``testbed.compat.TheirSDK``).
"""

from __future__ import annotations

import secrets
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from lmcache_kv_fast.testing import LMCacheServer


class LmcDrivenWriter:
    """One lmcache-driven registration (2 layers, NHD, 2 heads of 16, block 16) and its stores."""

    L, NH, HS, BS = 2, 2, 16, 16

    def __init__(self, server: LMCacheServer, model: str, max_tokens: int = 512) -> None:
        self.server, self.model, self.chunk = server, model, server.chunk_size
        nb = max(1, max_tokens // self.BS)
        self.child: Any = None
        if server.version is not None and server.python != sys.executable:
            self._start_child(nb)
            return
        import torch
        from lmcache.utils import EngineType
        from lmcache.v1.multiprocess.group_view import EngineGroupInfo
        from lmcache.v1.multiprocess.transfer_context.worker_transfer import (
            create_transfer_context,
        )
        from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

        self.kv = {f"model.layers.{i}.attn": torch.randn(2, nb, self.BS, self.NH, self.HS,
                                                         dtype=torch.bfloat16)
                   for i in range(self.L)}
        self.client = RequestClientFactory.create(server.url)
        self.tc = create_transfer_context(self.kv, instance_id=secrets.randbits(31) + 1,
                                          req_client=self.client, mode="lmcache_driven")
        self.tc.register(
            self.kv, model, 1, self.chunk // self.BS, 20.0, layout_hints={"kv_layout": "NHD"},
            engine_group_infos=[EngineGroupInfo(engine_group_id=0,
                                                layer_indices=tuple(range(self.L)),
                                                tokens_per_block=self.BS)],
            engine_type=EngineType.VLLM,
        )

    def _start_child(self, nb: int) -> None:
        """Register through the server version's own lmcache, in a child of its venv."""
        from testbed.compat import TheirSDK

        self._workdir = Path(tempfile.mkdtemp(prefix="lmckvf-lmc-writer-"))
        self.child = TheirSDK(self.server.version, self.server.url, self.server.http_url,
                              self._workdir).start()
        try:
            self.iid = self.child.register_nhd(self.model, num_layers=self.L,
                                               num_kv_heads=self.NH, head_size=self.HS,
                                               block_size=self.BS, num_blocks=nb)
        except BaseException:
            self._stop_child()
            raise

    def _stop_child(self) -> None:
        self.child.stop()
        shutil.rmtree(self._workdir, ignore_errors=True)

    def layout(self) -> Any:
        """The registration's geometry as a :class:`~lmcache_kv_fast.KVLayout`."""
        from lmcache_kv_fast import KVLayout

        return KVLayout(self.L, self.NH, self.HS, "bfloat16", block_size=self.BS)

    def store(self, tokens: list[int]) -> None:
        """Store ``tokens`` (whole blocks) the engine's way, then end the session like vLLM."""
        if self.child is not None:
            self.child.lmc_store(self.iid, tokens)
            return
        from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey

        from lmcache_kv_fast.protocol.ops import Op
        from lmcache_kv_fast.transport.zmq_client import ZmqClient

        key = IPCCacheServerKey(
            model_name=self.model, world_size=1, worker_id=0, token_ids=tokens, start=0,
            end=len(tokens), request_id=f"lmc-{secrets.token_hex(4)}", cache_salt="",
            num_kv_readers=1,
        )
        fut = self.tc.submit_store(key.request_id, key, self.kv,
                                   [list(range(len(tokens) // self.BS))],
                                   self.tc.create_recorded_event(), self.chunk // self.BS)
        assert fut.result(timeout=20) is not None
        zc = ZmqClient(self.server.url, self.server.generation, 10.0)
        try:
            zc.call(Op.END_SESSION, [key.request_id])
        finally:
            zc.close()

    def close(self, unregister: bool = True) -> None:
        """Unregister (unless ``unregister`` is False: the server is gone) and close."""
        if self.child is not None:
            try:
                if unregister:
                    self.child.unregister(self.iid)
            finally:
                self._stop_child()
            return
        try:
            if unregister:
                fut = self.tc.unregister()
                if fut is not None:
                    fut.result(timeout=5)
        finally:
            self.tc.close()
            self.client.close()

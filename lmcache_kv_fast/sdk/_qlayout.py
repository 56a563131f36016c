"""The geometry of query tensors, from the server's query registration.

An engine that exports query tensors (LMCache's query capture, server started with
``--enable transfer_query`` up to 0.5.6, with the ``qstore`` server module from 0.5.7 on)
registers a paged query ring for ``<model>##query``;
``/status`` lists it under ``q_context_meta`` (one entry per instance) with the ring's
layout in ``q_ring_layout``, the same shape of record as a KV registration's
``kv_cache_layout``: one kernel group, format ``NL_X_NB_BS_HS`` (one plane), width
``num_q_heads · head_size``. Query objects are therefore single-plane chunks
``[L, C, Hq·Dh]``.

Upstream 0.5.6 derives the query geometry from the model's KV registration instead
(one head of the KV head size), which is not the width of the stored query objects;
this module reads the query registration itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lmcache_kv_fast.errors import KVCacheSDKError
from lmcache_kv_fast.layout import KVLayout, decode_status_entry

__all__ = ["QueryLayoutError", "query_entries", "query_layout"]


class QueryLayoutError(KVCacheSDKError):
    """The server has no usable query registration for the model."""


def query_entries(status: Mapping[str, Any], server_model_name: str
                  ) -> list[tuple[str, Mapping[str, Any]]]:
    """The query registrations of ``server_model_name`` (``<model>##query``) in ``/status``.

    Returns:
        ``(instance_id, entry)`` pairs; empty when there is none (or the server has no
        query module).
    """
    meta = status.get("q_context_meta") if isinstance(status, Mapping) else None
    if not isinstance(meta, Mapping):
        return []
    return [(str(iid), e) for iid, e in meta.items()
            if isinstance(e, Mapping) and e.get("model_name") == server_model_name]


def query_layout(status: Mapping[str, Any], server_model_name: str, chunk_size: int,
                 where: str = "the server") -> tuple[KVLayout, int]:
    """The single-plane layout and world size of ``server_model_name``'s query objects.

    Args:
        status: The decoded ``GET /status`` reply.
        server_model_name: ``<model>##query``.
        chunk_size: The server's chunk size.
        where: How to name the server in messages (its HTTP URL).

    Returns:
        ``(layout, world_size)``: ``KVLayout(num_layers, 1, Hq·Dh, dtype, block_size,
        mla=True)`` and the registration's world size.

    Raises:
        QueryLayoutError: No query registration (the message says what the server and
            the engine need), registrations that disagree, or a layout that is not one
            plane of one group.
    """
    found = query_entries(status, server_model_name)
    if not found:
        enabled = "registered_q_ids" in status if isinstance(status, Mapping) else False
        known = sorted({str(e.get("model_name")) for e in
                        (status.get("q_context_meta") or {}).values() if isinstance(e, Mapping)}
                       ) if enabled else []
        why = ("the server runs without the query module: start it with "
               "'--enable transfer_query --supported-transfer-mode auto' (LMCache <= 0.5.6) "
               "or '--server-module "
               "{\"module_path\":\"lmcache.v1.multiprocess.plugin_modules.qstore\"} "
               "--supported-transfer-mode auto' (0.5.7+)"
               if not enabled else
               f"no engine has registered a query ring for it (query registrations: "
               f"{known or 'none'}); the engine must export query tensors "
               "(LMCache's query capture) for this model")
        raise QueryLayoutError(f"no query layout for {server_model_name!r} on {where}: {why}")
    layouts: list[tuple[KVLayout, int]] = []
    for iid, entry in found:
        ring = entry.get("q_ring_layout")
        if not isinstance(ring, Mapping):
            raise QueryLayoutError(
                f"q_context_meta[{iid!r}] of {server_model_name!r} has no q_ring_layout object "
                f"(got {type(ring).__name__})")
        decoded = decode_status_entry({"model_name": entry.get("model_name"),
                                       "world_size": entry.get("world_size", 1),
                                       "kv_cache_layout": ring}, chunk_size)
        decoded.require_single_group()
        lay = KVLayout.from_decoded(decoded)
        if lay.planes != 1:
            raise QueryLayoutError(
                f"the query ring of {server_model_name!r} (instance {iid}) decodes to a "
                f"two-plane layout ({lay}); query objects are one plane")
        layouts.append((lay, decoded.world_size))
    first = layouts[0]
    for other in layouts[1:]:
        if other != first:
            raise QueryLayoutError(
                f"the query registrations of {server_model_name!r} disagree: {first} vs {other}")
    return first

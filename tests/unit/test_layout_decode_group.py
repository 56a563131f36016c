"""decode_group's exact results, messages and check order (docs/protocol.md §6).

test_layout_decode.py covers every format and most error paths through
decode_status_entry; these pin what it leaves thin: compressed groups, the hybrid
(``require_hidden=False``) path, the MLA flag both ways, full error texts, and which
error wins when several fields are bad.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from lmcache_kv_fast.errors import KVCacheSDKError
from lmcache_kv_fast.layout.decode_group import decode_group
from lmcache_kv_fast.layout.decoded import DecodedGroup
from lmcache_kv_fast.layout.formats import get_format

MHA = "NL_X_TWO_NB_BS_NH_HS"
MHA_SHAPE = "3 x [2, 7, 16, 4, 64]"  # NL 3, NB 7, BS 16, NH 4, HS 64: D 256
MHA_CPS = 2 * 3 * 256 * 2
CS = "NL_X_NB_NH_BS_CS"
CS_UNKNOWN = f"Unknown (EngineKVFormat.{CS})"


def make_kg(fmt: str, shape: str, *, first_layer: int = 0, tokens: int = 16,
            slots: int | None = None, dtype: str = "torch.bfloat16", idx: int = 0,
            engine_group: int = 0) -> dict[str, Any]:
    """A three-layer kernel group as 0.5.6 reports it."""
    spec = get_format(fmt)
    return {
        "kernel_group_idx": idx, "engine_group_idx": engine_group, "object_group_idx": 0,
        "num_layers": 3, "layer_indices": list(range(first_layer, first_layer + 3)),
        "tokens_per_block": tokens, "slots_per_block": tokens if slots is None else slots,
        "dtype": dtype, "engine_kv_concrete_shape": shape, "is_mla": spec.is_mla,
        "engine_kv_format": fmt, "engine_kv_shape": spec.symbolic_shape,
    }


def dec(kg: Any, cps: int | None = None, *, position: int = 0,
        require_hidden: bool = True) -> DecodedGroup:
    return decode_group(kg, cache_size_per_token=cps, where="kg", position=position,
                        require_hidden=require_hidden)


def err(kg: Any, cps: int | None = None, **kw: Any) -> str:
    with pytest.raises(KVCacheSDKError) as info:
        dec(kg, cps, **kw)
    assert type(info.value) is KVCacheSDKError
    return str(info.value)


def test_every_field_of_a_decoded_group() -> None:
    kg = make_kg(MHA, MHA_SHAPE, first_layer=2, idx=5, engine_group=1)
    kg["object_group_idx"] = 3
    assert dec(kg, MHA_CPS) == DecodedGroup(
        format_name=MHA, format_value=1, kernel_group_idx=5, engine_group_idx=1,
        object_group_idx=3, planes=2, num_layers=3, layer_indices=(2, 3, 4), num_heads=4,
        head_size=64, hidden_size=256, block_size=16, slots_per_block=16,
        dtype="bfloat16", itemsize=2, is_mla=False, concrete_shape=MHA_SHAPE,
    )


def test_position_is_the_default_kernel_group_idx() -> None:
    kg = make_kg(MHA, MHA_SHAPE, idx=4)
    assert dec(kg, position=2).kernel_group_idx == 4
    del kg["kernel_group_idx"]
    assert dec(kg, position=2).kernel_group_idx == 2


def test_object_group_idx_checked() -> None:
    kg = make_kg(MHA, MHA_SHAPE)
    kg["object_group_idx"] = "0"
    assert err(kg) == "kg.object_group_idx: expected an int >= 0, got '0' (str)"


def test_is_mla_false_on_an_mla_format() -> None:
    kg = make_kg("NL_X_NB_BS_HS", "3 x [7, 16, 576]")
    kg["is_mla"] = False
    assert err(kg) == (
        "kg.is_mla is False but format NL_X_NB_BS_HS is MLA: the server's format table "
        "differs from LMCache 0.5.6's"
    )


def test_symbolic_shape_warning_text_and_non_str_ignored(
    caplog: pytest.LogCaptureFixture,
) -> None:
    kg = make_kg(MHA, MHA_SHAPE)
    kg["engine_kv_shape"] = "NL x [X]"
    with caplog.at_level(logging.WARNING, logger="lmcache_kv_fast.layout.decode_group"):
        assert dec(kg).hidden_size == 256
        kg["engine_kv_shape"] = 7
        assert dec(kg).hidden_size == 256
    assert [r.getMessage() for r in caplog.records] == [
        f"kg.engine_kv_shape is 'NL x [X]', expected 'NL x [2, NB, BS, NH, HS]' for {MHA}; "
        "decoding by the format name"
    ]


def test_unknown_placeholder_with_leading_blanks() -> None:
    assert err(make_kg(MHA, "  Unknown (x)")) == (
        f"kg.engine_kv_concrete_shape is '  Unknown (x)', but LMCache 0.5.6 prints a "
        f"concrete shape for {MHA}"
    )
    assert dec(make_kg(CS, "  " + CS_UNKNOWN), 3 * 512 * 2).hidden_size == 512


def test_compressed_group_divides_bytes_by_the_ratio() -> None:
    kg = make_kg(MHA, MHA_SHAPE, tokens=64, slots=16)  # 4 tokens per slot
    g = dec(kg, MHA_CPS // 4)
    assert (g.block_size, g.slots_per_block, g.hidden_size, g.compress_ratio) == (64, 16, 256, 4)
    assert err(kg, MHA_CPS) == (
        f"kg: decoded {MHA} '{MHA_SHAPE}' as planes 2 x layers 3 x D 256 (NH 4 x head_size "
        f"64) x 2 B = {MHA_CPS // 4} bytes per token, but cache_size_per_token is {MHA_CPS}"
    )
    unknown = make_kg(CS, CS_UNKNOWN, tokens=64, slots=16)
    assert dec(unknown, 3 * 512 * 2 // 4).hidden_size == 512


def test_two_hs_mismatch_reports_the_packed_reading() -> None:
    fmt = "NL_X_NB_BS_NH_TWO_HS"
    shape = "3 x [7, 16, 4, 2, 64]"
    assert err(make_kg(fmt, shape), 999) == (
        f"kg: decoded {fmt} '{shape}' as planes 1 x layers 3 x D 256 (NH 4 x head_size 64) "
        "x 2 B = 1536 bytes per token, but cache_size_per_token is 999"
    )


@pytest.mark.parametrize("cps", [0, 1001])
def test_underivable_hidden_size_text(cps: int) -> None:
    assert err(make_kg(CS, CS_UNKNOWN), cps) == (
        f"kg: cannot derive D for {CS} from cache_size_per_token {cps}: not a positive "
        "multiple of planes 1 x layers 3 x 2 B"
    )


def test_hidden_size_required_text() -> None:
    assert err(make_kg(CS, CS_UNKNOWN)) == (
        f"kg: the concrete shape '{CS_UNKNOWN}' of {CS} does not carry the hidden size; it "
        "can only be derived from cache_size_per_token of a single-group entry"
    )


def test_hidden_size_left_unknown_when_not_required() -> None:
    g = dec(make_kg(CS, CS_UNKNOWN), require_hidden=False)
    assert (g.num_heads, g.head_size, g.hidden_size) == (None, None, None)
    dsa = make_kg("NL_X_NB_BSV_BSS", "3 x [7, 16, 16]", dtype="torch.uint8")
    g = dec(dsa, require_hidden=False)
    assert (g.num_heads, g.head_size, g.hidden_size, g.is_mla) == (1, None, None, True)
    g = dec(dsa, 3 * 132)
    assert (g.num_heads, g.head_size, g.hidden_size) == (1, 132, 132)
    # a printed head size needs no cache_size_per_token, required or not
    assert dec(make_kg(MHA, MHA_SHAPE), require_hidden=False).hidden_size == 256


@pytest.mark.parametrize(
    ("bad", "first"),
    [
        ({"engine_kv_format": "NEW", "engine_kv_concrete_shape": 5}, "unknown engine KV format"),
        ({"engine_kv_concrete_shape": 5, "num_layers": 0}, "kg.engine_kv_concrete_shape: expected"),
        ({"num_layers": 0, "layer_indices": "x"}, "kg.num_layers: expected"),
        ({"layer_indices": [0], "tokens_per_block": 0}, "kg.layer_indices has 1 entries"),
        ({"tokens_per_block": 0, "slots_per_block": 0}, "kg.tokens_per_block: expected"),
        ({"slots_per_block": 0, "dtype": "x"}, "kg.slots_per_block: expected"),
        ({"dtype": "x", "kernel_group_idx": -1}, "kg.dtype: expected"),
        ({"kernel_group_idx": -1, "engine_group_idx": -1}, "kg.kernel_group_idx: expected"),
        ({"engine_group_idx": -1, "object_group_idx": -1}, "kg.engine_group_idx: expected"),
        ({"object_group_idx": -1, "is_mla": 1}, "kg.object_group_idx: expected"),
        ({"is_mla": True, "engine_kv_concrete_shape": "junk"}, "kg.is_mla is True"),
        ({"engine_kv_concrete_shape": "3 x [2, 7, 16, 4]"}, "does not fit"),
        ({"engine_kv_concrete_shape": "4 x [2, 7, 32, 4, 64]"}, "has NL = 4"),
    ],
)
def test_first_bad_field_wins(bad: dict[str, Any], first: str) -> None:
    kg = make_kg(MHA, MHA_SHAPE)
    kg.update(bad)
    assert first in err(kg, 1)


def test_block_size_checked_before_bytes_per_token() -> None:
    kg = make_kg(MHA, "3 x [2, 7, 32, 4, 64]")
    assert "has BS = 32" in err(kg, 1)

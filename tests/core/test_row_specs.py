"""What a slot of the packed kinds costs a token: a compressed row serves ``tokens_per_row`` tokens, a window page
``page_tokens`` (the engine sizes its blocks for ``--memory`` by these)."""

from __future__ import annotations

from kvgroups import CompressedRows, WindowPages


def test_a_packed_slot_costs_each_token_it_serves_its_share() -> None:
    # Their own costs, not the inherited one of a slot per token.
    assert "bytes_per_token" in vars(CompressedRows) and "bytes_per_token" in vars(WindowPages)
    assert CompressedRows(tokens_per_row=4).bytes_per_token(584) == 146
    assert CompressedRows(tokens_per_row=128).bytes_per_token(584) == 584 / 128
    assert WindowPages(page_tokens=64, pages=2).bytes_per_token(37440) == 585
    assert WindowPages(page_tokens=8, pages=16).bytes_per_token(32832) == 4104

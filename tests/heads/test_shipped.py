"""The heads shipped as package data (heads/shipped.py): found by method and registered model name,
none for a model without one. (The shipped head drafting the default model: tests/heads/test_eagle3.py.)"""

from __future__ import annotations

from tokenleap.heads.shipped import HEADS_DIR, shipped_head, shipped_heads


def test_the_shipped_head_is_found_by_method_and_model() -> None:
    assert "smollm2-135m-instruct-eagle3" in shipped_heads()
    assert shipped_head("eagle3", "smollm2-135m-instruct") == HEADS_DIR / "smollm2-135m-instruct-eagle3"
    assert shipped_head("eagle3", None) is None
    assert shipped_head("eagle3", "tiny") is None
    assert shipped_head("medusa", "smollm2-135m-instruct") is None

"""``serve.py`` argument checks that refuse before any model is loaded."""

from __future__ import annotations

import pytest

from k3_jax.cli import serve


def test_page_size_without_a_paged_cache_is_refused_naming_the_flag():
    with pytest.raises(SystemExit, match=r"--page-size 16 sets the paged cache's page tokens: add --paged"):
        serve.main(["--config", "configs/k3-tiny.json", "--page-size", "16", "--prompt", "hi"])

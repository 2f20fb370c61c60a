"""The released K3 index (497,220 names): every name maps to configs/k3.json (text and vision); bytes exact."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

from k3_jax.config import config_path
from k3_jax.convert import verify
from k3_jax.convert.__main__ import main

SHARED = Path(os.environ.get("K3_SHARED", Path(__file__).resolve().parents[2] / "shared"))
INDEX = SHARED / "reference" / "model.safetensors.index.json.gz"
CONFIG = SHARED / "reference" / "config.json"


@pytest.fixture(scope="module")
def index_path():
    if not INDEX.exists():
        pytest.skip(f"released index not found at {INDEX} (shared/ sits beside the clone in CI)")
    return INDEX


def test_every_release_name_maps_and_bytes_are_exact(index_path):
    rep = verify(index_path, config_path("k3"))
    assert rep.ok, rep.errors
    assert rep.unknown == 0 and rep.vision == 0  # vision = recognised but not in the config: none
    assert rep.mapped == 497_220  # incl. 168 vision: 27 ViT blocks x 6 + patch embed (2) + final norm + projector (3)
    assert rep.bytes == rep.declared == 1_560_860_324_864


def test_cli_verify_index_with_published_config(index_path, capsys):
    if not CONFIG.exists():
        pytest.skip(f"{CONFIG} not found")
    rc = main(["verify", str(index_path), "--config", str(CONFIG)])
    out = capsys.readouterr().out.strip().splitlines()[-1]
    assert rc == 0
    assert out == "mapped=497220 vision=0 unknown=0 bytes=1560860324864 declared=1560860324864"


def test_alternate_prefix_and_wrong_config_detected(index_path, tmp_path):
    with gzip.open(index_path, "rt") as f:
        raw = json.load(f)
    wm = raw["weight_map"]
    # the SGLang-mapped variant language_model.layers.* is accepted
    alt = {k.replace("language_model.model.layers.", "language_model.layers."): v for k, v in wm.items()}
    p = tmp_path / "alt.json"
    p.write_text(json.dumps({"metadata": raw["metadata"], "weight_map": alt}))
    rep = verify(p, config_path("k3"))
    assert rep.ok and rep.bytes == 1_560_860_324_864, rep.errors
    # a config that does not match the tensors (tiny config against the real index) fails loudly
    some = dict(list(wm.items())[:5000])
    p2 = tmp_path / "some.json"
    p2.write_text(json.dumps({"metadata": raw["metadata"], "weight_map": some}))
    rep = verify(p2, config_path("k3-tiny"))
    assert not rep.ok and rep.unknown > 0
    assert "does not exist for this config" in rep.errors[0] or "unknown tensor" in rep.errors[0]

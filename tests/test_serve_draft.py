"""``serve.py --draft DIR``: the terminal path and the OpenAI HTTP server (the app the CLI builds, served by uvicorn
in a thread) produce exactly the greedy text the same target gives without a draft, the speculative engine having
run (its round counters); bad draft directories are refused naming the directory and what is wrong.

Target: a two-layer (KDA, MLA) fp32 model of width 64 over the bundled tokenizer's 1,024 ids, random weights from
``--init-seed``; the draft: an MLA draft layer initialised at random and exported as the draft trainer exports it
(a random draft is almost always rejected: every round verifies ``k + 1`` tokens and rolls the KDA state back to
the first, which is what the outputs check; partial acceptances are tests/test_speculative.py's)."""

from __future__ import annotations

import contextlib
import io
import json
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from k3_jax.cli import serve
from k3_jax.draft import DraftConfig, DraftModel
from k3_jax.training.draft import export_draft
from tests.test_speculative import micro_config

PROMPT = "def main():"
NEW = 10


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """``(config.json, draft dir)`` of the target and its draft."""
    root = tmp_path_factory.mktemp("serve_draft")
    cfg = micro_config(vocab=1024)
    config = root / "config.json"
    config.write_text(json.dumps(cfg.to_hf_dict()))
    dcfg = DraftConfig((0, 1), "mla")
    d = cfg.hidden_size
    variables = jax.jit(DraftModel(cfg, dcfg).init)(
        jax.random.PRNGKey(3), jnp.zeros((1, 2, 2 * d)), jnp.zeros((1, 2), jnp.int32),
        jnp.zeros((cfg.vocab_size, d)), jnp.zeros((d, cfg.vocab_size)))
    draft = export_draft(root / "draft", dcfg, nn.unbox(variables)["params"])
    return config, draft


def _serve(argv: list[str]) -> tuple[str, str]:
    """``serve.main(argv)``'s stdout and stderr (not capsys: uvicorn's logging setup in the server test would keep
    capsys's stream past the test)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert serve.main(argv) == 0
    return out.getvalue(), err.getvalue()


def _argv(config, *extra: str) -> list[str]:
    return ["--config", str(config), "--init-seed", "0", "--max-batch", "2", "--max-len", "48", "--prefill-chunk", "8",
            "--max-tokens", str(NEW), "--quiet", *extra]


def test_cli_and_http_server_with_a_draft_give_the_plain_greedy_text(dirs, monkeypatch):
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from tests.serving_common import running_server

    config, draft = dirs
    plain, plain_err = _serve(_argv(config, "--prompt", PROMPT))
    spec, spec_err = _serve(_argv(config, "--prompt", PROMPT, "--draft", str(draft), "--draft-tokens", "3"))
    n = int(re.search(r"\[(\d+) tokens", plain_err).group(1))
    assert n >= 4 and plain.strip(), plain_err  # enough text to compare
    assert spec == plain
    stats = re.search(r"\[speculative: .*'rounds': (\d+).*'emitted': (\d+)", spec_err)
    assert stats and int(stats.group(1)) >= 1 and int(stats.group(2)) == n - 1, spec_err  # + the prefill's token

    apps = []
    monkeypatch.setattr("uvicorn.run", lambda app, **kw: apps.append(app))
    _serve(_argv(config, "--port", "0", "--draft", str(draft), "--draft-tokens", "3"))
    with running_server(apps[0]) as (client, _):
        r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": NEW, "temperature": 0})
        r2 = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": NEW, "temperature": 0,
                                                  "stream": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == plain
    streamed = [json.loads(line[6:]) for line in r2.text.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in streamed) == plain


def test_bad_draft_dirs_are_refused_naming_them(dirs, tmp_path, monkeypatch):
    """A missing directory, one without params/ and one with a bad draft config are refused before the target is
    loaded; a draft exported for another target width is refused naming its mismatched parameters."""
    config, draft = dirs
    cases = {
        tmp_path / "missing": "no draft config",
        tmp_path / "no_params": "no params/ directory",
        tmp_path / "bad_json": "bad draft config.*unknown fields",
    }
    (tmp_path / "no_params").mkdir()
    (tmp_path / "no_params" / "draft_config.json").write_text((draft / "draft_config.json").read_text())
    (tmp_path / "bad_json").mkdir()
    (tmp_path / "bad_json" / "draft_config.json").write_text('{"feature_layers": [0, 1], "width": 3}')
    load_model = serve.load_model
    with monkeypatch.context() as m:
        m.setattr(serve, "load_model", lambda *a: pytest.fail("the target was loaded before the draft was checked"))
        for path, words in cases.items():
            with pytest.raises(SystemExit, match=rf"--draft {re.escape(str(path))}: .*{words}"):
                serve.main(_argv(config, "--prompt", PROMPT, "--draft", str(path)))
    assert serve.load_model is load_model

    wide = micro_config(vocab=1024).replace(hidden_size=96)
    dcfg = DraftConfig((0, 1), "mla")
    variables = jax.jit(DraftModel(wide, dcfg).init)(
        jax.random.PRNGKey(3), jnp.zeros((1, 2, 2 * 96)), jnp.zeros((1, 2), jnp.int32), jnp.zeros((1024, 96)),
        jnp.zeros((96, 1024)))
    other = export_draft(tmp_path / "other", dcfg, nn.unbox(variables)["params"])
    with pytest.raises(SystemExit, match=rf"--draft {re.escape(str(other))}: .*params: not a draft for this target "
                                         r"\(hidden_size 64.*\['fc'\]\['kernel'\]: expected shape \(128, 64\), got "
                                         r"\(192, 96\)"):
        serve.main(_argv(config, "--prompt", PROMPT, "--draft", str(other)))

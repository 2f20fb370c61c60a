"""Serve a K3 model: stream a completion to the terminal, or run an OpenAI-compatible HTTP server.

    python serve.py --checkpoint DIR --prompt "Once upon a time"        # stream text to the terminal
    python serve.py --checkpoint DIR --prompt "Hi" --chat               # same, through the chat template
    python serve.py --checkpoint DIR --port 8000                        # /v1/completions, /v1/chat/completions
    python serve.py --config configs/k3-tiny.json --prompt "def f("     # RANDOM weights (demo only)
    python serve.py --checkpoint DIR --chat --prompt "What is this?" --image cat.png   # a vision model
    python serve.py --checkpoint DIR --draft DRAFT_DIR --prompt "Hi"    # speculative decoding with a draft
    python serve.py --set kda_implementation=triton --prompt "Hi"       # a kernel backend (python -m k3_jax.kernels)
    python serve.py --checkpoint DIR --draft DRAFT_DIR --prefix-cache --prefix-kda-gb 8 --prefix-mla-gb 16 --port 8000
    python serve.py --checkpoint DIR --mesh tensor=8 --prompt "Hi"     # the model split over 8 local devices

``--checkpoint`` accepts an HF checkpoint directory (``config.json`` + safetensors index, loaded with
:func:`k3_jax.convert.load_checkpoint`; MXFP4 experts stay packed with ``--experts mxfp4``) or an orbax
directory written by the converter (then ``--config`` or ``DIR/config.json`` gives the architecture). The
tokenizer is the checkpoint's ``tiktoken.model`` when present, else the bundled small tokenizer. ``--mesh`` (one
process, several devices): the model and the draft are split over the mesh by the ``--sharding-preset`` rules
(an orbax checkpoint is read straight onto it), see :class:`k3_jax.serving.engine.Engine`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

DEFAULT_CONFIG = "configs/k3-tiny.json"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", help="HF checkpoint dir or orbax dir from the converter")
    p.add_argument("--config", help=f"config JSON (default with no checkpoint: {DEFAULT_CONFIG}, random init)")
    p.add_argument("--tokenizer", help="dir with tiktoken.model, or 'bundled' (default: from the checkpoint)")
    p.add_argument("--experts", choices=["bf16", "mxfp4"], help="routed-expert format to load")
    p.add_argument("--dtype", default=None, help="compute dtype (default: the config's)")
    p.add_argument("--prompt", help="generate for this prompt and stream it to stdout, then exit")
    p.add_argument("--chat", action="store_true", help="wrap --prompt in the chat template as a user turn")
    p.add_argument("--system", default=None, help="system message for --chat")
    p.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="with --chat: an image file after the prompt's text (repeatable; needs a vision model)")
    p.add_argument("--image-dir", default=None, metavar="DIR",
                   help="HTTP server: also read image_url file:// URLs / paths under DIR (default: data URLs only)")
    p.add_argument("--max-images", type=int, default=8, help="HTTP server: images per request")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, help="run the HTTP server on this port")
    p.add_argument("--model-name", default=None, help="model id reported by /v1/models")
    p.add_argument("--max-batch", type=int, default=8, help="decode slots")
    p.add_argument("--max-len", type=int, default=1024, help="tokens per slot (prompt + output)")
    p.add_argument("--prefill-chunk", type=int, default=64)
    p.add_argument("--prefix-cache", action="store_true",
                   help="reuse cached prompt prefixes across requests (paged latent cache; needs both budgets)")
    p.add_argument("--prefix-kda-gb", type=float, default=None, help="prefix cache: KDA snapshot budget (GB)")
    p.add_argument("--prefix-mla-gb", type=float, default=None, help="prefix cache: MLA page budget (GB)")
    p.add_argument("--paged", action="store_true",
                   help="page the MLA latent cache (requests reserve pages of one pool; implied by --prefix-cache)")
    p.add_argument("--page-size", type=int, default=None,
                   help="MLA page tokens of the paged cache (default 16; with --prefix-cache 6144)")
    p.add_argument("--prefix-block", type=int, default=512, help="prefix cache: hash block tokens")
    p.add_argument("--prefix-stride", type=int, default=8192, help="prefix cache: KDA snapshot stride (tokens)")
    p.add_argument("--decode-block", type=int, default=1,
                   help="decode steps (with --draft: speculative rounds) per device call (tokens stream in bursts; "
                        "see Engine)")
    p.add_argument("--draft", default=None,
                   help="speculative decoding with this draft dir (from python -m k3_jax.training.draft)")
    p.add_argument("--draft-tokens", type=int, default=4, help="with --draft: tokens drafted per round (k)")
    p.add_argument("--mesh", default=None,
                   help="split the model over this process's devices, e.g. tensor=8 (axes of sharding.make_mesh)")
    p.add_argument("--sharding-preset", default="serve", help="with --mesh: the sharding.rules preset")
    p.add_argument("--max-request-bytes", type=int, default=None,
                   help="HTTP request bodies over this many bytes get 413 before parsing (default: 4 MiB)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a model-config field (repeatable; JSON values), e.g. kda_implementation=triton "
                        "(python -m k3_jax.kernels lists what each kernel field runs)")
    p.add_argument("--init-seed", type=int, default=0, help="seed of the random init (no checkpoint)")
    p.add_argument("--quiet", action="store_true", help="no progress lines (checkpoint loading, long prefills)")
    return p.parse_args(argv)


def _warn(msg: str) -> None:
    bar = "!" * 78
    print(f"\n{bar}\n{msg}\n{bar}\n", file=sys.stderr, flush=True)


def load_model(args: argparse.Namespace, mesh=None):
    """Returns ``(cfg, params, tokenizer, name)``; with ``mesh`` an orbax checkpoint is read onto it."""
    import jax

    from k3_jax.config import load_config
    from k3_jax.tokenizer import Tokenizer

    if args.dtype is None and jax.default_backend() == "cpu":
        # XLA:CPU cannot run the model's bf16 x bf16 -> f32 dots (DotThunk); compute in fp32 there.
        args.dtype = "float32"
        print("note: CPU backend, computing in float32 (pass --dtype to override)", file=sys.stderr)
    overrides = config_overrides(args)
    ckpt = Path(args.checkpoint) if args.checkpoint else None
    if ckpt is not None and not ckpt.exists():
        raise SystemExit(f"--checkpoint {ckpt}: no such directory")
    if ckpt is not None and (ckpt / "model.safetensors.index.json").exists():
        from k3_jax.convert import load_checkpoint

        cfg, params = load_checkpoint(ckpt, experts=args.experts, **overrides)
        name = ckpt.name
    elif ckpt is not None:
        from k3_jax.convert.orbax_io import restore_params

        cfg_path = args.config or (ckpt / "config.json")
        if not Path(cfg_path).exists():
            raise SystemExit(f"{ckpt} looks like an orbax checkpoint: pass --config (no {ckpt / 'config.json'})")
        cfg = load_config(cfg_path).replace(**overrides)
        if args.experts:
            cfg = cfg.replace(expert_format=args.experts)
        params = restore_params(ckpt, None if mesh is None else _sharded_target(cfg, mesh, args.sharding_preset))
        name = ckpt.name
    else:
        cfg_path = args.config or DEFAULT_CONFIG
        cfg = load_config(cfg_path).replace(**overrides)
        _warn(f"NO CHECKPOINT: serving RANDOMLY INITIALISED weights of {cfg_path} (demo only; output is noise).")
        from k3_jax.convert.fixture import random_params

        params = random_params(cfg, seed=args.init_seed, experts=cfg.expert_format)
        if cfg.vision is not None:
            from k3_jax.convert.fixture import random_vision_params

            params.update(random_vision_params(cfg.vision, seed=args.init_seed))
        name = f"{Path(cfg_path).stem}-random"
    if args.tokenizer:
        tok = Tokenizer.load(args.tokenizer)
    elif ckpt is not None and (ckpt / "tiktoken.model").exists():
        tok = Tokenizer.from_pretrained(ckpt)
    else:
        tok = Tokenizer.bundled(media=cfg.vision is not None)
        if ckpt is not None:
            _warn(f"{ckpt} has no tiktoken.model: using the bundled small tokenizer")
    if tok.vocab_size > cfg.vocab_size:
        raise SystemExit(f"tokenizer has {tok.vocab_size} ids but the model's vocab_size is {cfg.vocab_size}")
    return cfg, params, tok, args.model_name or name


def config_overrides(args: argparse.Namespace) -> dict:
    """The model-config fields ``--dtype`` and ``--set`` change; SystemExit naming a bad item or a key that is not
    a :class:`~k3_jax.config.K3Config` field."""
    from k3_jax.config import parse_overrides, unknown_fields
    from k3_jax.errors import ConfigError

    try:
        overrides = parse_overrides(args.set)
    except ConfigError as e:
        raise SystemExit(str(e)) from None
    unknown = unknown_fields(overrides)
    if unknown:
        raise SystemExit(f"--set {', '.join(unknown)}: not a model-config field (K3Config), e.g. kda_implementation, "
                         "moe_implementation, mla_decode_attention_implementation, mla_paged_decode_implementation")
    if args.dtype:
        overrides["dtype"] = args.dtype
    return overrides


def _sharded_target(cfg, mesh, preset: str):
    """Abstract params of ``cfg`` placed on ``mesh`` by their logical names (orbax restores straight onto it)."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from k3_jax.model import K3ForCausalLM
    from sharding.rules import param_shardings

    boxed = jax.eval_shape(K3ForCausalLM(cfg).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    return jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s), nn.unbox(boxed),
                        param_shardings(boxed, mesh, preset))


def _check_draft_dir(directory: str) -> None:
    """Refuse a ``--draft`` directory without a readable draft config or params before the target is loaded (which
    may take minutes); whether the draft fits the target is checked once the target's config is known."""
    from k3_jax.draft import DraftConfig

    try:
        DraftConfig.load(directory)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"--draft {directory}: {e}") from None
    if not (Path(directory) / "params").is_dir():
        raise SystemExit(f"--draft {directory}: no params/ directory (expected the orbax params the draft trainer "
                         "exports beside draft_config.json)")


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.prompt is None and args.port is None:
        raise SystemExit("give --prompt TEXT (terminal) or --port N (HTTP server)")
    if args.image and not (args.chat and args.prompt is not None):
        raise SystemExit("--image goes with --chat --prompt TEXT")
    if args.page_size is not None and not (args.paged or args.prefix_cache):
        raise SystemExit(f"--page-size {args.page_size} sets the paged cache's page tokens: add --paged (or "
                         "--prefix-cache)")
    if int(os.environ.get("JAX_NUM_PROCESSES", "1")) > 1:
        raise SystemExit("serve.py runs in one process on one device; a mesh spanning processes is not supported "
                         "for serving (README: Run on several hosts)")
    os.environ.setdefault("XLA_FLAGS", "")
    from k3_jax import progress

    progress.set_quiet(args.quiet)  # progress (checkpoint load, long prefills) goes to the log below
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("k3_jax").setLevel(logging.INFO)
    from k3_jax import compile_cache

    compile_cache.enable()
    from k3_jax.serving.chat import chat_prompt_ids, chat_stop_ids
    from k3_jax.serving.engine import Engine
    from k3_jax.serving.sampling import SamplingParams

    mesh = None
    if args.mesh:
        from sharding.mesh import make_mesh

        mesh = make_mesh(args.mesh)
    if args.draft:
        _check_draft_dir(args.draft)
    from k3_jax.errors import ConfigError

    try:
        cfg, params, tok, name = load_model(args, mesh)
    except ConfigError as e:
        raise SystemExit(f"config: {e}") from None
    eos = (tok.eos_id,) if tok.eos_id is not None else ()
    prefix = None
    if args.prefix_cache:
        from k3_jax.serving.prefix_cache import PrefixCacheConfig

        if args.prefix_kda_gb is None or args.prefix_mla_gb is None:
            raise SystemExit("--prefix-cache needs --prefix-kda-gb and --prefix-mla-gb (the cache's byte budgets)")
        prefix = PrefixCacheConfig(mla_budget_bytes=int(args.prefix_mla_gb * 1e9),
                                   kda_budget_bytes=int(args.prefix_kda_gb * 1e9),
                                   page_size=args.page_size or 6144, block_size=args.prefix_block,
                                   stride=args.prefix_stride)
    engine_kwargs = dict(max_batch=args.max_batch, max_len=args.max_len, prefill_chunk=args.prefill_chunk,
                         tokenizer=tok, eos_ids=eos, mesh=mesh, sharding_preset=args.sharding_preset,
                         decode_block=args.decode_block, paged=args.paged or prefix is not None,
                         page_size=args.page_size, prefix_cache=prefix)
    if args.draft:
        from k3_jax.draft import load_vocab_map
        from k3_jax.serving.speculative import SpeculativeEngine, load_draft

        try:
            dcfg, dparams = load_draft(args.draft, cfg)
            vocab_map = load_vocab_map(args.draft, dcfg, cfg.vocab_size)
        except (FileNotFoundError, ValueError) as e:
            raise SystemExit(f"--draft {args.draft}: {e}") from None
        engine = SpeculativeEngine(cfg, params, dparams, dcfg, num_draft_tokens=args.draft_tokens,
                                   vocab_map=vocab_map, **engine_kwargs)
    else:
        engine = Engine(cfg, params, **engine_kwargs)

    if args.port is not None:
        import uvicorn

        from k3_jax.serving.media import MediaServingConfig
        from k3_jax.serving.server import DEFAULT_MAX_BODY_BYTES, create_app

        media = MediaServingConfig(max_items=args.max_images, allow_dir=args.image_dir)
        app = create_app(engine, tok, model_name=name, max_body_bytes=args.max_request_bytes or DEFAULT_MAX_BODY_BYTES,
                         media=media)
        print(
            f"serving '{name}' on http://{args.host}:{args.port}/v1 (max_batch={args.max_batch}, "
            f"max_len={args.max_len})",
            file=sys.stderr,
            flush=True,
        )
        uvicorn.run(app, host=args.host, port=args.port, log_level="info")
        return 0

    media = None
    if args.chat:
        content: str | list = args.prompt
        if args.image:
            from k3_jax.serving.media import chat_request_ids

            if cfg.vision is None:
                raise SystemExit("--image needs a vision model (a config with a vision_config)")
            parts = [{"type": "text", "text": args.prompt}]
            for path in args.image:
                if not Path(path).is_file():
                    raise SystemExit(f"--image {path}: no such file")
                parts.append({"type": "image", "image": Path(path).read_bytes()})
            content = parts
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": content}
        ]
        if args.image:
            ids, media = chat_request_ids(tok, messages, cfg)
        else:
            ids = chat_prompt_ids(tok, messages)
        stops = chat_stop_ids(tok)
    else:
        ids, stops = tok.encode(args.prompt), eos
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop_token_ids=tuple(stops),
    )
    rid = engine.add_request(ids, params, media=media)
    t0, n, first = time.perf_counter(), 0, None
    while engine.has_work:
        for ev in engine.step():
            if ev.request_id != rid:
                continue
            n += 1
            first = first or time.perf_counter()
            sys.stdout.write(ev.text)
            sys.stdout.flush()
            if ev.finished:
                reason = ev.finish_reason
    dt = time.perf_counter() - t0
    print(
        f"\n[{n} tokens, finish_reason={reason}, {dt:.2f}s incl. compile, time to first token {first - t0:.2f}s]",
        file=sys.stderr,
    )
    if args.draft:
        print(f"[speculative: {engine.spec.as_dict()}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

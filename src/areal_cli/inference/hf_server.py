"""Entry point of the built-in ``hf`` server (flag names follow ``sglang.launch_server``).

    python -m areal_cli.inference.hf_server --model-path DIR --host 127.0.0.1 --port 30000
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m areal_cli.inference.hf_server",
                                description="Built-in HF inference server speaking SGLang's HTTP protocol.")
    p.add_argument("--model-path", required=True, help="local HF causal-LM directory")
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto = float32 on CPU, the checkpoint's dtype on CUDA")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--tp-size", "--tp", dest="tp_size", type=int, default=1)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--max-prefill-tokens", type=int, default=8192)
    # From the environment too, so a launcher can set it without putting it in a logged command line.
    p.add_argument("--api-key", default=os.environ.get("AREAL_SERVER_API_KEY") or None)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--weight-version", default="0", help="initial policy version (integer)")
    p.add_argument("--allowed-weight-roots", nargs="*", default=None,
                   help="dirs /update_weights_from_disk may read (default: the model dir's parent and "
                        "the system temp dir)")
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--stock-attention", action="store_true",
                   help="keep HF's attention implementation (default: GQA-native SDPA, see server/attention.py)")
    p.add_argument("--decode-attention", default="auto", choices=["auto", "kernel", "torch"],
                   help="fast path's attention, RMSNorm and SiLU: fused C kernels built with the system "
                        "compiler, or torch ops; auto = the kernels for fp32 on CPU with one thread when they "
                        "build (see server/decode_kernel.py)")
    p.add_argument("--generate-endpoint", default="asgi", choices=["asgi", "fastapi"],
                   help="serve /generate from a plain ASGI handler (asgi) or the FastAPI route (fastapi)")
    p.add_argument("--max-lora-rank", type=int, default=256,
                   help="largest LoRA adapter rank /load_lora_adapter accepts (SGLang's flag)")
    p.add_argument("--max-loaded-loras", type=int, default=8,
                   help="LoRA adapters loaded at once (SGLang's flag); a further load is refused")
    p.add_argument("--prefix-cache-tokens", type=int, default=-1,
                   help="token budget of the prefix cache (KV of finished sequences reused by prompts that "
                        "start with them; LRU; dropped on every weight update): 0 = off, -1 = auto (as many "
                        "tokens as fit in 512 MiB of KV, at most 65536; the fast path only)")
    p.add_argument("--allowed-media-roots", nargs="*", default=None,
                   help="dirs whose images requests may name by local path or file:// URL (default: none; "
                        "images then come as data URLs or base64). http(s) URLs are always refused")
    p.add_argument("--max-image-pixels", type=int, default=None,
                   help="largest decoded image (width x height, before resizing) a request may send "
                        "(default: 4096 x 4096); a larger one is a 400")
    p.add_argument("--max-image-tokens", type=int, default=None,
                   help="image tokens one prompt's images may take after the processor's resize (default: "
                        "no cap but the context length); more is a 400")
    p.add_argument("--log-level", default="info")
    return p


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not _is_loopback(args.host) and not args.api_key:
        print(f"error: --host {args.host} is not a loopback address; binding it exposes weight-update "
              "endpoints to the network. Pass --api-key KEY (clients send 'Authorization: Bearer KEY').",
              file=sys.stderr)
        return 2
    if args.tp_size != 1:
        print("error: the hf server runs one process per model replica (--tp-size 1); use sglang or vllm "
              "for tensor parallelism.", file=sys.stderr)
        return 2
    if not os.path.isdir(args.model_path):
        print(f"error: --model-path {args.model_path} is not a directory", file=sys.stderr)
        return 2
    try:
        version = int(args.weight_version)
    except ValueError:
        print(f"error: --weight-version must be an integer, got {args.weight_version!r}", file=sys.stderr)
        return 2

    import torch
    import uvicorn
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    from areal_cli.inference.server.app import ServerState, build_app
    from areal_cli.inference.server.attention import use_areal_sdpa
    from areal_cli.inference.server.engine import GenerationEngine
    from areal_cli.inference.server.weights import default_allowed_roots

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if args.dtype == "auto":
        dtype = torch.float32 if device == "cpu" else "auto"
    else:
        dtype = getattr(torch, args.dtype)
    tok = AutoTokenizer.from_pretrained(args.tokenizer_path or args.model_path)
    # A vision-language dir (config.json has a vision_config): its images go through media.py / vision.py.
    vl = getattr(AutoConfig.from_pretrained(args.model_path), "vision_config", None) is not None
    auto = AutoModelForImageTextToText if vl else AutoModelForCausalLM
    model = auto.from_pretrained(args.model_path, dtype=dtype).to(device).eval()
    if not args.stock_attention and not vl:  # the vision tower's attention stays HF's own
        use_areal_sdpa(model)
    cfg = model.config.get_text_config()  # a VLM's vocabulary and context are its language model's
    ctx = args.context_length or getattr(cfg, "max_position_embeddings", None) or 4096
    try:
        engine = GenerationEngine(model, tok, device=device, max_running=args.max_running_requests,
                                  max_prefill_tokens=args.max_prefill_tokens, context_length=int(ctx),
                                  version=version, seed=args.random_seed,
                                  decode_attention=args.decode_attention,
                                  prefix_cache_tokens=args.prefix_cache_tokens)
    except ValueError as e:  # e.g. --decode-attention kernel without a C compiler
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        media = _media_handler(args, model) if vl else None
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if vl:
        from areal_cli.inference.server.vision import attach

        if not attach(engine):
            print(f"error: {args.model_path} has a vision_config but its model class has no get_rope_index "
                  "(the hf server serves Qwen2-VL-family vision-language models)", file=sys.stderr)
            return 2
    engine.adapters.max_rank, engine.adapters.max_adapters = args.max_lora_rank, args.max_loaded_loras
    state = ServerState(
        engine=engine, tokenizer=tok, model_path=os.path.abspath(args.model_path),
        served_model_name=args.served_model_name or os.path.basename(os.path.normpath(args.model_path)),
        context_length=int(ctx), vocab_size=int(cfg.vocab_size),
        allowed_roots=args.allowed_weight_roots or default_allowed_roots(args.model_path),
        api_key=args.api_key, asgi_generate=args.generate_endpoint == "asgi", media=media)
    app = build_app(state)
    from areal_cli.utils.procs import freeze_heap

    freeze_heap()
    engine.start()
    logging.getLogger("areal_cli.hf_server").info(
        "serving %s on %s:%d (device=%s dtype=%s attn=%s ctx=%d version=%d)", args.model_path, args.host,
        args.port, device, model.dtype, model.config._attn_implementation, ctx, version)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False,
                    timeout_graceful_shutdown=5, proxy_headers=False, timeout_keep_alive=SERVER_KEEPALIVE_S,
                    **_fast_uvicorn())
    finally:
        engine.shutdown()
    return 0


def _media_handler(args, model):
    """The request-side image handling of a vision-language model (server/media.py)."""
    from areal_cli.inference.server.media import DEFAULT_MAX_IMAGE_PIXELS, MediaHandler, MediaPolicy
    from areal_cli.models.tiny_vl import load_vl_processor

    roots = [os.path.realpath(r) for r in (args.allowed_media_roots or [])]
    for r in roots:
        if not os.path.isdir(r):
            raise ValueError(f"--allowed-media-roots {r} is not a directory")
    for flag, v in (("--max-image-pixels", args.max_image_pixels), ("--max-image-tokens", args.max_image_tokens)):
        if v is not None and v < 1:
            raise ValueError(f"{flag} must be >= 1, got {v}")
    proc = load_vl_processor(args.model_path)
    policy = MediaPolicy(allowed_roots=roots, max_image_pixels=args.max_image_pixels or DEFAULT_MAX_IMAGE_PIXELS,
                         max_image_tokens=args.max_image_tokens)
    return MediaHandler(proc.image_processor, model.config.image_token_id, policy)


# Idle connections stay open this long (uvicorn's default is 5 s): longer than any client's own idle
# limit (aiohttp 15 s, httpx 5 s, ours 3 s), so a client never writes to a connection being closed.
SERVER_KEEPALIVE_S = 75


def _fast_uvicorn() -> dict:
    """httptools' C parser and uvloop when installed (dependencies of areal-cli): with a tiny model the
    per-request HTTP cost is a large share of generation time, and h11 is pure Python."""
    import importlib.util

    out = {}
    if importlib.util.find_spec("httptools") is not None:
        out["http"] = "httptools"
    if importlib.util.find_spec("uvloop") is not None:
        out["loop"] = "uvloop"
    return out


if __name__ == "__main__":
    sys.exit(main())

"""`hf-kvcache serve [MODEL]`: transformers' OpenAI-compatible server with FP8 / INT8 / INT4 KV pages in a given KV
memory (hf_kvcache.paged.server). Every `transformers serve` option is a flag here too, read from transformers' own
`Serve` (so a new upstream option appears without a change here); `--cb-block-size` is the page size."""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys

from ..paged.compress_spec import CHUNK as COMPRESS_CHUNK
from ..paged.compress_spec import METHODS as COMPRESS_METHODS
from ..paged.compress_spec import parse as parse_compression
from ..paged.page_layout import LAYOUTS, default_layout
from ..paged.spec import KV_DTYPES, PagedKVSpec
from .args import positive_int

KV_CACHE_DTYPES = ("auto", *KV_DTYPES)  # auto (as in vLLM) and model: pages in the model's dtype
DEFAULT_KV_MEMORY = "1GiB"
SERVING_PACKAGES = ("fastapi", "uvicorn", "openai")  # transformers[serving], which transformers serve checks
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}


def memory_size(text: str) -> int:
    """Bytes from '512MiB', '2GiB', '1.5GB', '64M' or a plain number of bytes (argparse type of --kv-memory)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match and _UNITS.get(match.group(2).lower())
    if not match or unit is None or float(match.group(1)) * unit < 1:
        raise argparse.ArgumentTypeError(
            f"expected a size such as 512MiB, 2GiB, 1.5GB or a number of bytes (units: {', '.join(_UNITS)}), "
            f"got {text!r}"
        )
    return int(float(match.group(1)) * unit)


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({err})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def add_serve_command(sub) -> None:
    from ..integration.serving import serve_options

    p = sub.add_parser(
        "serve",
        help="transformers' OpenAI-compatible server with FP8 / INT8 / INT4 KV pages in a given KV memory",
        description="Run `transformers serve` (chat / completions / responses endpoints, continuous batching) for "
        "one model, with quantized KV pages sized from --kv-memory. Prints what the memory holds for the chosen "
        "format next to model-dtype pages, then serves until interrupted. GET /v1/kv_cache reports the pages and "
        "requests. See docs/serving.md.",
    )
    p.add_argument(
        "model",
        nargs="?",
        default="smollm2",
        help="Hub id, local path, <repo>:<file>.gguf, or an offline model: smollm2 (default) or gemma3",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="fp8_e4m3",
        choices=KV_CACHE_DTYPES,
        help="format of the KV pages (default fp8_e4m3; auto / model: the model's dtype)",
    )
    p.add_argument(
        "--kv-memory",
        type=memory_size,
        default=memory_size(DEFAULT_KV_MEMORY),
        metavar="SIZE",
        help=f"bytes of KV pages, e.g. 512MiB or 20GiB (default {DEFAULT_KV_MEMORY})",
    )
    p.add_argument(
        "--kv-cache-quantization",
        type=json_object,
        default=None,
        metavar="JSON",
        help="page format details: group_size, scale_dtype, key_rotation, attention (docs/serving.md)",
    )
    p.add_argument(
        "--kv-compress",
        default=None,
        metavar="SPEC",
        help="prompt eviction while each prompt prefills: 'none' (requests may ask through their kv_compress "
        f"field), METHOD[:FIELD=VALUE...] ({', '.join(COMPRESS_METHODS)}; budget: what each prompt keeps, "
        "a share in (0, 1] or a number of tokens, as generate's budget=; e.g. keydiff:budget=0.25:chunk=256 keeps "
        "25%% and also compresses every 256 prompt tokens; chunk=end: only at the prompt's end, the default but "
        f"for kvzap's {COMPRESS_CHUNK}) or a JSON object (docs/serving.md, docs/vocabulary.md; the old "
        "METHOD:RATIO, the share evicted, still works with a warning); default: no eviction",
    )
    p.add_argument(
        "--kv-layout",
        default=None,
        choices=LAYOUTS,
        help="how the pages hold what --kv-compress keeps: 'token' (transformers' rows of every KV head: every head "
        "and layer keeps the same tokens) or 'head' (pages of one layer and KV head: each its own budget, allotted "
        "over the model and the heads as KVzipCache allots them; docs/serving.md); default 'head' where this "
        "transformers lets attention read such pages (>= 5.24), else 'token'",
    )
    p.add_argument(
        "--typical-request-tokens",
        type=positive_int,
        default=1024,
        metavar="N",
        help="prompt + output tokens of the typical request in the start-up summary (default 1024)",
    )
    upstream = p.add_argument_group("transformers serve options")
    options = serve_options()
    for option in options:
        flag = "--" + option.name.replace("_", "-")
        text = option.help.replace("%", "%%")
        if option.type is bool:
            upstream.add_argument(
                flag, dest=option.name, action=argparse.BooleanOptionalAction, default=option.default, help=text
            )
        else:
            upstream.add_argument(
                flag,
                dest=option.name,
                type=option.type,
                default=option.default,
                choices=option.choices,
                help=f"{text} (default {option.default})",
            )
    p.set_defaults(func=_serve, serve_option_names=[o.name for o in options])


def _serve(args) -> int:
    from ..integration.serving import run
    from ..paged.server import DEFAULT_PAGE_SIZE, build_server
    from ..sharing.models import offline_path

    kv_dtype = "model" if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    PagedKVSpec.from_fields(kv_dtype, args.kv_cache_quantization)  # bad settings fail before the model loads
    kv_compress = args.kv_compress
    if kv_compress is not None and kv_compress.lstrip().startswith("{"):
        try:
            kv_compress = json_object(kv_compress)
        except argparse.ArgumentTypeError as error:
            raise ValueError(f"--kv-compress: {error}") from None
    spec = parse_compression(kv_compress, "--kv-compress")
    if args.kv_layout is not None and kv_compress is None:
        raise ValueError("--kv-layout lays out what eviction keeps: give --kv-compress too (e.g. none)")
    if spec is not None:
        spec.check_layout(args.kv_layout or default_layout(), "--kv-compress", "--kv-layout")
    missing = [name for name in SERVING_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        print(
            f"hf-kvcache serve: error: the server needs {missing}: pip install 'hf-kvcache[serving]' (or "
            "'transformers[serving]')",
            file=sys.stderr,
        )
        return 2
    options = {name: getattr(args, name) for name in args.serve_option_names}
    page_size = options.pop("cb_block_size", None) or DEFAULT_PAGE_SIZE
    model = offline_path(args.model)
    serve, plan = build_server(
        model,
        kv_dtype,
        args.kv_memory,
        args.kv_cache_quantization,
        page_size,
        options,
        alias=args.model,
        kv_compress=kv_compress,
        kv_layout=args.kv_layout,
    )
    for line in plan.lines(args.typical_request_tokens):
        print(line)
    print(
        f"Serving {args.model} on http://{options.get('host')}:{options.get('port')}/v1 (OpenAI API); "
        "GET /v1/kv_cache reports pages and requests.",
        flush=True,
    )
    run(serve)
    return 0

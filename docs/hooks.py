"""mkdocs hook: every page's generated blocks (``<!-- kvmix:KIND -->`` ... ``<!-- kvmix:end
-->``: the CLI and ``/metrics`` references, the methods table, benchmark tables and figures
from committed results) are made anew from the code and results at each build."""

from pathlib import Path

from kvmix.commands import pages


def on_page_markdown(markdown, page, config, files):
    root = Path(config["config_file_path"]).parent
    return pages.render(markdown, Path(config["docs_dir"]) / page.file.src_path, root)

"""Checks that the built documentation site names every public name: each name in the `__all__`
of `jaxamp`, `jaxamp.flax` (and its `linen`, `nnx`, `checkpoint`), `jaxamp.fp8`,
`jaxamp.optim_precision` and `jaxamp.mx` has its own entry (an element with
``id="<module>.<name>"``) on its API page. Run after ``mkdocs build``:
``python scripts/check_docs_api.py site``.
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

# module -> the API page that documents it (relative to the site folder)
PAGES = {
    "jaxamp": "api/jaxamp/index.html",
    "jaxamp.flax": "api/flax/index.html",
    "jaxamp.flax.linen": "api/flax/index.html",
    "jaxamp.flax.nnx": "api/flax/index.html",
    "jaxamp.flax.checkpoint": "api/flax/index.html",
    "jaxamp.fp8": "api/fp8/index.html",
    "jaxamp.optim_precision": "api/optim_precision/index.html",
    "jaxamp.mx": "api/mx/index.html",
}
# Submodules of jaxamp.flax are sections of their page, headed by their own name.
SECTIONS = {"jaxamp.flax.linen", "jaxamp.flax.nnx", "jaxamp.flax.checkpoint"}


def missing_names(site: Path) -> list[str]:
    missing = []
    for module_name, page in PAGES.items():
        html = (site / page).read_text()
        ids = set(re.findall(r'id="([^"]+)"', html))
        module = importlib.import_module(module_name)
        for name in module.__all__:
            address = f"{module_name}.{name}"
            if address in SECTIONS:
                found = f"<code>{address}</code>" in html
            else:
                found = address in ids
            if not found:
                missing.append(f"{address} (expected on {page})")
    return missing


def main(argv: list[str]) -> int:
    site = Path(argv[1] if len(argv) > 1 else "site")
    missing = missing_names(site)
    if missing:
        print("the documentation site does not name these public names:", file=sys.stderr)
        for line in missing:
            print(f"  {line}", file=sys.stderr)
        return 1
    total = sum(len(importlib.import_module(m).__all__) for m in PAGES)
    print(f"docs: every public name ({total}) has its entry on its API page")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

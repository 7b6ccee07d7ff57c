"""The `code-interpreter` image: what `base` has plus what E2B's code-interpreter template gives `run_code`
users — matplotlib (figures as PNG), pandas (DataFrames as HTML and data) and IPython (`from IPython.display
import ...`), from Debian's packages.

Built like `base` (mmdebstrap from the host's Debian mirror, so it needs no network inside a sandbox) with
`shoal image build code-interpreter`, or `ensure_interpreter_image` (once per store; concurrent builders wait
for one another). E2B's interpreter templates (`code-interpreter-v1`, `code-interpreter`) use it when the store
has it (shoal.server.compat.common.resolve_template).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from shoal.fsutil import flocked
from shoal.images.base import BASE_PACKAGES, build_base
from shoal.images.store import Image, ImageStore

INTERPRETER_IMAGE = "code-interpreter:latest"
#: python3-munkres satisfies python3-fonttools' "scipy | munkres": without it apt takes scipy, whose
#: pythran pulls a C++ compiler and boost (~600 MB more)
PACKAGES = ("python3-matplotlib", "python3-pandas", "python3-ipython", "python3-munkres")


def interpreter_packages() -> list[str]:
    """Every package the image is made of (base's, then the interpreter's)."""
    return [*BASE_PACKAGES, *PACKAGES]


def build_interpreter_image(store: ImageStore, ref: str = INTERPRETER_IMAGE, *,
                            log: Callable[[str], None] | None = None, work_dir: Path | None = None) -> Image:
    """Build the image (mmdebstrap; a few minutes) and tag it `ref`."""
    return build_base(store, ref, packages=interpreter_packages(), log=log, work_dir=work_dir)


def _current(store: ImageStore, ref: str) -> Image | None:
    """The image `ref` when it exists and was made of today's package list."""
    if not store.exists(ref):
        return None
    img = store.resolve(ref)
    made_of: set[str] = set()
    for layer in img.layers:
        made_of.update(layer.source.get("packages") or [])
    return img if set(interpreter_packages()) <= made_of else None


def ensure_interpreter_image(store: ImageStore, ref: str = INTERPRETER_IMAGE, *,
                             log: Callable[[str], None] | None = None, work_dir: Path | None = None) -> Image:
    """The interpreter image, built first when the store lacks it (host-wide lock: one build at a time)."""
    img = _current(store, ref)
    if img is not None:
        return img
    lock = Path(store.tmp_dir) / f".build-{ref.replace('/', '_').replace(':', '_')}.lock"
    with flocked(lock):  # another process may be building it: wait, then look again
        img = _current(store, ref)
        if img is None:
            img = build_interpreter_image(store, ref, log=log, work_dir=work_dir)
        return img

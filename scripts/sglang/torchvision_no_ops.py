"""Let PyPI's torchvision import without its C++ ops, for SGLang on CPU.

`import sglang` imports torchvision.transforms (a multimodal config module). PyPI's
torchvision is a CUDA build: beside torch 2.13.0+cpu its ops library does not load, and
its _meta_registrations.py then fails at import (`operator torchvision::nms does not
exist`) registering fake kernels for the missing nms/qnms ops. This skips those two
registrations when torchvision.extension._has_ops() is false; text generation never calls
them. Idempotent; exits 1 if the decorators are not where expected (a new torchvision).

    VENV/bin/python torchvision_no_ops.py
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

GUARD = '__import__("torchvision").extension._has_ops()'


def main() -> int:
    spec = importlib.util.find_spec("torchvision")  # finds the package without importing it
    if spec is None or spec.origin is None:
        print("torchvision is not installed", file=sys.stderr)
        return 1
    path = Path(spec.origin).parent / "_meta_registrations.py"
    text = path.read_text()
    patched = 0
    for op in ("nms", "qnms"):
        plain = f'@torch.library.register_fake("torchvision::{op}")'
        guarded = f"@(torch.library.register_fake(\"torchvision::{op}\") if {GUARD} else (lambda f: f))"
        if guarded in text:
            patched += 1
        elif plain in text:
            text = text.replace(plain, guarded)
            patched += 1
    if patched != 2:
        print(f"{path}: the nms/qnms register_fake decorators were not found", file=sys.stderr)
        return 1
    path.write_text(text)
    print(f"{path}: nms/qnms fake kernels registered only when torchvision's ops load")
    return 0


if __name__ == "__main__":
    sys.exit(main())

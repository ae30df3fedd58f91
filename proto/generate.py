"""Generate the Python modules for proto/spec.proto; ``--check`` fails when they are stale.

Usage: python proto/generate.py [--check]
"""

from __future__ import annotations

import argparse
import difflib
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = "spec.proto"
OUTPUTS = ("spec_pb2.py", "spec_pb2_grpc.py", "spec_pb2.pyi")


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc

    rc = protoc.main(["protoc", f"-I{HERE}", f"--python_out={out_dir}", f"--grpc_python_out={out_dir}",
                      f"--pyi_out={out_dir}", str(HERE / PROTO)])
    if rc != 0:
        raise SystemExit(f"protoc failed with {rc}")
    grpc_module = out_dir / "spec_pb2_grpc.py"
    # grpc_tools writes a top-level import; the modules live in the `proto` package.
    text = grpc_module.read_text().replace("import spec_pb2 as spec__pb2", "from proto import spec_pb2 as spec__pb2")
    grpc_module.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the checked-in modules are stale")
    args = parser.parse_args()
    if not args.check:
        generate(HERE)
        return
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = []
        for name in OUTPUTS:
            fresh = (Path(tmp) / name).read_text()
            current = (HERE / name).read_text() if (HERE / name).exists() else ""
            if fresh != current:
                stale.append(name)
                sys.stderr.writelines(difflib.unified_diff(current.splitlines(True), fresh.splitlines(True), name, name, n=1))
    if stale:
        raise SystemExit(f"stale generated modules: {', '.join(stale)}; run python proto/generate.py")


if __name__ == "__main__":
    main()

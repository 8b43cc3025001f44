"""benchmarks.slim_wheel: what travels to a lent device is a wheel pip and importlib.metadata still read whole."""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as md
import zipfile
from pathlib import Path

from benchmarks.slim_wheel import slim

VENDORED_RECORD = "pkg/__init__.py,sha256=abc,3\npkg-1.0.dist-info/RECORD,,\n"


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def _wheel(folder: Path) -> Path:
    files = {
        "demo/__init__.py": b"x = 1\n",
        "demo/jars/big.jar": b"\0" * 4096,
        "demo/web/app.js.map": b"{}",
        "demo/web/app.js": b"let a;",
        "demo/vendored/pkg/__init__.py": b"y=2",
        "demo/vendored/pkg-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: pkg\nVersion: 1.0\n",
        "demo/vendored/pkg-1.0.dist-info/RECORD": VENDORED_RECORD.encode(),
        "demo-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n",
        "demo-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "\n".join(_record_line(n, d) for n, d in files.items()) + "\ndemo-1.0.dist-info/RECORD,,\n"
    path = folder / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("demo-1.0.dist-info/RECORD", record)
    return path


def test_slimmed_wheel_drops_what_matches_and_keeps_every_record_readable(tmp_path: Path) -> None:
    out = slim(_wheel(tmp_path), tmp_path / "slim", ("demo/jars/*", "*.js.map"))
    with zipfile.ZipFile(out) as z:
        names = set(z.namelist())
        record = z.read("demo-1.0.dist-info/RECORD").decode()
        vendored = z.read("demo/vendored/pkg-1.0.dist-info/RECORD").decode()
        z.extractall(tmp_path / "site")
    assert "demo/jars/big.jar" not in names and "demo/web/app.js.map" not in names
    assert {"demo/__init__.py", "demo/web/app.js", "demo/vendored/pkg/__init__.py"} <= names
    # The wheel's own RECORD lists exactly what is left; a vendored package's RECORD (paths relative to its own
    # folder, as Ray's thirdparty_files) is not the wheel's to rewrite: emptied, it broke transformers' import.
    assert {line.split(",")[0] for line in record.splitlines()} == names
    assert vendored == VENDORED_RECORD
    for folder in (tmp_path / "site", tmp_path / "site" / "demo" / "vendored"):
        for dist in md.distributions(path=[str(folder)]):
            assert dist.files, dist.metadata["Name"]

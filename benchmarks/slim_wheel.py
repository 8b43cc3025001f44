"""Rewrite a wheel without the parts a run does not import, so it fits what travels to a lent device.

Ray's wheel is 79 MB, over the 64 MiB that a device call carries; a third of it is Java (ray/jars) and much of
the rest libraries Hearth never imports (RLlib, Tune, Data, the dashboard's web client). Its RECORD is rewritten
to list only what is kept, so pip installs the result as it would the original.

    python -m benchmarks.slim_wheel WHEEL OUT_DIR PATTERN [PATTERN ...]     (fnmatch patterns: 'ray/jars/*', '*.map')
"""

from __future__ import annotations

import fnmatch
import sys
import zipfile
from pathlib import Path


def slim(wheel: Path, out_dir: Path, drop: tuple[str, ...]) -> Path:
    """A copy of `wheel` in `out_dir` without the members matching any pattern of `drop`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / wheel.name
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst:
        kept = [i for i in src.infolist() if not any(fnmatch.fnmatch(i.filename, p) for p in drop)]
        names = {i.filename for i in kept}
        for info in kept:
            data = src.read(info)
            # Only the wheel's own RECORD: vendored packages inside it (ray/thirdparty_files) carry RECORDs of
            # their own, relative to their folder, which must stay as they are.
            if info.filename.count("/") == 1 and info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                data = ("\n".join(line for line in lines if line.split(",", 1)[0] in names or
                                  line.split(",", 1)[0] == info.filename) + "\n").encode()
            dst.writestr(info, data)
    return target


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    path = slim(Path(sys.argv[1]), Path(sys.argv[2]), tuple(sys.argv[3:]))
    print(f"{path}: {path.stat().st_size / 1e6:.1f} MB")
